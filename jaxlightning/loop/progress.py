"""Where a run is: the counters the loops advance and everything else reads."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Progress:
    """The run's position, owned by the fit loop (the evaluation loop sets only
    ``num_eval_batches``); read by the Trainer's public properties, checkpoints
    and callbacks.

    Attributes:
        global_step: optimizer updates so far.
        current_epoch: completed epochs (moves on once an epoch completes).
        epoch_completed: whether the epoch just run reached its end.
        micro: micro-batches since the last update (``accumulate_grad_batches``).
        position: ``(epoch, batch)`` of the next batch to train on: what a
            checkpoint records as the place to resume from.
        epoch_offset: the device's number of the batch before this epoch's first
            (the device numbers batches, 1-based, as ``update * k + micro``).
        train_samples_seen: real rows this process has trained on.
        num_training_batches: batches this epoch runs (``None``: unknown).
        num_eval_batches: batches of the evaluation running (``None``: unknown).
    """

    global_step: int = 0
    current_epoch: int = 0
    epoch_completed: bool = False
    micro: int = 0
    position: tuple[int, int] = (0, 0)
    epoch_offset: int = 0
    train_samples_seen: int = 0
    num_training_batches: int | None = None
    num_eval_batches: int | None = None

    def count_micro_batch(self, accumulate: int) -> bool:
        """Counts a dispatched micro-batch; whether it completed an optimizer
        update (every ``accumulate`` of them): ``global_step`` counts updates."""
        self.micro += 1
        if self.micro < accumulate:
            return False
        self.micro = 0
        self.global_step += 1
        return True

    def resume_at(self, epoch: int, batch: int, global_step: int) -> None:
        """Continues from a checkpoint's record."""
        self.current_epoch, self.global_step = epoch, global_step
        self.position = (epoch, batch)
