"""The Trainer's arguments: one frozen record, documented once.

`Trainer(**kwargs)` fills a `TrainerArgs`; `loop.wiring.wire` checks each
field (errors name the argument) and builds the components from it. The CLI
and the API reference read these fields' documentation, which the Trainer's
docstring carries.
"""

from __future__ import annotations

import ast
import dataclasses
import datetime
import functools
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jax

    from jaxlightning.callbacks import Callback
    from jaxlightning.callbacks.rollback import Rollback
    from jaxlightning.loggers import Logger
    from jaxlightning.strategies import Strategy


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerArgs:
    """What a `Trainer` is built from (``trainer.args``); every field is a
    keyword argument of `Trainer` with the same default.

    Args:
        max_epochs: stop after this many epochs (default 1000 when ``max_steps``
            is not set either, as in Lightning; -1: no epoch limit).
        max_steps: stop after this many optimizer steps (-1: no limit).
        min_epochs: a stop requested earlier (``trainer.should_stop``,
            `EarlyStopping`) waits until this many epochs have run.
        min_steps: likewise, until this many optimizer steps have run.
        max_time: stop training at the next step once this much training time
            has passed (``"DD:HH:MM:SS"``, a dict such as ``{"hours": 4}``, or a
            ``timedelta``): adds a `Timer` callback, as Lightning, whose stop
            ``min_epochs``/``min_steps`` hold back. Across processes, process
            0's clock decides at logging intervals.
        devices: ``"auto"`` (all local devices), a count, or a list of devices.
        accelerator: ``"auto"`` (JAX's default platform), ``"cpu"``, ``"gpu"``
            (or ``"cuda"``) or ``"tpu"``: whose devices ``devices`` counts; an
            accelerator this machine lacks is a clear error.
        strategy: ``"auto"`` (= ``"shard_map"``, data parallel), ``"pmap"``,
            ``"shard_map"``, ``"fsdp"`` (state split over the devices), or a
            `Strategy` instance such as ``jl.ModelParallelStrategy(data=4,
            model=2)`` (tensor parallel by the model's partitioning annotations).
        log_every_n_steps: report ``train/*`` averages every this many steps.
        val_check_interval: validate every this fraction of an epoch (float in
            (0, 1]) or every this many training batches (int; counted across
            epochs with ``check_val_every_n_epoch=None``); default once, at the
            epoch's end.
        check_val_every_n_epoch: validate in every this-many-th epoch.
        num_sanity_val_steps: before training, run this many batches of each
            validation loader (-1: all; 0: none), discarding the results, so
            that a bug in ``eval_step`` shows before an epoch of training
            rather than after it. Also compiles the eval step ahead.
        limit_train_batches: train on this many batches per epoch (int) or this
            fraction of them (float); likewise ``limit_val_batches``,
            ``limit_test_batches`` and ``limit_predict_batches``.
        limit_val_batches: see ``limit_train_batches``.
        limit_test_batches: see ``limit_train_batches``.
        limit_predict_batches: see ``limit_train_batches``.
        fast_dev_run: run this many batches (``True``: 1) of training and
            validation, one epoch, no sanity check, logger or checkpoints: a
            smoke test of the whole run.
        overfit_batches: train and validate on the first this many batches (or
            this fraction) of the training loader's order, unshuffled.
        gradient_clip_val: clip the gradient, averaged across devices, to this
            global norm (or, with ``gradient_clip_algorithm="value"``, each
            element to this magnitude) before the optimizer sees it.
        gradient_clip_algorithm: ``"norm"`` or ``"value"``.
        log_grad_norm: log the global norm of the averaged gradient (before
            clipping) as ``train/grad_norm``.
        accumulate_grad_batches: sum the gradients of this many consecutive
            batches (exactly, weighted by their real rows) into one optimizer
            update, as one batch that many times larger would; each batch is
            its own dispatch, so memory is that of one batch. ``global_step``
            and ``max_steps`` count updates; an epoch's leftover batches make
            one last, smaller update.
        precision: ``"32-true"`` (default), ``"bf16-mixed"`` (float32 master
            parameters and optimizer state, bfloat16 forward and backward passes,
            float32 loss, gradients and metrics), ``"bf16-true"`` or
            ``"64-true"``; any flax model, no per-layer dtypes needed.
        default_root_dir: where logs go (default: the working directory).
        logger: ``True`` for a `TensorBoardLogger`, ``False`` for none, a
            `Logger`, or a list of them (each gets every value).
        enable_progress_bar: show tqdm bars.
        seed: seeds initialisation, every per-device, per-step key, and the
            order of shuffled DataLoaders (seeded per epoch); default: the seed
            of `jl.seed_everything`, else 0.
        callbacks: `Callback` instances, called in order.
        enable_checkpointing: add a default `ModelCheckpoint` (checkpoint after
            every epoch, keep the last) unless ``callbacks`` has one.
        stop_on_nonfinite_loss: raise `NonFiniteLossError` when the loss becomes
            NaN or infinite (detected at the next report or checkpoint, without a
            per-step sync; a bad state is never checkpointed).
        on_nonfinite: ``"raise"`` (default; see ``stop_on_nonfinite_loss``) or
            ``"skip"``: an update whose loss or gradient is NaN or infinite is
            left out on every device alike, decided inside the step (no host
            sync): the state stays bitwise what it would be had that batch been
            absent (its step counter too, so later keys and schedules match),
            the step's logged values are left out, and each logging interval
            reports how many it skipped as ``train/skipped_updates``. With
            ``accumulate_grad_batches`` a bad micro-batch is left out of its
            update's mean. ``global_step`` still counts the skipped batches.
            ``"rollback"`` (or a `jl.Rollback` with its settings): where the
            loop acts on the state (each report, a validation or step-counted
            checkpoint, an epoch's end) a non-finite loss or a loss spike since
            the last such point sends the state back to it, skips the batches
            since and trains on, a bounded number of times in a row; each
            rollback is printed, logged as ``train/rollbacks`` and kept in the
            checkpoint record. It holds a second copy of the state on the
            devices.
        use_distributed_sampler: let the Trainer own the order of plain
            DataLoaders (seeded per epoch, each process reading only its share),
            which makes runs reproducible and resumable mid-epoch without
            reloading consumed batches.
        data_on_device: ``"auto"`` keeps a training (or unshuffled evaluation)
            dataset on the devices where that gives exactly the host path's
            batches and it fits a share of device memory: a plain DataLoader
            over a `TensorDataset` or over arrays, in a single process, under a
            strategy with global batches; each step's rows are then gathered on
            the devices. ``True`` insists (an error says why it cannot),
            ``False`` always loads batches on the host. Where the device's
            memory is known and the train step fits it but not beside the
            copy, ``"auto"`` says so and loads on the host. ``trainer.data_path``
            and the model summary say which a fit uses.
        steps_per_execution: train this many batches per dispatch (Keras's
            name): one compiled program scans over them, so a small model
            stops paying the host's per-step dispatch (and, with the data on
            the devices, its per-step gather). Bitwise the same training as 1.
            ``"auto"`` (the default): 8 where no one can tell the difference
            (no callback or module batch hook that acts after each step, no
            ``val_check_interval`` duration, a strategy of global arrays), 1
            otherwise; the model summary's first lines say which
            (``trainer.steps_per_dispatch``).
            Reports, ``val_check_interval``, ``max_steps`` and
            ``ModelCheckpoint(every_n_train_steps=...)`` end a dispatch early,
            so they happen at their exact step; batch hooks still run once per
            batch, after their dispatch (``trainer.steps_ahead`` says how many
            steps the device state is then ahead); a stop requested in a batch
            hook, a signal or a time limit takes effect at the dispatch's end.
            A log interval that is a multiple of it keeps every dispatch whole.
            Not under ``strategy="pmap"``.
        num_nodes: the number of processes of a multi-process job (one per
            node). A process started by ``python -m jaxlightning.launch``, SLURM,
            Open MPI or Kubernetes joins its job automatically; this only checks
            the count.
        compilation_cache_dir: keep compiled programs in this folder (JAX's
            persistent cache, set process-wide, small programs included), so a
            later run of the same model starts without compiling.
        enable_model_summary: print the parameter table when `fit` starts
            (a `ModelSummary` callback) unless ``callbacks`` has one.
        profiler: ``"jax"`` records a ``jax.profiler`` trace of a few steps into
            the run directory (a `JaxProfiler` callback), for TensorBoard.
        stage_prefix: report names logged in traced steps with their stage,
            ``train/<name>``, ``val/<name>``, ``test/<name>`` (TensorBoard then
            groups them by stage; a name that already says its stage, such as
            ``val_loss``, stays). Default: names exactly as logged, Lightning's
            rule, so Lightning's ``monitor=`` strings work unchanged. The
            Trainer's own values are always ``train/loss`` (``log_loss``),
            ``train/grad_norm``, ``train/skipped_updates``, ...
        log_loss: report what ``loss()`` returns, as ``train/loss`` (the mean
            over each logging interval), to the loggers, ``callback_metrics``
            and the progress bar. Default: as in Lightning, only what the
            module logs is reported (``self.log("train_loss", loss,
            prog_bar=True)`` in ``loss``).
        step_values: what a value logged with ``on_step=True`` in ``loss`` or
            ``training_step`` reports every ``log_every_n_steps``: ``"last"``
            (default, Lightning's), the value of that step; ``"interval"``, its
            ``reduce_fx`` over every step since the last report (the mean of
            50 steps' losses: a smoother curve at the same cost).
        recompile: a training batch whose shapes or dtypes differ from the
            first one's (which would compile the step again): ``"warn"``
            (default; once per new signature, naming the leaf and the batch),
            ``"raise"`` (a `RecompileError`) or ``"allow"``.
        device_memory: bytes one device holds (default: what the device
            reports; the CPU reports nothing, so nothing is checked there).
            A train step whose memory budget (XLA's analysis of the compiled
            step) exceeds it stops `fit` before its first step with a
            `MemoryBudgetError` showing the budget and the smaller batch with
            more accumulation that fits (`Tuner.memory_budget` shows it
            without fitting).
    """

    max_epochs: int | None = None
    max_steps: int = -1
    min_epochs: int | None = None
    min_steps: int | None = None
    max_time: str | dict[str, int] | datetime.timedelta | None = None
    devices: int | str | Sequence[jax.Device] = "auto"
    accelerator: str = "auto"
    strategy: str | Strategy = "auto"
    log_every_n_steps: int = 50
    val_check_interval: int | float | None = None
    check_val_every_n_epoch: int | None = 1
    num_sanity_val_steps: int = 2
    limit_train_batches: int | float | None = None
    limit_val_batches: int | float | None = None
    limit_test_batches: int | float | None = None
    limit_predict_batches: int | float | None = None
    fast_dev_run: int | bool = False
    overfit_batches: int | float = 0.0
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str = "norm"
    log_grad_norm: bool = False
    accumulate_grad_batches: int = 1
    precision: str | int = "32-true"
    default_root_dir: str | os.PathLike[str] | None = None
    logger: bool | Logger | Sequence[Logger] = True
    enable_progress_bar: bool = True
    seed: int | None = None
    callbacks: Sequence[Callback] | Callback | None = None
    enable_checkpointing: bool = True
    stop_on_nonfinite_loss: bool = True
    on_nonfinite: str | Rollback = "raise"
    use_distributed_sampler: bool = True
    data_on_device: bool | str = "auto"
    steps_per_execution: int | str = "auto"
    num_nodes: int | None = None
    compilation_cache_dir: str | os.PathLike[str] | None = None
    enable_model_summary: bool = True
    profiler: str | None = None
    stage_prefix: bool = False
    log_loss: bool = False
    step_values: str = "last"
    recompile: str = "warn"
    device_memory: int | None = None

    @classmethod
    def arguments_doc(cls) -> str:
        """The ``Args:`` section of this class's docstring (indented as written)."""
        doc = cls.__doc__ or ""
        return doc[doc.index("    Args:") :].rstrip()


def with_env_defaults(init: Callable[..., None]) -> Callable[..., None]:
    """``Trainer.__init__`` taking Lightning's environment defaults: an argument
    not passed is read from ``PL_TRAINER_<NAME>`` when that is set (a Python
    literal, ``PL_TRAINER_MAX_EPOCHS=3``, else the string itself,
    ``PL_TRAINER_ACCELERATOR=cpu``); an argument passed wins, as in Lightning."""

    @functools.wraps(init)
    def init_with_env_defaults(self: Any, **kwargs: Any) -> None:
        init(self, **{**env_defaults(), **kwargs})

    return init_with_env_defaults


def env_defaults() -> dict[str, Any]:
    """The ``PL_TRAINER_<NAME>`` values set for `TrainerArgs`' fields."""
    found = {}
    for field in dataclasses.fields(TrainerArgs):
        text = os.environ.get(f"PL_TRAINER_{field.name.upper()}")
        if text is None:
            continue
        try:
            found[field.name] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            found[field.name] = text
    return found
