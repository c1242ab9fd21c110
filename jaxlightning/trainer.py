"""The Trainer: a composition root. It checks its arguments, builds the
components, and tells `fit`, `validate`, `test` and `predict` as short stories.

Components (each owns its state, and receives in its constructor what it may touch):
the data `Pipeline`, the `Program` (compiled steps, train state, steps in flight),
the `FitLoop` and `EvalLoop` (the order of events), the `Reporter` (logged values
to the bar, loggers and ``callback_metrics``), the `StopPolicy`, `Progress`
(where the run is) and `Hooks` (callbacks, then the module).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax

from jaxlightning import checks
from jaxlightning.callbacks import Callback
from jaxlightning.callbacks.plateau import PlateauStepper
from jaxlightning.callbacks.rollback import Rollback
from jaxlightning.cluster import slurm
from jaxlightning.cluster.rank_zero import rank_zero_info
from jaxlightning.data.arrays import as_eval_loaders, as_loader
from jaxlightning.data.convert import loader_batch_size
from jaxlightning.data.datamodule import fit_loaders, is_datamodule, stage_loaders
from jaxlightning.data.datamodule import prepare as prepare_datamodule
from jaxlightning.data.prefetch import torch_threads
from jaxlightning.io.checkpoint import read_meta
from jaxlightning.loggers import Logger
from jaxlightning.loop import resume, signals
from jaxlightning.loop.eval_loop import eval_hook
from jaxlightning.loop.held_state import NonFiniteLossError
from jaxlightning.loop.wiring import wire
from jaxlightning.module import JaxModule
from jaxlightning.strategies import Strategy
from jaxlightning.training.state import TrainState
from jaxlightning.tuner.cost import StepCost

__all__ = ["NonFiniteLossError", "Trainer"]


def _arguments(local: dict[str, Any]) -> dict[str, Any]:
    """The constructor's arguments, from its ``locals()``."""
    return {k: v for k, v in local.items() if k not in ("self", "__class__")}


def _read(component: str, name: str, doc: str) -> Any:
    """A read-only property that reads ``name`` of the component ``component``."""
    return property(lambda self: getattr(getattr(self, component), name), doc=doc)


class Trainer:
    """Trains a `JaxModule` data-parallel over the local devices.

    Example:
        ```python
        trainer = jl.Trainer(max_epochs=10)
        trainer.fit(LitDigits(), train_loader, val_loader)
        trainer.validate(model, val_loader)  # [{"acc": 0.97, ...}]: names as logged
        ```

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
            ``False`` always loads batches on the host. ``trainer.data_path``
            and the model summary say which a fit uses.
        steps_per_execution: train this many batches per dispatch (Keras's
            name): one compiled program scans over them, so a small model
            stops paying the host's per-step dispatch (and, with the data on
            the devices, its per-step gather). Bitwise the same training as 1.
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
            Trainer's own values are always ``train/loss`` (and
            ``train/grad_norm``, ``train/skipped_updates``, ...).
        recompile: a training batch whose shapes or dtypes differ from the
            first one's (which would compile the step again): ``"warn"``
            (default; once per new signature, naming the leaf and the batch),
            ``"raise"`` (a `RecompileError`) or ``"allow"``.
    """

    def __init__(
        self,
        *,
        max_epochs: int | None = None,
        max_steps: int = -1,
        min_epochs: int | None = None,
        min_steps: int | None = None,
        max_time: str | dict[str, int] | datetime.timedelta | None = None,
        devices: int | str | Sequence[jax.Device] = "auto",
        accelerator: str = "auto",
        strategy: str | Strategy = "auto",
        log_every_n_steps: int = 50,
        val_check_interval: int | float | None = None,
        check_val_every_n_epoch: int | None = 1,
        num_sanity_val_steps: int = 2,
        limit_train_batches: int | float | None = None,
        limit_val_batches: int | float | None = None,
        limit_test_batches: int | float | None = None,
        limit_predict_batches: int | float | None = None,
        fast_dev_run: int | bool = False,
        overfit_batches: int | float = 0.0,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        log_grad_norm: bool = False,
        accumulate_grad_batches: int = 1,
        precision: str | int = "32-true",
        default_root_dir: str | os.PathLike[str] | None = None,
        logger: bool | Logger | Sequence[Logger] = True,
        enable_progress_bar: bool = True,
        seed: int | None = None,
        callbacks: Sequence[Callback] | Callback | None = None,
        enable_checkpointing: bool = True,
        stop_on_nonfinite_loss: bool = True,
        on_nonfinite: str | Rollback = "raise",
        use_distributed_sampler: bool = True,
        data_on_device: bool | str = "auto",
        steps_per_execution: int = 1,
        num_nodes: int | None = None,
        compilation_cache_dir: str | os.PathLike[str] | None = None,
        enable_model_summary: bool = True,
        profiler: str | None = None,
        stage_prefix: bool = False,
        recompile: str = "warn",
    ) -> None:
        parts = wire(self, self._resolve_ckpt_path, **_arguments(locals()))
        self.fast_dev_run, self.schedule = parts.fast_dev_run, parts.schedule
        self.default_root_dir, self.strategy = parts.default_root_dir, parts.strategy
        self.callbacks: list[Callback] = parts.callbacks
        self._default_epochs = parts.default_epochs  # fit warns, as Lightning
        self.datamodule: Any = None
        self.stage: str | None = None  # "fit", "validate", "test" or "predict" while running
        self.interrupted = False  # the last call failed or was interrupted (Lightning's flag)
        self._epoch_batches: tuple[int | None] | None = None  # fit's, once known
        self._train_loader: Any = None  # fit's training data, while it runs
        self._lightning_module: JaxModule | None = None  # the module fit last
        self._progress, self._reporter, self._stop = parts.progress, parts.reporter, parts.stop
        self._hooks, self._pipeline, self._program = parts.hooks, parts.pipeline, parts.program
        self._evaluation, self._fit_loop = parts.evaluation, parts.fit_loop

    # ------------------------------------------------------------ properties
    global_step = _read("_progress", "global_step", "Optimizer updates so far.")
    current_epoch = _read("_progress", "current_epoch", "Completed epochs.")
    epoch_completed = _read("_progress", "epoch_completed", "Whether the last epoch ran out.")
    train_samples_seen = _read("_progress", "train_samples_seen", "Real rows trained on here.")
    num_training_batches = _read("_progress", "num_training_batches", "Batches of this epoch.")
    num_eval_batches = _read("_progress", "num_eval_batches", "Batches of this evaluation.")
    sanity_checking = _read("_progress", "sanity_checking", "In the sanity check's validation.")
    steps_ahead = _read("_progress", "steps_ahead", "Steps the state is ahead of this batch.")
    is_last_batch = _read("_progress", "is_last_batch", "This batch is the epoch's last.")
    received_sigterm = _read("_stop", "received_sigterm", "This process got SIGTERM in a fit.")
    accumulate_grad_batches = _read("_progress", "accumulate", "Micro-batches per update.")
    callback_metrics = _read("_reporter", "callback_metrics", "Every reported value, by name.")
    logged_metrics = _read(
        "_reporter", "logged_metrics", "Every value logged in this call, the last of each name."
    )
    progress_bar_metrics = _read("_reporter", "progress_bar_metrics", "The bar's values.")
    loggers = _read("_reporter", "loggers", "Every logger.")
    log_dir = _read("_reporter", "log_dir", "The first logger's run directory.")
    logger = _read("_reporter", "logger", "The first logger (``None``: none).")
    checkpoint_callback = _read("_hooks", "checkpoint_callback", "The first `ModelCheckpoint`.")
    checkpoint_callbacks = _read("_hooks", "checkpoint_callbacks", "Every `ModelCheckpoint`.")
    progress_bar_callback = _read("_hooks", "progress_bar_callback", "The progress bar, if on.")
    data_path = _read(
        "_pipeline", "data_path", 'The last fit\'s batches: "device", "host" (None: none yet).'
    )
    seed = _read("_program", "seed", "The run's seed.")
    log_every_n_steps = _read("_fit_loop", "log_every_n_steps", "The logging interval.")
    max_epochs = _read("schedule", "max_epochs", "The epoch limit (``None``: none).")
    max_steps = _read("schedule", "max_steps", "The step limit (-1: none).")
    check_val_every_n_epoch = _read("schedule", "check_val_every_n_epoch", "Validation epochs.")
    val_check_interval = _read("schedule", "val_check_interval", "When validation runs.")

    @property
    def num_sanity_val_steps(self) -> float:
        """Validation batches of the sanity check per loader (``inf``: all, as -1 asks)."""
        n = self._fit_loop.num_sanity_val_steps
        return float("inf") if n < 0 else n

    num_devices = _read("strategy", "num_devices", "Devices over all processes.")

    @property
    def should_stop(self) -> bool:
        """Set it to stop the fit (once ``min_epochs``/``min_steps`` are reached)."""
        return self._stop.should_stop

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self._stop.should_stop = bool(value)

    @property
    def state(self) -> TrainState | None:
        """A copy of the train state (one, unreplicated) that stays valid while
        training goes on; ``None`` before `fit`. Copies on the devices: read
        what you need and drop it."""
        return self._program.held.state_copy()

    @property
    def lightning_module(self) -> JaxModule | None:
        """The module this Trainer last fit (``None`` before `fit`): `validate`,
        `test` and `predict` use it when called without one, as in Lightning."""
        return self._lightning_module

    @property
    def estimated_stepping_batches(self) -> float:
        """The optimizer steps this fit will take, from ``max_epochs`` (and the
        limited batches per epoch) and ``max_steps``; ``inf`` when unbounded.
        Readable in ``configure_optimizers`` to size schedules."""
        if self._epoch_batches is None:
            raise RuntimeError("estimated_stepping_batches is known once fit has its loaders")
        (batches,) = self._epoch_batches
        updates = None if batches is None else self._progress.updates_in(batches)
        return self.schedule.estimated_steps(updates)

    def train_step_cost(self) -> StepCost | None:
        """XLA's count of one compiled train step on one device: FLOPs and bytes
        (inputs, temporaries, outputs, peak), known before the step first runs
        (waits for its compile); ``None`` before `fit` or where the strategy
        compiles at the first call (``pmap``, several processes)."""
        return self._program.train_cost() if self._program.held.started else None

    def set_optimizer_state(self, kind: type, **values: Any) -> None:
        """Writes host ``values`` into the named fields of every ``kind`` node
        (a NamedTuple an optimizer transformation keeps as its state) in the
        train state: the next step reads them; nothing recompiles. For callbacks
        that steer a transformation they added (`StochasticWeightAveraging`)."""
        if not self._program.held.started:
            raise RuntimeError("set_optimizer_state needs a fit that has started")
        self._program.held.set_optimizer_state(kind, **values)

    def map_state(self, fn: Callable[[TrainState], TrainState]) -> None:
        """Replaces the train state by ``fn(state)`` (traced once, run on the
        devices, the same on each); ``trainer.state`` and, after training, the
        module's variables then show the result."""
        if not self._program.held.started:
            raise RuntimeError("map_state needs a fit that has started")
        self._program.held.map_state(fn)

    def recompute_batch_statistics(self) -> None:
        """During `fit`: sets the train state's ``batch_stats`` to the mean, over
        one pass of the training data, of each batch's statistics under the
        state's parameters (torch's ``update_bn``; `StochasticWeightAveraging`
        calls it after putting the average in)."""
        module, loader = self._program.fit_module, self._train_loader
        if module is None or loader is None or not self._program.held.started:
            raise RuntimeError("recompute_batch_statistics needs a running fit")
        if "batch_stats" not in self._program.held.live_state().model_state:
            raise ValueError(f"{type(module).__name__}'s variables have no 'batch_stats'")
        name = "the train dataloader (recomputing batch_stats)"
        with self._pipeline.eval_pass(loader, name, None, self.current_epoch) as batches:
            self._program.recompute_batch_statistics(module, batches)

    def eval_step_cost(self) -> StepCost | None:
        """XLA's count of the last evaluation's compiled step on one device
        (validation, the sanity check's or test): ``None`` before any, under
        ``pmap`` and in multi-process runs."""
        return self._program.steps.eval_cost()

    def checkpoint_payload(self, module: JaxModule) -> tuple[Any, dict[str, Any]]:
        """What a checkpoint of the run holds now: arrays and a JSON record.

        Waits for the steps in flight, and refuses (`NonFiniteLossError`) when
        a step since the last report had a non-finite loss, so a bad state is
        never saved.
        """
        tree = self._program.held.checkpoint_tree()
        meta = resume.checkpoint_record(
            self._hooks,
            module,
            self._progress,
            self.datamodule,
            resume.batching(jax.process_count(), loader_batch_size(self._train_loader)),
            seed=self.seed,
            log_dir=self.log_dir,
            num_devices=self.num_devices,
        )
        return tree, meta

    # ---------------------------------------------------------------- stages
    @contextlib.contextmanager
    def _stage(self, stage: str, module: JaxModule, datamodule: Any) -> Iterator[None]:
        """Runs a Trainer call: ``setup``/``teardown`` (always) with ``stage``, and
        ``on_exception`` when it fails; the datamodule is prepared and set up.
        The module sees this Trainer (``self.trainer``) only while it runs."""
        # (getattr: a module whose __init__ skipped super().__init__() is refused later)
        previous = (
            self.stage,
            getattr(module, "_trainer", None),
            getattr(module, "_host_log", None),
        )
        module._trainer, module._host_log = self, self._reporter.log_host
        self.stage = stage
        if datamodule is not None:
            self.datamodule = datamodule
            prepare_datamodule(datamodule, stage)
        self.interrupted = False
        self._hooks("setup", module, stage)
        self._reporter.reset()  # each call reports its own values (Lightning's reset)
        shutdown = contextlib.ExitStack()
        try:
            # One torch thread for in-process loading while XLA computes on the CPU.
            with torch_threads(1 if self.strategy.on_cpu else None):
                yield
        except SystemExit:  # a signal's clean stop is not a failure
            raise
        except KeyboardInterrupt as exc:  # Lightning's rule: the hooks, then exit(1)
            rank_zero_info("\nDetected KeyboardInterrupt, attempting graceful shutdown ...")
            shutdown.enter_context(signals.sigint_ignored())
            self.interrupted = True
            self._hooks("on_exception", module, exc)
            raise SystemExit(1) from exc
        except BaseException as exc:
            self.interrupted = True
            self._hooks("on_exception", module, exc)
            raise
        finally:
            with shutdown:
                self._hooks("teardown", module, stage)
                self.stage, module._trainer, module._host_log = previous
                if datamodule is not None and hasattr(datamodule, "teardown"):
                    datamodule.teardown(stage)

    def _last_exists(self) -> bool:
        try:
            self._resolve_ckpt_path("last")
        except FileNotFoundError:
            return False
        return True

    def _resolve_ckpt_path(self, ckpt_path: str | os.PathLike[str]) -> str:
        return resume.resolve_ckpt_path(
            ckpt_path, self.checkpoint_callback, self.loggers, self.default_root_dir
        )

    # ------------------------------------------------------------------- fit
    def fit(
        self,
        module: JaxModule,
        train_dataloaders: Iterable[Any] | None = None,
        val_dataloaders: Iterable[Any] | Sequence[Iterable[Any]] | None = None,
        *,
        datamodule: Any = None,
        ckpt_path: str | os.PathLike[str] | None = None,
    ) -> None:
        """Trains ``module``; validates on ``val_dataloaders`` per the schedule.

        Args:
            module: the model.
            train_dataloaders: the training batches (a DataLoader, usually),
                or arrays: an array, a tuple or a dict of them (batches of 32,
                shuffled; `jl.arrays` chooses another batch size).
            val_dataloaders: one loader (or arrays) or a list, or ``None``.
            datamodule: instead of the loaders, a `DataModule` (or a Lightning
                ``LightningDataModule``) whose ``train_dataloader`` and, if it
                has one, ``val_dataloader`` are used.
            ckpt_path: resume from a checkpoint: ``"last"``, ``"best"`` or a
                checkpoint folder. The run continues exactly where it stopped,
                mid-epoch included. A run that has nothing left to do (its
                checkpoint is at ``max_epochs``, say) just loads the
                checkpoint's variables into ``module`` and says so.
        """
        if datamodule is None and is_datamodule(train_dataloaders):  # fit(model, dm)
            datamodule, train_dataloaders = train_dataloaders, None
        self._lightning_module = module
        with self._stage("fit", module, datamodule):
            train, val = fit_loaders(train_dataloaders, val_dataloaders, datamodule, module)
            train, val = as_loader(train, shuffle=True), as_eval_loaders(val)
            self._fit(module, train, val, ckpt_path)

    def _fit(self, module: JaxModule, train: Any, val: Any, ckpt_path: Any) -> None:
        manual = checks.fit_module(module, self._program.options)
        val = self._evaluation.validation_loaders(module, val)
        self._epoch_batches = (self._pipeline.train_batches_per_epoch(train),)
        if self._default_epochs:
            warnings.warn(
                "`max_epochs` was not set. Setting it to 1000 epochs. To train without an "
                "epoch limit, set `max_epochs=-1`",
                UserWarning,
                stacklevel=3,  # the user's fit line
            )
        tx, plateau = checks.fit_optimizer(module, manual, self._program.options, self.callbacks)
        self.callbacks[:] = [c for c in self.callbacks if not isinstance(c, PlateauStepper)]
        if plateau is not None:  # configure_optimizers' ReduceLROnPlateau, for this fit
            self.callbacks.append(PlateauStepper(*plateau, self._program.held.set_plateau_scale))
        if ckpt_path is None and slurm.restarted():  # a requeued job goes on
            ckpt_path = "last" if self._last_exists() else None
        path = self._resolve_ckpt_path(ckpt_path) if ckpt_path is not None else None
        meta = read_meta(path) if path else None
        if meta is not None:
            self._reporter.resume_in(meta.get("log_dir"))
        skip, self._pipeline.resume_state = resume.start_from(meta, self._progress, train)
        # A fresh run always builds its state, even to train 0 steps (max_steps=0
        # initialises the module); one that continues a run may have nothing left.
        if path is not None or self._program.held.started:
            per_epoch = self._pipeline.train_batches_per_epoch(train)
            reason = resume.nothing_left(self._progress, self.schedule, per_epoch, skip)
            if reason:
                if path is not None:  # the module's variables will be the checkpoint's
                    self._program.forget(module)
                return resume.load_instead(module, path, self._progress, reason)

        # Every thread started from here on (prefetching, compiles) is joined on
        # every way out: one still running in XLA when the process exits aborts it.
        training = self._epoch_batches != (0,)  # limit_train_batches=0: no training
        self._train_loader = train  # for recompute_batch_statistics
        try:
            with contextlib.ExitStack() as threads:
                batches = None
                self._pipeline.signatures.reset()  # this fit's first batch sets the shapes
                if training:
                    batches = self._pipeline.train_epoch(train, self.current_epoch, skip)
                    threads.callback(batches.close)
                example = (batches and batches.first) or self._pipeline.example_batch(train)
                self._program.start(module, tx, example, path, threads)
                if meta is not None:
                    resume.load_states(self._hooks, self.datamodule, module, meta)
                self._stop.reset()
                self._progress.position = (self.current_epoch, skip)
                self._reporter.fix_run_dirs()  # on every process at once
                self._fit_loop.run(module, train, val, batches, skip)
            self._hand_back(module)
            if training:
                mapped = self._program.held.mapped
                self._hooks("on_train_end", module)
                if self._program.held.mapped != mapped:  # a callback replaced the state (SWA)
                    self._hand_back(module)
        finally:
            self._train_loader = None
        self._hooks("on_fit_end", module)

    def _hand_back(self, module: JaxModule) -> None:
        """Gives ``module`` the train state's variables."""
        module.variables = self._program.held.trained_variables()
        if module._nnx is not None:  # the user's NNX model holds the trained arrays
            module._nnx.update(module.model, module.variables)

    # ------------------------------------------------ validate, test, predict
    def validate(
        self,
        module: JaxModule | None = None,
        dataloaders: Any = None,
        *,
        datamodule: Any = None,
        ckpt_path: Any = None,
    ) -> list[dict[str, float]]:
        """Evaluates ``module`` (its ``validation_step``, else ``eval_step``);
        returns ``[{name: value}]`` (names as logged), one dict per loader.

        Uses the module's trained variables, or those of ``ckpt_path``
        (``"last"``, ``"best"`` or a checkpoint folder), which it then keeps.
        ``datamodule=`` takes the loaders from its ``val_dataloader()``.
        """
        if datamodule is None and is_datamodule(dataloaders):  # validate(model, dm)
            datamodule, dataloaders = dataloaders, None
        module = self._module_or_fitted(module, "validate")
        return self._run_eval_stage("validation", module, dataloaders, datamodule, ckpt_path)

    def test(
        self,
        module: JaxModule | None = None,
        dataloaders: Any = None,
        *,
        datamodule: Any = None,
        ckpt_path: Any = None,
    ) -> list[dict[str, float]]:
        """Like `validate`, with ``test_step`` (else ``eval_step``) and ``test/`` names."""
        if datamodule is None and is_datamodule(dataloaders):  # test(model, dm)
            datamodule, dataloaders = dataloaders, None
        module = self._module_or_fitted(module, "test")
        return self._run_eval_stage("test", module, dataloaders, datamodule, ckpt_path)

    def _module_or_fitted(self, module: JaxModule | None, call: str) -> JaxModule:
        """``module``, or (``None``, as Lightning allows) the one this Trainer fit."""
        if module is not None:
            return module
        if self.lightning_module is None:
            raise TypeError(
                f"trainer.{call}() needs the module: pass trainer.{call}(model, ...); this "
                "Trainer has not fit one it could use instead"
            )
        return self.lightning_module

    def _run_eval_stage(
        self, stage: str, module: JaxModule, dataloaders: Any, datamodule: Any, ckpt_path: Any
    ) -> list[dict[str, float]]:
        with self._stage("validate" if stage == "validation" else stage, module, datamodule):
            dataloaders = as_eval_loaders(stage_loaders(stage, dataloaders, datamodule))
            checks.module_hooks(module, eval_hook(module, stage))
            self._reporter.fix_run_dirs()  # on every process at once
            return self._evaluation.run(stage, module, dataloaders, ckpt_path)

    def predict(
        self,
        module: JaxModule | None = None,
        dataloaders: Any = None,
        *,
        datamodule: Any = None,
        return_predictions: bool | None = None,
        ckpt_path: Any = None,
        concatenate: bool = False,
    ) -> Any:
        """Runs ``predict_step`` over ``dataloaders`` (with ``ckpt_path``'s variables).

        Args:
            return_predictions: ``False`` returns ``None`` (Lightning's flag;
                ``None`` means ``True``).
            concatenate: return one output with a row per dataset example
                instead of one per batch.

        Returns:
            As Lightning: a list with one output per batch, its real rows (numpy
            arrays, the pytree ``predict_step`` returns), in order; with
            ``concatenate`` the batches joined (padding removed, dataset order).
            A list of those for a list of loaders.
        """
        if datamodule is None and is_datamodule(dataloaders):  # predict(model, dm)
            datamodule, dataloaders = dataloaders, None
        module = self._module_or_fitted(module, "predict")
        with self._stage("predict", module, datamodule):
            dataloaders = as_eval_loaders(stage_loaders("predict", dataloaders, datamodule))
            checks.module_hooks(module, "predict_step")
            out = self._evaluation.predict(module, dataloaders, ckpt_path, concatenate)
        return None if return_predictions is False else out
