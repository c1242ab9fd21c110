"""When a validation inside an epoch is due: ``val_check_interval`` counted in
batches (`Schedule`) or as a duration since the last validation, and before a
requested stop takes effect (Lightning validates before stopping)."""

from __future__ import annotations

import time

from jaxlightning.cluster import distributed
from jaxlightning.loop.stop import StopPolicy
from jaxlightning.progress import Progress
from jaxlightning.schedule import Schedule


class ValCheck:
    """Answers "validate after this batch?" for the fit loop."""

    def __init__(self, schedule: Schedule, stop: StopPolicy, progress: Progress) -> None:
        self.schedule = schedule
        self.stop = stop
        self.progress = progress
        self._last = 0.0  # monotonic time of the last validation (duration rule)

    def _clock(self) -> float:
        return time.monotonic()

    def restart(self) -> None:
        """A validation ended (or training starts): the duration counts from now."""
        self._last = self._clock()

    def due(self, epoch: int, done: int, total: int | None, at_sync: bool) -> bool:
        """Whether a validation is due after batch ``done`` of ``total`` in
        ``epoch``; a duration is read on process 0's clock and agreed
        (``at_sync``: at a point where the processes sync anyway)."""
        schedule = self.schedule
        if not schedule.validates_in(epoch):
            return False
        if self.stop.should_stop and self.stop.stopping():
            return True
        if schedule.val_check_seconds is not None:
            due = self._clock() - self._last >= schedule.val_check_seconds
            return distributed.agree(due, at_sync=at_sync)  # process 0's clock decides
        return schedule.validate_after_batch(epoch, done, total, self.progress.total_batches)
