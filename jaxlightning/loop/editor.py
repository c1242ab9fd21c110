"""What callbacks may change in a running fit's train state (``trainer.edit``).

The Trainer is the callbacks' read-only view; the few edits a callback makes
to the state on the devices (`StochasticWeightAveraging` putting its average
in, `BaseFinetuning` unfreezing a group) go through this small object instead,
which hands them to the `HeldState` and, for a pass over the training data,
to the running `FitRun`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxlightning.loop.fit_run import FitRun
from jaxlightning.loop.held_state import HeldState
from jaxlightning.training.state import TrainState


class StateEditor:
    """Edits of a running fit's train state; each needs a fit that has started."""

    def __init__(self, held: HeldState, fit: FitRun) -> None:
        self._held = held
        self._fit = fit

    def _started(self, what: str) -> HeldState:
        if not self._held.started:
            raise RuntimeError(f"trainer.edit.{what} needs a fit that has started")
        return self._held

    def set_optimizer_state(self, kind: type, **values: Any) -> None:
        """Writes host ``values`` into the named fields of every ``kind`` node
        (a NamedTuple an optimizer transformation keeps as its state) in the
        train state: the next step reads them; nothing recompiles. For callbacks
        that steer a transformation they added (`StochasticWeightAveraging`)."""
        self._started("set_optimizer_state").set_optimizer_state(kind, **values)

    def map_state(self, fn: Callable[[TrainState], TrainState]) -> None:
        """Replaces the train state by ``fn(state)`` (traced once, run on the
        devices, the same on each); ``trainer.state`` and, after training, the
        module's variables then show the result."""
        self._started("map_state").map_state(fn)

    def recompute_batch_statistics(self) -> None:
        """Sets the train state's ``batch_stats`` to the mean, over one pass of
        the training data, of each batch's statistics under the state's
        parameters (torch's ``update_bn``; `StochasticWeightAveraging` calls it
        after putting the average in)."""
        self._started("recompute_batch_statistics")
        self._fit.recompute_batch_statistics()
