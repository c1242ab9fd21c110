"""`LearningRateMonitor`: log the learning rate the optimizer actually used."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxlightning.callbacks.base import Callback

if TYPE_CHECKING:
    from jaxlightning.callbacks.view import TrainerView
    from jaxlightning.module import JaxModule


def injected_rates(opt_state: Any) -> dict[str, float]:
    """The learning rates in ``optax.inject_hyperparams`` states of ``opt_state``,
    by their place in it (``""`` for a single one)."""
    found: dict[str, float] = {}

    def visit(node: Any, path: str) -> None:
        hyperparams = getattr(node, "hyperparams", None)
        if isinstance(hyperparams, dict) and "learning_rate" in hyperparams:
            found[path] = float(np.asarray(jax.device_get(hyperparams["learning_rate"])))
            return
        children = (
            node.items()
            if isinstance(node, dict)
            else enumerate(node)
            if isinstance(node, (tuple, list))
            else ()
        )
        for key, child in children:
            visit(child, f"{path}/{key}" if path else str(key))

    visit(opt_state, "")
    return found


class LearningRateMonitor(Callback):
    """Logs ``lr-<name>`` (Lightning's key) with the learning rate of each update.

    The rate comes from the optimizer state of ``optax.inject_hyperparams``
    (the rate the last update used; reading it waits for the steps in flight,
    once per logging interval), or, with ``schedule``, from that schedule at the
    update's step, on the host, with no device sync.

    Args:
        logging_interval: ``"step"`` (at each ``log_every_n_steps`` report) or
            ``"epoch"`` (at each epoch's end).
        schedule: an optax schedule ``step -> rate`` to log instead.
        name: the logged name (default ``"lr-<optimizer>"``, as in Lightning).
    """

    def __init__(
        self,
        logging_interval: str = "step",
        schedule: Callable[[int], Any] | None = None,
        name: str | None = None,
    ) -> None:
        if logging_interval not in ("step", "epoch"):
            raise ValueError(f"logging_interval={logging_interval!r}: use 'step' or 'epoch'")
        self.logging_interval, self.schedule, self.name = logging_interval, schedule, name
        self._logged_at = -1

    def _rates(self, trainer: TrainerView, module: JaxModule) -> dict[str, float]:
        if self.schedule is not None:  # the rate of the update that made global_step
            return {"": float(self.schedule(max(trainer.global_step - 1, 0)))}
        rates = injected_rates(trainer.state.opt_state)
        if not rates:
            raise ValueError(
                "LearningRateMonitor found no learning rate in the optimizer state: build the "
                "optimizer with optax.inject_hyperparams(optax.adam)(learning_rate=...), or "
                "pass LearningRateMonitor(schedule=...)"
            )
        return rates

    def _log(self, trainer: TrainerView, module: JaxModule) -> None:
        if trainer.global_step == self._logged_at or trainer.global_step == 0:
            return
        self._logged_at = trainer.global_step
        base = self.name or f"lr-{type(module).__name__}"
        for where, rate in self._rates(trainer, module).items():
            module.log(f"{base}/{where}" if where else base, rate)

    def on_train_batch_end(self, trainer: TrainerView, module: JaxModule, batch_idx: int) -> None:
        if self.logging_interval == "step" and trainer.global_step % trainer.log_every_n_steps == 0:
            self._log(trainer, module)

    def on_train_epoch_end(self, trainer: TrainerView, module: JaxModule) -> None:
        if self.logging_interval == "epoch":
            self._log(trainer, module)
