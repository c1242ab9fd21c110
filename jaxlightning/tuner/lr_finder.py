"""`Tuner.lr_find`: a learning-rate range test with the rate traced, not recompiled.

Lightning's finder writes a new rate into the torch optimizer before every
step. An optax optimizer is compiled into the step, so here the module's
learning-rate attribute is set, for the test, to an optax *schedule* (a function
of the update count) that grows from ``min_lr`` to ``max_lr``: the
``configure_optimizers`` the user wrote builds its optimizer from it as usual,
and every step of the test runs the one compiled program with its own rate.
A few hundred steps train a copy of the run (a throwaway Trainer on the same
devices and strategy); the module's variables and attribute are put back
afterwards, as Lightning restores its initial weights.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np
import optax

from jaxlightning import checks
from jaxlightning.callbacks.base import Callback
from jaxlightning.trainer import Trainer


@dataclasses.dataclass
class LRFinder:
    """The result of `Tuner.lr_find` (Lightning's ``_LRFinder``).

    Attributes:
        results: ``{"lr": [...], "loss": [...]}``, one entry per step run; the
            loss is smoothed exponentially (factor ``beta``) and bias-corrected,
            as Lightning records it.
        mode: ``"exponential"`` or ``"linear"``.
    """

    results: dict[str, list[float]]
    mode: str

    def suggestion(self, skip_begin: int = 10, skip_end: int = 1) -> float | None:
        """The rate where the smoothed loss falls fastest (the most negative
        gradient), between the first ``skip_begin`` and the last ``skip_end``
        steps; ``None`` when too few steps ran."""
        lrs = np.asarray(self.results["lr"][skip_begin : -skip_end or None])
        losses = np.asarray(self.results["loss"][skip_begin : -skip_end or None])
        finite = np.isfinite(losses)
        lrs, losses = lrs[finite], losses[finite]
        if len(losses) < 2:
            return None
        return float(lrs[int(np.argmin(np.gradient(losses)))])

    def plot(self, suggest: bool = False, show: bool = False, ax: Any = None) -> Any:
        """Loss against learning rate (log scale for ``"exponential"``), with the
        suggestion marked when ``suggest``; needs matplotlib. Returns the figure."""
        try:
            import matplotlib.pyplot as plt
        except ImportError as exc:
            needs = "LRFinder.plot needs matplotlib: pip install 'jaxlightning[plot]'"
            raise ImportError(needs) from exc
        fig, ax = plt.subplots() if ax is None else (ax.figure, ax)
        ax.plot(self.results["lr"], self.results["loss"])
        if self.mode == "exponential":
            ax.set_xscale("log")
        ax.set_xlabel("Learning rate")
        ax.set_ylabel("Loss")
        if suggest and (lr := self.suggestion()) is not None:
            at = self.results["lr"].index(lr)
            ax.plot(lr, self.results["loss"][at], markersize=10, marker="o", color="red")
        if show:
            plt.show()
        return fig


def sweep(min_lr: float, max_lr: float, steps: int, mode: str) -> optax.Schedule:
    """The rate of update ``count`` (0-based): ``min_lr`` to ``max_lr`` over
    ``steps`` updates, evenly in log space (``"exponential"``) or linearly."""
    last = max(steps - 1, 1)
    if mode == "exponential":
        return lambda count: min_lr * (max_lr / min_lr) ** (count / last)
    return lambda count: min_lr + (max_lr - min_lr) * count / last


class _Recorder(Callback):
    """Records each update's rate and smoothed loss; stops on divergence, by
    Lightning's rule (``_LRCallback``): the loss is averaged exponentially
    (``beta``) and bias-corrected at update ``global_step``; the first two
    updates set the best loss and are never divergent; later, a smoothed loss
    above ``threshold`` times the best (or not finite) stops the test."""

    def __init__(self, schedule: optax.Schedule, threshold: float | None, beta: float) -> None:
        self.schedule, self.threshold, self.beta = schedule, threshold, beta
        self.lrs: list[float] = []
        self.losses: list[float] = []
        self._average, self._best = 0.0, np.inf

    def on_train_batch_end(self, trainer: Any, module: Any, batch_idx: int) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return  # a micro-batch: the update (and its loss) comes later
        loss = float(trainer.callback_metrics["train/loss"])
        step = trainer.global_step  # updates so far, this one included
        self.lrs.append(float(self.schedule(len(self.lrs))))
        self._average = self.beta * self._average + (1 - self.beta) * loss
        smoothed = self._average / (1 - self.beta ** (step + 1))
        self.losses.append(smoothed)
        diverged = not np.isfinite(smoothed) or smoothed > (self.threshold or 0) * self._best
        if self.threshold is not None and step > 1 and diverged:
            trainer.should_stop = True
        if smoothed < self._best or step == 1:
            self._best = smoothed


def _rate_owner(model: Any, attr_name: str) -> tuple[Any, str]:
    """Where the learning rate lives: ``(hparams or model, name)``, looked up
    as Lightning does (``attr_name``, else ``lr`` then ``learning_rate``)."""
    names = [attr_name] if attr_name else ["lr", "learning_rate"]
    for name in names:
        hparams = getattr(model, "hparams", None)
        if hparams is not None and name in hparams:
            return hparams, name
        if hasattr(model, name):
            return model, name
    raise AttributeError(
        f"lr_find found no learning rate on {type(model).__name__}: looked for "
        f"{' and '.join(repr(n) for n in names)} as an attribute or hyperparameter. Keep the "
        "rate there and build the optimizer from it in configure_optimizers, or pass attr_name"
    )


def lr_find(
    trainer: Any,
    model: Any,
    train_dataloaders: Any = None,
    datamodule: Any = None,
    *,
    min_lr: float = 1e-8,
    max_lr: float = 1.0,
    num_training: int = 100,
    mode: str = "exponential",
    early_stop_threshold: float | None = 4.0,
    update_attr: bool = True,
    attr_name: str = "",
    beta: float = 0.98,
) -> LRFinder:
    """See `jaxlightning.Tuner.lr_find`."""
    if mode not in ("exponential", "linear"):
        raise ValueError(f'mode must be "exponential" or "linear", got {mode!r}')
    checks.int_arg("num_training", num_training, minimum=2)
    if min_lr <= 0 or max_lr <= 0:
        raise ValueError(f"lr_find needs positive rates, got min_lr={min_lr}, max_lr={max_lr}")
    owner, name = _rate_owner(model, attr_name)
    schedule = sweep(min_lr, max_lr, num_training, mode)
    recorder = _Recorder(schedule, early_stop_threshold, beta)
    args = trainer.args  # the probe's updates are the trainer's
    probe = Trainer(
        max_steps=num_training,
        devices=list(trainer.strategy.devices),
        strategy=copy.copy(trainer.strategy),
        precision=args.precision,
        gradient_clip_val=args.gradient_clip_val,
        gradient_clip_algorithm=args.gradient_clip_algorithm,
        accumulate_grad_batches=args.accumulate_grad_batches,
        seed=trainer.seed,
        log_every_n_steps=1,
        log_loss=True,  # the recorder reads each step's train/loss
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
    )
    rate = getattr(model, name) if owner is model else owner[name]
    variables = model.variables
    _set(owner, model, name, schedule)
    try:
        probe.fit(model, train_dataloaders, datamodule=datamodule)
    except (TypeError, ValueError) as exc:
        if "Tracer" not in str(exc) and "function" not in str(exc):
            raise
        raise TypeError(
            f"lr_find sets {name} to an optax schedule (a function of the step) for the test, "
            f"and configure_optimizers could not use it ({exc}). Pass the rate to optax as it "
            "is (optax.adam(self.hparams.lr)); a schedule of your own built around it cannot be "
            "swept"
        ) from exc
    finally:
        _set(owner, model, name, rate)
        model.variables = variables
    finder = LRFinder({"lr": recorder.lrs, "loss": recorder.losses}, mode)
    suggested = finder.suggestion()
    if update_attr and suggested is not None:
        _set(owner, model, name, suggested)
    return finder


def _set(owner: Any, model: Any, name: str, value: Any) -> None:
    if owner is model:
        setattr(model, name, value)
    else:
        owner[name] = value
        if hasattr(model, name):
            setattr(model, name, value)
