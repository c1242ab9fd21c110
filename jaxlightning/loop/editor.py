"""What callbacks may change in a running fit's train state (``trainer.edit``).

The Trainer is the callbacks' read-only view; the few edits a callback makes
to the state on the devices (`StochasticWeightAveraging` putting its average
in, `BaseFinetuning` unfreezing a group, a plateau scheduler's new rate, a
rollback to the last good state) go through this small object instead, which
hands them to the `HeldState`, the run's `Progress` and, for a pass over the
training data, to the running `FitRun`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxlightning.loop.fit_run import FitRun
from jaxlightning.programs.held_state import HeldState
from jaxlightning.progress import Progress
from jaxlightning.reporting.report import Report
from jaxlightning.reporting.reporter import Reporter
from jaxlightning.training.state import TrainState


class StateEditor:
    """Edits of a running fit's train state; each needs a fit that has started."""

    def __init__(
        self, held: HeldState, progress: Progress, reporter: Reporter, fit: FitRun
    ) -> None:
        self._held = held
        self._progress = progress
        self._reporter = reporter
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

    # ------------------------------------------- state guards (jl.Rollback)
    def fetch_metrics(self) -> Any:
        """The train step's accumulators on the host (a sync)."""
        return self._started("fetch_metrics").fetch_metrics()

    def save_point(self) -> Any:
        """A copy of the state and accumulators, with the counters it was at."""
        progress = self._progress
        snapshot = self._started("save_point").snapshot()
        return snapshot, progress.global_step, progress.micro

    def go_back(self, point: Any) -> tuple[int, int]:
        """Puts a `save_point` back; the data reads on from where it is, so the
        epoch's batch numbering moves (the batches since the point are skipped).
        Returns the epoch and its batch training goes on at."""
        snapshot, step, micro = point
        self._started("go_back").restore(snapshot)
        return self._progress.current_epoch, self._progress.rewind(step, micro)

    def batches_trained(self) -> int:
        """Training batches of the fit so far (micro-batches one by one)."""
        return self._progress.total_batches

    def locate(self, batch_number: int) -> tuple[int, int]:
        """``(global_step, batch of the epoch)`` of the device's ``batch_number``."""
        return self._progress.where(batch_number)

    def publish(self, name: str, value: float) -> None:
        """``value`` to ``callback_metrics`` and the loggers, under ``name``."""
        self._reporter.publish(Report(values={name: value}, logged={name: value}))
