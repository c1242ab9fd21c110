"""What callbacks see of the Trainer: a read-only view (plus ``should_stop``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from jaxlightning.loggers import Logger
    from jaxlightning.module import JaxModule
    from jaxlightning.strategies import Strategy
    from jaxlightning.training.state import TrainState
    from jaxlightning.xla.cost import StepCost


class StateEdits(Protocol):
    """``trainer.edit``: what a callback may change in a running fit's train
    state (each needs a fit that has started)."""

    def set_optimizer_state(self, kind: type, **values: Any) -> None:
        """Writes host values into the fields of every ``kind`` node of the
        train state's optimizer state (no recompile)."""
        ...

    def map_state(self, fn: Any) -> None:
        """Replaces the train state by ``fn(state)``, run on the devices."""
        ...

    def recompute_batch_statistics(self) -> None:
        """During `fit`: the state's ``batch_stats`` recomputed over one pass of
        the training data (torch's ``update_bn``)."""
        ...

    def fetch_metrics(self) -> Any:
        """The train step's metric accumulators on the host (a sync): the
        interval's values, its largest step loss, its first non-finite step."""
        ...

    def save_point(self) -> Any:
        """A copy of the train state, its accumulators and the step counters
        now, on the devices, for `go_back`."""
        ...

    def go_back(self, point: Any) -> tuple[int, int]:
        """Puts a `save_point` back: the state, the accumulators, ``global_step``
        (the data reads on from where it is). Returns the epoch and the batch of
        it training goes on at."""
        ...

    def batches_trained(self) -> int:
        """Training batches of the fit so far (micro-batches counted one by one)."""
        ...

    def locate(self, batch_number: int) -> tuple[int, int]:
        """``(global_step, batch of the epoch)`` of the device's 1-based
        ``batch_number`` (a fetched accumulator's first non-finite step)."""
        ...

    def publish(self, name: str, value: float) -> None:
        """Reports ``value`` under ``name`` to ``callback_metrics`` and the loggers."""
        ...


class TrainerView(Protocol):
    """The members of `jaxlightning.Trainer` that callbacks (and a module's
    ``self.trainer``) may use. Everything is read-only except ``should_stop``,
    which asks the fit to stop (after ``min_epochs``/``min_steps``), and
    ``callback_metrics``, to which a callback may add values.

    Values are host numbers already fetched (free to read) except ``state``,
    which copies the train state on the devices: read what you need and drop it.
    """

    should_stop: bool

    @property
    def stage(self) -> str | None:
        """``"fit"``, ``"validate"``, ``"test"`` or ``"predict"`` while running."""

    @property
    def fast_dev_run(self) -> int:
        """Batches of each stage in a ``fast_dev_run`` (0: a normal run)."""

    @property
    def sanity_checking(self) -> bool:
        """Whether the validation running is the sanity check before training."""

    @property
    def global_step(self) -> int: ...
    @property
    def current_epoch(self) -> int: ...
    @property
    def epoch_completed(self) -> bool: ...
    @property
    def train_samples_seen(self) -> int: ...
    @property
    def steps_ahead(self) -> int:
        """Train steps the device state is ahead of this batch hook's batch
        (0 unless a dispatch runs several batches: `steps_per_dispatch`)."""

    @property
    def steps_per_dispatch(self) -> int:
        """Train steps a dispatch of this fit runs at most (1: one per batch)."""

    @property
    def is_last_batch(self) -> bool:
        """Whether this batch hook's batch is the epoch's last."""

    @property
    def accumulate_grad_batches(self) -> int: ...
    @property
    def num_training_batches(self) -> int | None: ...
    @property
    def num_eval_batches(self) -> int | None: ...
    @property
    def max_epochs(self) -> int:
        """The epoch limit (-1: none)."""

    @property
    def max_steps(self) -> int: ...
    @property
    def estimated_stepping_batches(self) -> float: ...
    @property
    def log_every_n_steps(self) -> int: ...
    @property
    def val_check_interval(self) -> int | float:
        """When validation runs within an epoch (``1.0``: once, at its end)."""

    @property
    def check_val_every_n_epoch(self) -> int | None:
        """Validation runs in every this-many-th epoch."""

    @property
    def callback_metrics(self) -> dict[str, float]:
        """Every reported value, by name. A callback may add values for other
        callbacks to monitor (`LearningRateMonitor` does, as Lightning's)."""

    @property
    def logged_metrics(self) -> dict[str, float]: ...
    @property
    def progress_bar_metrics(self) -> dict[str, float]: ...
    @property
    def state(self) -> TrainState | None: ...
    @property
    def strategy(self) -> Strategy: ...
    @property
    def num_devices(self) -> int: ...
    @property
    def seed(self) -> int: ...
    @property
    def callbacks(self) -> Sequence[Any]: ...
    @property
    def logger(self) -> Logger | None: ...
    @property
    def loggers(self) -> Sequence[Logger]: ...
    @property
    def global_rank(self) -> int: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def is_global_zero(self) -> bool: ...
    @property
    def log_dir(self) -> str | None: ...
    @property
    def default_root_dir(self) -> str: ...
    @property
    def datamodule(self) -> Any: ...
    @property
    def ckpt_path(self) -> str | None: ...

    def train_step_cost(self) -> StepCost | None:
        """XLA's count of one compiled train step on one device (FLOPs, bytes),
        once compiled: waits for the compile; ``None`` where unknown."""
        ...

    def eval_step_cost(self) -> StepCost | None:
        """XLA's count of the last evaluation's compiled step on one device;
        ``None`` before any evaluation or where unknown."""
        ...

    @property
    def edit(self) -> StateEdits:
        """The edits a callback may make to a running fit's train state."""
        ...

    def checkpoint_payload(self, module: JaxModule) -> tuple[Any, dict[str, Any]]:
        """What a checkpoint of the run holds now: arrays and a JSON record."""
        ...
