"""How many train steps one dispatch runs, and where each group of them ends.

`Groups` is the one place that reads ``steps_per_execution``. For a fit it
settles the group size: a number the user gave, or for ``"auto"`` (the
default) `AUTO_GROUP` steps where nothing can tell the difference, one
otherwise (`Groups.settle`). During the fit it answers, batch by batch, whether
the group ends here (`Groups.ends`): at the group size, or wherever the host
acts on the state after a batch (the epoch's or ``max_steps``' last batch, a
report, a validation counted in batches, an update a callback wants the state
of). A group runs bitwise as its steps one by one would.
"""

from __future__ import annotations

from jaxlightning.loop.hooks import Hooks
from jaxlightning.loop.state_points import StatePoints
from jaxlightning.loop.stop import StopPolicy
from jaxlightning.module import JaxModule
from jaxlightning.progress import Progress
from jaxlightning.schedule import Schedule
from jaxlightning.training import contract

AUTO_GROUP = 8  # steps per dispatch under "auto" (measured: docs/performance.md, arm 11)
_TRAIN_BATCH_HOOKS = ("on_train_batch_start", "on_train_batch_end")


class Groups:
    """Decides the groups of train steps of each fit.

    Args:
        steps_per_execution: ``"auto"`` or the group size (checked).
        groupable: whether the strategy runs groups at all (global arrays;
            ``strategy="pmap"`` runs one step per dispatch).
        hooks: the callbacks (their `Extensions` say who needs each step).
        points: whose state points end a group.
        progress, schedule: where the run is; when it validates.
        stop: a stop asked for and held back (``min_steps``) takes effect
            at its exact step: groups are single steps meanwhile.
        log_every_n_steps: reports end a group.
    """

    def __init__(
        self,
        steps_per_execution: int | str,
        *,
        groupable: bool,
        hooks: Hooks,
        points: StatePoints,
        progress: Progress,
        schedule: Schedule,
        stop: StopPolicy,
        log_every_n_steps: int,
    ) -> None:
        self.requested = steps_per_execution
        self.groupable = groupable
        self.hooks = hooks
        self.points = points
        self.progress = progress
        self.schedule = schedule
        self.stop = stop
        self.log_every_n_steps = log_every_n_steps
        self.size = steps_per_execution if isinstance(steps_per_execution, int) else 1
        self.why = ""

    def settle(self, module: JaxModule) -> int:
        """The group size of a fit of ``module``; ``why`` says how it was chosen
        (``"steps_per_execution='auto': LearningRateMonitor act(s) after each step"``)."""
        if isinstance(self.requested, int):
            self.size, self.why = self.requested, f"steps_per_execution={self.requested}"
            return self.size
        reason = self._one_step_reason(module)
        self.size = 1 if reason else AUTO_GROUP
        self.why = f"steps_per_execution='auto'{': ' + reason if reason else ''}"
        return self.size

    def _one_step_reason(self, module: JaxModule) -> str:
        """Why ``"auto"`` runs one step per dispatch in this fit (``""``: it need not)."""
        if not self.groupable:
            return "this strategy runs one step per dispatch"
        needs = [type(c).__name__ for c in self.hooks.extensions.each_step]
        if needs:
            return f"{', '.join(needs)} act(s) after each step"
        own = [h for h in _TRAIN_BATCH_HOOKS if contract.overrides(module, h)]
        if own:
            return f"{type(module).__name__} defines {', '.join(own)}"
        if self.schedule.val_check_seconds is not None:
            return "val_check_interval is a duration, checked after each step"
        return ""

    def ends(
        self,
        epoch: int,
        done: int,
        run: int,
        size: int,
        epoch_batches: int | None,
        validates: bool,
    ) -> bool:
        """Whether a group of ``size`` batches ending with the epoch's batch
        ``done`` (1-based; the ``run``-th since the epoch (re)started) is
        dispatched now; ``validates``: the fit has validation loaders."""
        if size >= self.size or self.stop.should_stop:
            return True
        progress = self.progress
        if run == progress.num_training_batches:
            return True
        step, updated = progress.step_after(size)
        if updated and (step % self.log_every_n_steps == 0 or self.points.wants_state_at(step)):
            return True
        schedule = self.schedule
        if not validates or not schedule.validates_in(epoch):
            return False
        return schedule.val_check_seconds is None and schedule.validate_after_batch(
            epoch, done, epoch_batches, progress.total_batches + size
        )
