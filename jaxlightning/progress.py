"""Where a run is: the counters the loops advance and everything else reads.

Also the one place the host counts micro-batches against optimizer updates
(``accumulate_grad_batches``): the device numbers the batches it trains on,
1-based, as ``update * k + micro-batch``, and ``global_step`` counts updates.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Progress:
    """The run's position, owned by the fit loop (the evaluation loop sets only
    ``num_eval_batches``); read by the Trainer's public properties, checkpoints
    and callbacks.

    Attributes:
        accumulate: micro-batches per optimizer update (``accumulate_grad_batches``).
        global_step: optimizer updates so far.
        current_epoch: completed epochs (moves on once an epoch completes).
        epoch_completed: whether the epoch just run reached its end.
        micro: micro-batches since the last update.
        position: ``(epoch, batch)`` of the next batch to train on: what a
            checkpoint records as the place to resume from.
        epoch_offset: the device's number of the batch before this epoch's first.
        train_samples_seen: real rows this process has trained on.
        total_batches: training batches of the whole fit (across epochs, micro-
            batches counted one by one: Lightning's ``total_batch_idx + 1``).
        num_training_batches: batches this epoch runs (``None``: unknown).
        num_eval_batches: batches of the evaluation running (``None``: unknown).
        sanity_checking: the validation running is the sanity check before training.
        fitting: a fit is running (loggers then number steps as Lightning does).
        validated: the validation due after the batch at ``position`` has run
            (a run resumed there does not run it again).
        data_state: a stateful loader's iterator state after the batch before
            ``position`` (grain's), what a checkpoint saves to resume it from;
            ``None`` at an epoch's start and for the Trainer's own orders.
        steps_ahead: how many train steps the device state is ahead of the
            batch whose hooks run (a dispatch of several batches runs their
            hooks one by one after it).
        batch_idx: the epoch's batch whose hooks run.
        last_batch_idx: the epoch's last batch (``None``: unknown, a loader
            without a length).
    """

    accumulate: int = 1
    global_step: int = 0
    current_epoch: int = 0
    epoch_completed: bool = False
    micro: int = 0
    position: tuple[int, int] = (0, 0)
    epoch_offset: int = 0
    train_samples_seen: int = 0
    total_batches: int = 0
    num_training_batches: int | None = None
    num_eval_batches: int | None = None
    sanity_checking: bool = False
    fitting: bool = False
    validated: bool = False
    steps_ahead: int = 0
    data_state: dict | None = None
    batch_idx: int = 0
    last_batch_idx: int | None = None

    @property
    def is_last_batch(self) -> bool:
        """Whether the batch whose hooks run is the epoch's last (Lightning's
        ``trainer.is_last_batch``)."""
        return self.last_batch_idx is not None and self.batch_idx >= self.last_batch_idx

    @property
    def log_step(self) -> int:
        """The step loggers record values at, Lightning's numbering: during a fit
        the index of the last update (0-based: the values of the first update
        are at step 0, an epoch's end at its last update's), outside a fit the
        number of updates made."""
        if not self.fitting:
            return self.global_step
        return max(self.global_step - 1, 0)

    def start_epoch(self, skip: int) -> None:
        """An epoch starts (at its batch ``skip``, resumed): it is not complete,
        and its batch 0 is the device's number ``epoch_offset + 1``."""
        self.epoch_completed = False
        if not skip:
            self.data_state = None
        self.epoch_offset = self.global_step * self.accumulate + self.micro - skip

    def rewind(self, global_step: int, micro: int) -> int:
        """Goes back to update ``global_step`` (``micro`` micro-batches into the
        next) while the data reads on from ``position``: the epoch's batch
        numbering moves so that the next batch is the device's number after
        that point. Returns the epoch's batch training goes on at."""
        epoch, batch = self.position
        done = batch if epoch == self.current_epoch else 0
        self.global_step, self.micro = global_step, micro
        self.epoch_offset = global_step * self.accumulate + micro - done
        return done

    def count_micro_batch(self) -> bool:
        """Counts a dispatched micro-batch; whether it completed an update."""
        self.total_batches += 1
        self.micro += 1
        if self.micro < self.accumulate:
            return False
        self.micro = 0
        self.global_step += 1
        return True

    def end_partial_update(self) -> bool:
        """At an epoch's end: whether micro-batches wait for an update, which
        then counts (Lightning updates with what an epoch leaves over)."""
        if not self.micro:
            return False
        self.micro = 0
        self.global_step += 1
        return True

    def step_after(self, batches: int) -> tuple[int, bool]:
        """``(global_step, updated)`` after ``batches`` more micro-batches:
        the update count then, and whether the last of them completes an update."""
        micro = self.micro + batches
        return self.global_step + micro // self.accumulate, micro % self.accumulate == 0

    def batches_until(self, max_steps: int) -> int:
        """Micro-batches left until update ``max_steps``."""
        return (max_steps - self.global_step) * self.accumulate - self.micro

    def updates_in(self, batches: int) -> int:
        """Updates an epoch of ``batches`` micro-batches makes (the last partial)."""
        return -(-batches // self.accumulate)

    def where(self, batch_number: int) -> tuple[int, int]:
        """``(update, batch of this epoch)`` of the device's batch number."""
        update = (batch_number - 1) // self.accumulate + 1
        return update, batch_number - 1 - self.epoch_offset

    def resume_at(
        self, epoch: int, batch: int, global_step: int, total_batches: int | None = None
    ) -> None:
        """Continues from a checkpoint's record (one written before ``total_batches``
        was recorded counts the updates' micro-batches)."""
        self.current_epoch, self.global_step = epoch, global_step
        self.position = (epoch, batch)
        self.total_batches = (
            global_step * self.accumulate if total_batches is None else total_batches
        )
