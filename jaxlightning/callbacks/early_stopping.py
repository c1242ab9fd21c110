"""`EarlyStopping`: stop training when a monitored metric stops improving."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from jaxlightning import distributed
from jaxlightning.callbacks.base import Callback

if TYPE_CHECKING:
    from jaxlightning.callbacks.view import TrainerView
    from jaxlightning.module import JaxModule


class EarlyStopping(Callback):
    """Sets ``trainer.should_stop`` when ``monitor`` has not improved for
    ``patience`` checks, as Lightning's callback of the same name does.

    A check happens after each validation of `fit` (or, with
    ``check_on_train_epoch_end=True``, at each training epoch's end, for a
    ``train/...`` metric). Training then stops before the next step. Its state
    (best score, checks without improvement) is saved in checkpoints, so a
    resumed run stops where an uninterrupted one would.

    Args:
        monitor: a name in ``trainer.callback_metrics``, e.g. ``"val/loss"``.
        min_delta: the least change that counts as an improvement.
        patience: checks without improvement before stopping.
        mode: ``"min"`` or ``"max"``.
        strict: raise if ``monitor`` is missing at a check (else skip the check).
        check_finite: stop when the value is NaN or infinite.
        stopping_threshold: stop as soon as the value is better than this.
        divergence_threshold: stop as soon as the value is worse than this.
        check_on_train_epoch_end: check at training epoch ends instead of
            after validations.
        verbose: print why training stops (process 0).

    Attributes:
        best_score: the best value seen.
        wait_count: checks since it last improved.
        stopped_epoch: the epoch in which it stopped training (0 if it did not).
        stopping_reason: why it stopped ("" if it did not).
    """

    def __init__(
        self,
        monitor: str,
        min_delta: float = 0.0,
        patience: int = 3,
        mode: str = "min",
        strict: bool = True,
        check_finite: bool = True,
        stopping_threshold: float | None = None,
        divergence_threshold: float | None = None,
        check_on_train_epoch_end: bool = False,
        verbose: bool = False,
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping(mode={mode!r}): use 'min' or 'max'")
        if patience < 0:
            raise ValueError(f"EarlyStopping(patience={patience}): use 0 or more")
        self.monitor, self.mode = monitor, mode
        self.min_delta, self.patience = abs(min_delta), patience
        self.strict, self.check_finite = strict, check_finite
        self.stopping_threshold = stopping_threshold
        self.divergence_threshold = divergence_threshold
        self.check_on_train_epoch_end = check_on_train_epoch_end
        self.verbose = verbose
        self.best_score = math.inf if mode == "min" else -math.inf
        self.wait_count = 0
        self.stopped_epoch = 0
        self.stopping_reason = ""

    def _better(self, value: float, than: float) -> bool:
        return value < than if self.mode == "min" else value > than

    def on_validation_end(self, trainer: TrainerView, module: JaxModule) -> None:
        # the sanity check's values are discarded: nothing to judge there
        if (
            not self.check_on_train_epoch_end
            and trainer.stage == "fit"
            and not trainer.sanity_checking
        ):
            self._check(trainer)

    def on_train_epoch_end(self, trainer: TrainerView, module: JaxModule) -> None:
        if self.check_on_train_epoch_end and trainer.epoch_completed:
            self._check(trainer)

    def _check(self, trainer: TrainerView) -> None:
        if trainer.fast_dev_run:  # a smoke test of the run, not one to judge (Lightning's rule)
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            if self.strict:
                raise KeyError(
                    f"EarlyStopping(monitor={self.monitor!r}): no such metric (have "
                    f"{sorted(trainer.callback_metrics)}); pass strict=False to skip checks "
                    "without it"
                )
            return
        reason = self.decide(float(value))
        if reason:
            self.stopping_reason = reason
            self.stopped_epoch = trainer.current_epoch
            trainer.should_stop = True
            if self.verbose and distributed.is_rank_zero():
                print(f"EarlyStopping: {reason}", flush=True)

    def decide(self, value: float) -> str:
        """Updates the state with a new ``value``; returns why to stop ("" to go on)."""
        name = self.monitor
        if self.check_finite and not math.isfinite(value):
            return f"{name} = {value} is not finite"
        if self.stopping_threshold is not None and self._better(value, self.stopping_threshold):
            return f"{name} = {value:.6g} reached the stopping threshold {self.stopping_threshold}"
        if self.divergence_threshold is not None and self._better(self.divergence_threshold, value):
            return f"{name} = {value:.6g} diverged past {self.divergence_threshold}"
        shift = -self.min_delta if self.mode == "min" else self.min_delta
        if self._better(value, self.best_score + shift):
            self.best_score, self.wait_count = value, 0
            return ""
        self.wait_count += 1
        if self.wait_count >= self.patience:
            return (
                f"{name} did not improve by more than {self.min_delta} in {self.wait_count} "
                f"checks; best {self.best_score:.6g}"
            )
        return ""

    def state_dict(self) -> dict[str, Any]:
        return {
            "best_score": self.best_score,
            "wait_count": self.wait_count,
            "stopped_epoch": self.stopped_epoch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_score = float(state["best_score"])
        self.wait_count = int(state["wait_count"])
        self.stopped_epoch = int(state["stopped_epoch"])
