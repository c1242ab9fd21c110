"""A tqdm progress bar: one bar per training epoch, one per evaluation run."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from jaxlightning.callbacks.base import Callback

if TYPE_CHECKING:
    from jaxlightning.callbacks.view import TrainerView
    from jaxlightning.module import JaxModule


class _SteadyTqdm(tqdm):
    """tqdm whose rate leaves out the first step, which includes compilation."""

    _first_done: float | None = None

    def update(self, n: int = 1) -> bool | None:
        if self._first_done is None:
            self._first_done = time.perf_counter()
            self._n_at_first = self.n + n
        return super().update(n)

    @property
    def format_dict(self) -> dict[str, Any]:
        d = super().format_dict
        if self._first_done is not None:
            steps = self.n - self._n_at_first
            elapsed = time.perf_counter() - self._first_done
            d["rate"] = steps / elapsed if steps > 0 and elapsed > 0 else None
        return d


def _fmt(value: float) -> str:
    return f"{value:.4g}"


class TQDMProgressBar(Callback):
    """Progress bars with the latest fetched metrics in the postfix.

    The postfix shows ``trainer.progress_bar_metrics``: the values logged with
    ``prog_bar=True`` (and ``train/loss`` under ``Trainer(log_loss=True)``).
    It changes only when the Trainer has fetched new values (at its logging
    interval and after validation), so the bar never forces a sync, and a new
    epoch's bar starts with the latest ones.

    Args:
        refresh_rate: redraw at most every this many steps.
    """

    def __init__(self, refresh_rate: int = 1) -> None:
        self.refresh_rate = refresh_rate
        self._bar: _SteadyTqdm | None = None
        self._last_bar: _SteadyTqdm | None = None
        self._eval_bar: _SteadyTqdm | None = None
        self._shown: object = None

    @property
    def train_progress_bar(self) -> Any:
        """The training epoch's tqdm bar (after an epoch, its last one): its
        ``total`` is the epoch's batches, bounded by ``max_steps``."""
        return self._bar if self._bar is not None else self._last_bar

    def _postfix(self, trainer: TrainerView, bar: _SteadyTqdm) -> None:
        metrics = trainer.progress_bar_metrics
        if metrics is not self._shown:
            self._shown = metrics
            bar.set_postfix({k: _fmt(v) for k, v in metrics.items()}, refresh=False)

    def on_train_epoch_start(self, trainer: TrainerView, module: JaxModule) -> None:
        self._bar = _SteadyTqdm(
            total=trainer.num_training_batches,
            desc=f"Epoch {trainer.current_epoch}",
            unit="step",
            dynamic_ncols=True,
            miniters=self.refresh_rate,
            # A new bar shows the latest values from its first frame, not only
            # from the next fetch on.
            postfix={k: _fmt(v) for k, v in trainer.progress_bar_metrics.items()},
        )
        self._shown = trainer.progress_bar_metrics

    def needs_each_step(self) -> bool:
        """The bar counts batches and shows reported values: it reads no step's
        own state, so several steps may run per dispatch beneath it."""
        return False

    def on_train_batch_end(self, trainer: TrainerView, module: JaxModule, batch_idx: int) -> None:
        if self._bar is not None:
            self._postfix(trainer, self._bar)
            self._bar.update(1)

    def on_train_epoch_end(self, trainer: TrainerView, module: JaxModule) -> None:
        if self._bar is not None:
            self._postfix(trainer, self._bar)
            self._bar.close()
            self._last_bar, self._bar = self._bar, None

    def _eval_start(self, trainer: TrainerView, desc: str) -> None:
        self._eval_bar = _SteadyTqdm(
            total=trainer.num_eval_batches,
            desc=desc,
            unit="batch",
            leave=self._bar is None,
            dynamic_ncols=True,
        )

    def _eval_batch(self) -> None:
        if self._eval_bar is not None:
            self._eval_bar.update(1)

    def _eval_end(self) -> None:
        if self._eval_bar is not None:
            self._eval_bar.close()
            self._eval_bar = None

    def on_validation_start(self, trainer: TrainerView, module: JaxModule) -> None:
        self._eval_start(trainer, "Validation")

    def on_validation_batch_end(
        self, trainer: TrainerView, module: JaxModule, batch_idx: int
    ) -> None:
        self._eval_batch()

    def on_validation_end(self, trainer: TrainerView, module: JaxModule) -> None:
        self._eval_end()

    def on_test_start(self, trainer: TrainerView, module: JaxModule) -> None:
        self._eval_start(trainer, "Test")

    def on_test_batch_end(self, trainer: TrainerView, module: JaxModule, batch_idx: int) -> None:
        self._eval_batch()

    def on_test_end(self, trainer: TrainerView, module: JaxModule) -> None:
        self._eval_end()

    def on_predict_start(self, trainer: TrainerView, module: JaxModule) -> None:
        self._eval_start(trainer, "Predict")

    def on_predict_batch_end(self, trainer: TrainerView, module: JaxModule, batch_idx: int) -> None:
        self._eval_batch()

    def on_predict_end(self, trainer: TrainerView, module: JaxModule) -> None:
        self._eval_end()
