"""Lowering the learning rate when a monitored metric stops improving.

Lightning's ``configure_optimizers`` may return::

    {"optimizer": optax.adam(1e-3),
     "lr_scheduler": {"scheduler": jl.ReduceLROnPlateau(patience=2), "monitor": "val_loss"}}

The optimizer is then followed by `jaxlightning.training.scales.scale_updates`,
which multiplies every update by a scale kept in the optimizer state (a traced
value: changing it recompiles nothing, and it is checkpointed with the state).
After each training epoch the scheduler's `PlateauStepper` callback (added to
the fit by the Trainer) feeds the monitored value to torch's
``ReduceLROnPlateau`` rule on the host and writes the new scale into the train
state through ``trainer.edit``, as `StochasticWeightAveraging` steers its own
transformation. For optimizers whose update is proportional to the learning
rate (SGD, Adam, AdamW, ...), scaling the update is lowering the rate.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from jaxlightning.callbacks.base import Callback
from jaxlightning.training.scales import PlateauScaleState


class ReduceLROnPlateau:
    """torch's ``ReduceLROnPlateau`` rule, on a scale of the optimizer's rate.

    Args:
        mode: ``"min"`` (the metric should fall) or ``"max"``.
        factor: the scale is multiplied by it on a plateau.
        patience: epochs without improvement tolerated before lowering.
        threshold: how much better counts as an improvement.
        threshold_mode: ``"rel"`` (relative to the best) or ``"abs"``.
        cooldown: epochs to wait after a lowering before counting again.
        min_scale: the scale never goes below it (torch's ``min_lr``, as a
            fraction of the optimizer's own rate).
        eps: a lowering smaller than this is skipped.
    """

    def __init__(
        self,
        mode: str = "min",
        factor: float = 0.1,
        patience: int = 10,
        threshold: float = 1e-4,
        threshold_mode: str = "rel",
        cooldown: int = 0,
        min_scale: float = 0.0,
        eps: float = 1e-8,
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"ReduceLROnPlateau(mode={mode!r}): use 'min' or 'max'")
        if threshold_mode not in ("rel", "abs"):
            raise ValueError(
                f"ReduceLROnPlateau(threshold_mode={threshold_mode!r}): use 'rel' or 'abs'"
            )
        if not 0.0 < factor < 1.0:
            raise ValueError(f"ReduceLROnPlateau(factor={factor}): use a number in (0, 1)")
        self.mode, self.factor, self.patience = mode, factor, patience
        self.threshold, self.threshold_mode = threshold, threshold_mode
        self.cooldown, self.min_scale, self.eps = cooldown, min_scale, eps
        self.scale = 1.0
        self.best = math.inf if mode == "min" else -math.inf
        self.num_bad_epochs = 0
        self.cooldown_counter = 0

    def _better(self, value: float) -> bool:
        if self.mode == "min":
            edge = (
                self.best * (1 - self.threshold)
                if self.threshold_mode == "rel"
                else (self.best - self.threshold)
            )
            return value < edge
        edge = (
            self.best * (1 + self.threshold)
            if self.threshold_mode == "rel"
            else (self.best + self.threshold)
        )
        return value > edge

    def step(self, value: float) -> float:
        """Takes one epoch's monitored ``value``; returns the scale from now on."""
        if self._better(value):
            self.best, self.num_bad_epochs = value, 0
        else:
            self.num_bad_epochs += 1
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.num_bad_epochs = 0
        if self.num_bad_epochs > self.patience:
            lowered = max(self.scale * self.factor, self.min_scale)
            if self.scale - lowered > self.eps:
                self.scale = lowered
            self.cooldown_counter, self.num_bad_epochs = self.cooldown, 0
        return self.scale

    def stepper(self, monitor: str) -> PlateauStepper:
        """The callback that steps this scheduler in a fit, on ``monitor``."""
        return PlateauStepper(self, monitor)

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "best": self.best,
            "num_bad_epochs": self.num_bad_epochs,
            "cooldown_counter": self.cooldown_counter,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.best = float(state["best"])
        self.num_bad_epochs = int(state["num_bad_epochs"])
        self.cooldown_counter = int(state["cooldown_counter"])


class PlateauStepper(Callback):
    """Steps a `ReduceLROnPlateau` after every training epoch with the monitored
    value and writes its scale into the train state. Added by the Trainer for a
    fit whose ``configure_optimizers`` asked for one; its state is checkpointed."""

    def __init__(self, scheduler: ReduceLROnPlateau, monitor: str) -> None:
        self.scheduler = scheduler
        self.monitor = monitor

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        metrics = trainer.callback_metrics
        if self.monitor not in metrics:
            raise RuntimeError(
                f"ReduceLROnPlateau is conditioned on {self.monitor!r}, which is not available "
                f"after this epoch; available: {sorted(metrics)}. Log it (self.log in "
                "validation_step), or set 'monitor' in the lr_scheduler dict"
            )
        before = self.scheduler.scale
        if self.scheduler.step(float(np.asarray(metrics[self.monitor]))) != before:
            trainer.edit.set_optimizer_state(PlateauScaleState, scale=self.scheduler.scale)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)
