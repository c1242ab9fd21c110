"""The fit loop: epochs of training steps, validation when due, reports at
logging intervals, and the order of the hooks around them."""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

from jaxlightning.data import Batches
from jaxlightning.data.fit_data import FitData
from jaxlightning.loop.eval_loop import EvalLoop
from jaxlightning.loop.groups import Groups
from jaxlightning.loop.hooks import Hooks
from jaxlightning.loop.state_points import StatePoints
from jaxlightning.loop.stop import StopPolicy
from jaxlightning.loop.val_check import ValCheck
from jaxlightning.module import JaxModule
from jaxlightning.programs.program import Program
from jaxlightning.progress import Progress
from jaxlightning.reporting.report import report
from jaxlightning.reporting.reporter import Reporter
from jaxlightning.schedule import Schedule


class FitLoop:
    """Runs a fit from wherever ``progress`` stands.

    Args:
        program: runs the steps and holds the state.
        evaluation: runs validations (and the sanity check).
        hooks, reporter: as the Trainer's.
        stop: answers "stop now?".
        progress: advanced here.
        schedule: when to validate.
        log_every_n_steps: report ``train/*`` values every this many updates.
        num_sanity_val_steps: validation batches run before training (-1: all).
        points: where the loop lets the host act on the state, announced to
            their subscribers (checkpoints that want a step's state, the
            rollback guard, resume points on a stop signal).
        groups: where each group of steps dispatched together ends.
    """

    def __init__(
        self,
        *,
        program: Program,
        evaluation: EvalLoop,
        hooks: Hooks,
        reporter: Reporter,
        stop: StopPolicy,
        progress: Progress,
        schedule: Schedule,
        log_every_n_steps: int,
        num_sanity_val_steps: int,
        points: StatePoints,
        groups: Groups,
    ) -> None:
        self.program = program
        self.evaluation = evaluation
        self.hooks = hooks
        self.reporter = reporter
        self.stop = stop
        self.progress = progress
        self.schedule = schedule
        self.log_every_n_steps = log_every_n_steps
        self.num_sanity_val_steps = num_sanity_val_steps
        self.points = points
        self.groups = groups
        self._epoch_runs_out = False  # this epoch ends at its loader's end (not max_steps)
        self._load_ahead: Any = lambda more: None  # the epoch's `Batches.load_ahead`
        self.validate_at_epoch_end = False
        self.val_check = ValCheck(schedule, stop, progress)

    def run(self, module: JaxModule, data: FitData, val_loaders: Any) -> None:
        """Trains from epoch ``progress.current_epoch``, at the batch ``data``
        starts it at, until a limit or a stop."""
        if module.hparams and data.skip == 0 and self.progress.global_step == 0:
            self.reporter.log_hyperparams(module.hparams)
        max_epochs = self.schedule.max_epochs
        start = self.progress.current_epoch
        epochs = range(start, max_epochs) if max_epochs is not None else itertools.count(start)
        if not data.trains:
            epochs = range(0)  # limit_train_batches=0: training is off (Lightning skips it)
        self.progress.fitting = True
        try:
            with self.stop.watching_signals():
                self.hooks("on_fit_start", module)
                self.evaluation.sanity_check(module, val_loaders, self.num_sanity_val_steps)
                if epochs:
                    self.program.ready()  # a Timer counts training, not compiling
                    self.hooks("on_train_start", module)
                self.points.start()  # the state training starts from
                self.val_check.restart()
                for epoch in epochs:
                    # a stop asked for before the epoch (a used-up Timer) runs none of it
                    if self.stop.step_limit_reached() or self.stop.stopping():
                        break
                    self.progress.current_epoch = epoch
                    batches, skip = data.epoch(epoch)
                    with batches:
                        self._train_epoch(module, data, val_loaders, batches, epoch, skip)
                    if self.stop.signum:  # resume points saved, then the process exits
                        self.stop.exit_for_signal(self.points.stop_signal(module))
                    self._end_train_epoch()
                    if self.progress.epoch_completed:
                        if val_loaders is not None and self.validate_at_epoch_end:
                            self.evaluation.evaluate("validation", module, val_loaders)
                        self.progress.position = (epoch + 1, 0)
                        self.progress.data_state = None
                    self.hooks.train_epoch_end(module)
                    # An epoch cut short (max_steps, a stop) counts too, as in
                    # Lightning; its checkpoints' position still resumes inside it.
                    self.progress.current_epoch = epoch + 1
                    if self.stop.stopping():
                        break
        except BaseException:
            # Wind down without letting a second failure (a logger on a full disk,
            # say) replace the error that stopped the run.
            with contextlib.suppress(Exception):
                self.program.held.drain()
            self.reporter.finalize(quiet=True)
            raise
        finally:
            self.progress.fitting = False
        self.program.held.drain()
        self.reporter.finalize()

    def _train_epoch(
        self,
        module: JaxModule,
        data: FitData,
        val_loaders: Any,
        batches: Batches,
        epoch: int,
        skip: int,
    ) -> None:
        """One epoch's steps from batch ``skip``; sets ``epoch_completed``.

        Validations due after a batch (``val_check_interval``) run there, except
        one due after the epoch's last batch: that one runs at the epoch's end,
        after its last logging interval is reported, as a once-per-epoch one does.
        """
        progress = self.progress
        progress.start_epoch(skip)
        epoch_batches = data.per_epoch
        until_max_steps = None
        if self.schedule.max_steps >= 0:  # batches left until the last update
            until_max_steps = progress.batches_until(self.schedule.max_steps)
        progress.num_training_batches = left = data.batches_left(skip, until_max_steps)
        progress.last_batch_idx = None if left is None else skip + left - 1
        # whether the epoch's own end (not max_steps) ends its last batch
        self._epoch_runs_out = left is not None and left == (epoch_batches or 0) - skip
        self.validate_at_epoch_end = self.schedule.validate_at_epoch_end(epoch, epoch_batches)
        if not skip:  # a run resumed mid-epoch continues the epoch its checkpoint began
            self.hooks("on_train_epoch_start", module)
        # A run resumed from a checkpoint taken after batch `skip` (before any
        # validation due there) runs that validation first, as the run it continues did.
        if skip and val_loaders is not None and not progress.validated:
            self._validate_after(module, val_loaders, epoch, skip, epoch_batches)

        validates = val_loaders is not None

        def ends(batch_idx: int, size: int) -> bool:  # a dispatch's last batch
            done = batch_idx + 1
            return self.groups.ends(epoch, done, done - skip, size, epoch_batches, validates)

        self._load_ahead = batches.load_ahead  # before a report's wait on the device
        for group in data.groups(batches, skip, ends):
            if self.stop.before_batch():
                return
            if self._train_group(module, val_loaders, epoch, group, epoch_batches):
                break  # the module's on_train_batch_start returned -1
        progress.epoch_completed = True
        if progress.end_partial_update():  # an epoch ending between two updates
            self.program.flush()

    def _train_group(
        self,
        module: JaxModule,
        val_loaders: Any,
        epoch: int,
        group: list[tuple[int, Any]],
        epoch_batches: int | None,
    ) -> bool:
        """Trains ``group``'s batches in one dispatch, then runs each one's hooks
        and bookkeeping in turn (its first ``on_train_batch_start`` before the
        dispatch, as with one batch per dispatch). Reports and validations fall
        on a group's last batch, where the state is the batch's own. Returns
        whether the module's ``on_train_batch_start`` returned -1: the rest of
        the epoch is skipped (the batches of a dispatch already run, trained)."""
        progress, batch_logs = self.progress, self.reporter.batch_logs
        first_idx = progress.batch_idx = group[0][0]
        batch_logs.batch(first_idx, group[0][1].host.real)
        if self.hooks("on_train_batch_start", module, first_idx) == -1:
            progress.last_batch_idx = first_idx  # it ends the epoch: the last, as Lightning's
            return True  # the module skips the rest of the epoch (Lightning's -1)
        self.program.train_group([batch for _, batch in group])
        # Lightning steps the optimizer at the epoch's last batch with what the
        # accumulation window holds: before that batch's hooks, which see the update.
        ends_epoch = group[-1][0] == progress.last_batch_idx and self._epoch_runs_out
        partial = ends_epoch and (progress.micro + len(group)) % progress.accumulate != 0
        if partial:
            self.program.flush()
        last, skip_rest = len(group) - 1, False
        try:
            for i, (batch_idx, batch) in enumerate(group):
                progress.steps_ahead = last - i
                progress.batch_idx = batch_idx
                batch_logs.batch(batch_idx, batch.host.real)
                if i and self.hooks("on_train_batch_start", module, batch_idx) == -1:
                    skip_rest = True  # trained in this dispatch already: ends after it
                    progress.last_batch_idx = batch_idx
                progress.train_samples_seen += batch.host.real
                updated = progress.count_micro_batch()
                if partial and i == last:
                    updated = progress.end_partial_update()
                progress.position = (epoch, batch_idx + 1)
                if batch.state is not None:
                    progress.data_state = batch.state
                progress.validated = False
                at_report = updated and progress.global_step % self.log_every_n_steps == 0
                if at_report:
                    self._report_train()
                elif updated and self.points.wants_state_at(progress.global_step):
                    self.points.before_use()  # a bad state is never saved
                self.stop.poll_signal(at_report)
                self.hooks("on_train_batch_end", module, batch_idx)
                if at_report:  # what the batch hooks logged for this step
                    self.reporter.publish(batch_logs.step_report())
                if i == last and val_loaders is not None and not self.stop.signum:
                    self._validate_after(  # else after resuming
                        module, val_loaders, epoch, batch_idx + 1, epoch_batches, at_report
                    )
        finally:
            progress.steps_ahead = 0
        return skip_rest

    def _validate_after(
        self,
        module: JaxModule,
        val_loaders: Any,
        epoch: int,
        done: int,
        total: int | None,
        at_sync: bool = True,
    ) -> None:
        """Validates if ``val_check_interval`` says so after batch ``done`` of the
        epoch (or its duration has passed, or a stop was requested that takes
        effect now: Lightning validates before stopping); after the epoch's last
        batch, at the epoch's end instead."""
        if not self.val_check.due(epoch, done, total, at_sync):
            return
        if done == total:
            self.validate_at_epoch_end = True
        else:
            self.points.before_use()  # validate (and checkpoint) a good state only
            # set first: a checkpoint saved in its on_validation_end resumes after it
            self.progress.validated = True
            self.evaluation.evaluate("validation", module, val_loaders)
        self.val_check.restart()

    def _report_train(self) -> None:
        """Reports the values of this logging interval and starts the next one."""
        self._load_ahead(self.program.held.load_more)  # while the steps it waits for run
        acc = self.program.held.fetch_metrics()
        if self.points.rolled_back(acc):
            return  # the interval's values went with its state
        options, prefix = self.program.train_options, self.reporter.prefix("train")
        values = report(prefix, options, acc.metrics, "step")
        self.reporter.publish(values)
        self.program.held.reset_interval(acc)
        self.points.reported(self.program.interval_loss(acc))

    def _end_train_epoch(self) -> None:
        """Reports the epoch's last (partial) interval and its ``on_epoch`` values.

        After a complete epoch the accumulators start over: logging intervals
        never span two epochs. An epoch cut short (``max_steps``, ``should_stop``)
        keeps them, so that a run resumed from its checkpoint continues them
        exactly as an uninterrupted run would.
        """
        acc = self.program.held.fetch_metrics()
        if self.points.rolled_back(acc):
            acc = self.program.held.fetch_metrics()  # the good point's
        options, prefix = self.program.train_options, self.reporter.prefix("train")
        values = report(prefix, options, acc.metrics, "step")
        values.update(report(prefix, options, acc.epoch, "epoch"))
        values.update(self.reporter.batch_logs.epoch_end(self.progress.epoch_completed))
        self.reporter.publish(values)
        if self.progress.epoch_completed:
            self.program.held.reset_epoch()
        self.points.reported(self.program.interval_loss(acc))
