"""The Trainer: the loop that orchestrates data, steps, metrics and hooks."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import os
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from jaxlightning import checks, compile_cache, distributed
from jaxlightning.callbacks import Callback, ModelCheckpoint, TQDMProgressBar
from jaxlightning.callbacks.monitors import JaxProfiler, ModelSummary
from jaxlightning.checkpoint import read_meta
from jaxlightning.data import (
    Batches,
    DeviceBatch,
    Padder,
    Prefetcher,
    loader_batch_size,
    torch_threads,
)
from jaxlightning.datamodule import loaders as datamodule_loaders
from jaxlightning.evaluation import EvaluationMixin, eval_hook
from jaxlightning.hooks import HooksMixin, as_loggers
from jaxlightning.loggers import Logger, TensorBoardLogger
from jaxlightning.module import JaxModule
from jaxlightning.precision import resolve as precision_setting
from jaxlightning.reporting import report
from jaxlightning.resume import CheckpointingMixin
from jaxlightning.sampling import BatchSlice, common_num_batches, epoch_loader
from jaxlightning.schedule import Schedule, check_limit, parse_max_time
from jaxlightning.seed import default_seed
from jaxlightning.signals import StopRequest
from jaxlightning.startup import StartupMixin
from jaxlightning.state import TrainState
from jaxlightning.step import (
    TrainMetrics,
    is_manual,
)
from jaxlightning.strategies import Strategy, resolve_strategy


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite."""


_PAD_BATCH = object()


def _exactly(loader: Iterable[Any], total: int) -> Iterator[Any]:
    """``total`` items of ``loader``: cut short, or topped up with `_PAD_BATCH`."""
    n = 0
    for item in itertools.islice(loader, total):
        n += 1
        yield item
    for _ in range(total - n):
        yield _PAD_BATCH


def _resolve_devices(devices: int | str | Sequence[jax.Device]) -> list[jax.Device]:
    local = jax.local_devices()
    if jax.process_count() > 1:
        if devices not in ("auto", len(local)):
            raise ValueError(
                f"devices={devices!r} in a {jax.process_count()}-process run: each process "
                f"uses all of its {len(local)} local devices; use devices='auto'"
            )
        return jax.devices()
    if devices == "auto":
        return local
    if isinstance(devices, int) and not isinstance(devices, bool):
        if not 1 <= devices <= len(local):
            raise ValueError(
                f"devices={devices} but this process has {len(local)} local "
                f"{local[0].platform} device(s). Use devices='auto' or a count up to "
                f"{len(local)}; on a CPU-only machine, simulate N devices by setting "
                "XLA_FLAGS=--xla_force_host_platform_device_count=N before jax is imported"
            )
        return local[:devices]
    if isinstance(devices, Sequence) and all(isinstance(d, jax.Device) for d in devices):
        if not devices:
            raise ValueError("devices=[]: give at least one device, a count, or 'auto'")
        return list(devices)
    raise ValueError(f"devices={devices!r}: use 'auto', a count, or a list of jax devices")


class Trainer(StartupMixin, HooksMixin, EvaluationMixin, CheckpointingMixin):
    """Trains a `JaxModule` data-parallel over the local devices.

    Example:
        ```python
        trainer = jl.Trainer(max_epochs=10)
        trainer.fit(LitDigits(), train_loader, val_loader)
        trainer.validate(model, val_loader)  # [{"val/acc": 0.97, ...}]
        ```

    Args:
        max_epochs: stop after this many epochs (default 1000 when ``max_steps``
            is not set either, as in Lightning; -1: no epoch limit).
        max_steps: stop after this many optimizer steps (-1: no limit).
        devices: ``"auto"`` (all local devices), a count, or a list of devices.
        strategy: ``"auto"`` (= ``"shard_map"``, data parallel), ``"pmap"``,
            ``"shard_map"``, ``"fsdp"`` (state split over the devices), or a
            `Strategy` instance such as ``jl.ModelParallelStrategy(data=4,
            model=2)`` (tensor parallel by the model's partitioning annotations).
        log_every_n_steps: report ``train/*`` averages every this many steps.
        check_val_every_n_epoch: validate after every this many epochs.
        num_sanity_val_steps: before training, run this many batches of each
            validation loader (-1: all; 0: none), discarding the results, so
            that a bug in ``eval_step`` shows before an epoch of training
            rather than after it. Also compiles the eval step ahead.
        gradient_clip_val: clip the gradient, averaged across devices, to this
            global norm (or, with ``gradient_clip_algorithm="value"``, each
            element to this magnitude) before the optimizer sees it.
        gradient_clip_algorithm: ``"norm"`` or ``"value"``.
        log_grad_norm: log the global norm of the averaged gradient (before
            clipping) as ``train/grad_norm``.
        precision: ``"32-true"`` (default), ``"bf16-mixed"`` (float32 master
            parameters and optimizer state, bfloat16 forward and backward passes,
            float32 loss, gradients and metrics), ``"bf16-true"`` or
            ``"64-true"``; any flax model, no per-layer dtypes needed.
        accumulate_grad_batches: sum the gradients of this many consecutive
            batches (exactly, weighted by their real rows) into one optimizer
            update, as one batch that many times larger would; each batch is
            its own dispatch, so memory is that of one batch. ``global_step``
            and ``max_steps`` count updates; an epoch's leftover batches make
            one last, smaller update.
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
        use_distributed_sampler: let the Trainer own the order of plain
            DataLoaders (seeded per epoch, each process reading only its share),
            which makes runs reproducible and resumable mid-epoch without
            reloading consumed batches.
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
        use_distributed_sampler: bool = True,
        num_nodes: int | None = None,
        compilation_cache_dir: str | os.PathLike[str] | None = None,
        enable_model_summary: bool = True,
        profiler: str | None = None,
    ) -> None:
        max_epochs, max_steps = checks.epoch_limit(max_epochs, max_steps)
        self.log_every_n_steps = checks.int_arg("log_every_n_steps", log_every_n_steps, minimum=1)
        if check_val_every_n_epoch is not None:
            checks.int_arg("check_val_every_n_epoch", check_val_every_n_epoch, minimum=1)
        self.num_sanity_val_steps = checks.int_arg(
            "num_sanity_val_steps", num_sanity_val_steps, minimum=-1, hint=" (-1: all batches)"
        )
        limits = {
            name: check_limit(name, value)
            for name, value in [
                ("limit_train_batches", limit_train_batches),
                ("limit_val_batches", limit_val_batches),
                ("limit_test_batches", limit_test_batches),
                ("limit_predict_batches", limit_predict_batches),
            ]
        }
        overfit = check_limit("overfit_batches", overfit_batches) or None
        self.overfit_batches = overfit
        if overfit is not None:  # the first batches, unshuffled, for training and validation
            limits["limit_train_batches"] = limits["limit_val_batches"] = overfit
        self.fast_dev_run = checks.fast_dev_run(fast_dev_run)
        if self.fast_dev_run:  # a few batches of everything; nothing kept
            n = self.fast_dev_run
            max_epochs, max_steps, val_check_interval = 1, n, 1.0
            limits = dict.fromkeys(limits, n)
            self.num_sanity_val_steps = 0
            logger, enable_checkpointing = False, False
            callbacks = [c for c in _as_list(callbacks) if not isinstance(c, ModelCheckpoint)]
        self.schedule = Schedule(
            max_epochs=max_epochs,
            max_steps=max_steps,
            min_epochs=checks.int_arg("min_epochs", min_epochs or 0, minimum=0),
            min_steps=checks.int_arg("min_steps", min_steps or 0, minimum=0),
            max_time=parse_max_time(max_time),
            val_check_interval=1.0 if val_check_interval is None else val_check_interval,
            check_val_every_n_epoch=check_val_every_n_epoch,
            **limits,
        )
        seed = default_seed() if seed is None else seed
        self.seed = checks.int_arg("seed", seed, minimum=0)
        self.step_options = checks.step_options(
            gradient_clip_val, gradient_clip_algorithm, log_grad_norm, accumulate_grad_batches
        )
        self.step_options = dataclasses.replace(
            self.step_options, precision=precision_setting(precision)
        )
        self.default_root_dir = os.fspath(default_root_dir or os.getcwd())
        distributed.initialize(num_nodes)  # before anything touches the devices
        if compilation_cache_dir is not None:
            compile_cache.enable(compilation_cache_dir)
        self.strategy = resolve_strategy(strategy)
        self.strategy.setup(_resolve_devices(devices))
        if logger is True:
            logger = TensorBoardLogger(self.default_root_dir)
        self.loggers: list[Logger] = as_loggers(logger)
        if isinstance(callbacks, Callback):
            callbacks = [callbacks]
        self.callbacks: list[Callback] = list(callbacks or [])
        if enable_checkpointing and not any(isinstance(c, ModelCheckpoint) for c in self.callbacks):
            self.callbacks.append(ModelCheckpoint())
        self.stop_on_nonfinite_loss = stop_on_nonfinite_loss
        self.use_distributed_sampler = use_distributed_sampler
        if (
            enable_progress_bar
            and distributed.is_rank_zero()
            and not any(isinstance(c, TQDMProgressBar) for c in self.callbacks)
        ):
            self.callbacks.append(TQDMProgressBar())
        if enable_model_summary and not any(isinstance(c, ModelSummary) for c in self.callbacks):
            self.callbacks.insert(0, ModelSummary())
        if profiler not in (None, "jax"):
            raise ValueError(f"profiler={profiler!r}: use 'jax' or None")
        if profiler == "jax":
            self.callbacks.append(JaxProfiler())

        self.global_step = 0
        self.current_epoch = 0
        self.train_samples_seen = 0  # real rows this process has trained on
        self.callback_metrics: dict[str, float] = {}
        self.logged_metrics: dict[str, float] = {}
        self.progress_bar_metrics: dict[str, float] = {}
        self._train_options: dict[str, Any] = {}
        self.num_training_batches: int | None = None
        self.num_eval_batches: int | None = None
        self.should_stop = False
        self.epoch_completed = False
        self._state: TrainState | None = None
        self._acc: TrainMetrics | None = None
        self._progress = (0, 0)  # (epoch, batch) of the next batch to train on
        self._epoch_offset = 0  # the device's number of the batch before this epoch's first
        self._stop_request = StopRequest()
        self._stop_signal = 0
        self._in_flight: deque[Any] = deque()
        self._eval_fns: dict[Any, Any] = {}
        self._fit_module: JaxModule | None = None
        self._train_step: Any = None
        self.datamodule: Any = None
        self._fit_started = 0.0  # time.monotonic() when training began, for max_time
        self._time_up = False
        self._validate_at_epoch_end = False
        self._micro = 0
        self._flush: Any = None
        self._train_loader: Any = None
        self.stage: str | None = None  # "fit", "validate", "test" or "predict" while running

    # ------------------------------------------------------------ properties
    @property
    def state(self) -> TrainState | None:
        """One (unreplicated) copy of the train state; ``None`` before `fit`."""
        return None if self._state is None else self.strategy.unreplicate(self._state)

    @property
    def max_epochs(self) -> int | None:
        """The epoch limit (``None``: none)."""
        return self.schedule.max_epochs

    @property
    def max_steps(self) -> int:
        """The step limit (-1: none)."""
        return self.schedule.max_steps

    @property
    def check_val_every_n_epoch(self) -> int | None:
        return self.schedule.check_val_every_n_epoch

    @property
    def estimated_stepping_batches(self) -> float:
        """The optimizer steps this fit will take, from ``max_epochs`` (and the
        limited batches per epoch) and ``max_steps``; ``inf`` when unbounded.
        Readable in ``configure_optimizers`` to size schedules."""
        if self._train_loader is None:
            raise RuntimeError("estimated_stepping_batches is known once fit has its loaders")
        batches = self._epoch_batch_count(self._train_loader)
        k = self.step_options.accumulate_grad_batches
        return self.schedule.estimated_steps(None if batches is None else -(-batches // k))

    @property
    def num_devices(self) -> int:
        return self.strategy.num_devices

    @property
    def logger(self) -> Logger | None:
        """The first logger (``None`` without one); `loggers` has them all."""
        return self.loggers[0] if self.loggers else None

    @property
    def log_dir(self) -> str | None:
        """The first logger's run directory (checkpoints go there by default)."""
        return self.loggers[0].log_dir if self.loggers else None

    # --------------------------------------------------------------- helpers
    def _host_threads(self) -> Any:
        """One torch thread for in-process loading while XLA computes on the CPU."""
        return torch_threads(1 if self.strategy.on_cpu else None)

    def _throttle(self, token: Any) -> None:
        """Bounds the steps in flight by waiting on the oldest one's output."""
        self._in_flight.append(token)
        if len(self._in_flight) > self.strategy.max_in_flight:
            jax.block_until_ready(self._in_flight.popleft())

    def _drain(self) -> None:
        while self._in_flight:
            jax.block_until_ready(self._in_flight.popleft())

    def _batches(
        self,
        loader: Iterable[Any],
        name: str,
        *,
        allow_empty: bool = False,
        total: int | None = None,
    ) -> Batches:
        """Starts prefetching ``loader``; its first batch is ready on return.

        With ``total``, yields exactly that many batches, adding all-padding
        ones at the end: every process of a multi-process run must run the same
        number of steps. The caller closes the result.
        """
        padder = Padder(self.strategy.num_local_shards, loader_batch_size(loader))
        put = self.strategy.put_batch

        def prepare(raw: Any) -> DeviceBatch:
            host = padder.empty() if raw is _PAD_BATCH else padder(raw)
            data, mask = put((host.data, host.mask))
            return DeviceBatch(host, data, mask)

        source = loader if total is None else _exactly(loader, total)
        batches = Batches(Prefetcher(source, prepare, depth=self.strategy.prefetch_depth))
        if batches.first is None and not allow_empty:
            batches.close()
            raise ValueError(
                f"{name} yielded no batches; check the dataset's length and the "
                "DataLoader's drop_last setting"
            )
        return batches

    @staticmethod
    def _check_module(module: JaxModule, *hooks: str) -> None:
        if not isinstance(module, JaxModule):
            raise TypeError(f"expected a jaxlightning.JaxModule, got {type(module).__name__}")
        if not hasattr(module, "_log_sink"):
            raise TypeError(f"{type(module).__name__}.__init__ must call super().__init__() first")
        for hook in hooks:
            if not type(module)._overrides(hook):
                raise NotImplementedError(
                    f"{type(module).__name__} does not define {hook}(); the Trainer "
                    f"needs it here. See JaxModule.{hook} for its signature"
                )
        checks.lightning_signatures(module, hooks)
        checks.lightning_hooks(module)

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
            train_dataloaders: the training batches (a DataLoader, usually).
            val_dataloaders: one loader or a list, or ``None``.
            datamodule: instead of the loaders, a `DataModule` (or a Lightning
                ``LightningDataModule``) whose ``train_dataloader`` and, if it
                has one, ``val_dataloader`` are used.
            ckpt_path: resume from a checkpoint: ``"last"``, ``"best"`` or a
                checkpoint folder. The run continues exactly where it stopped,
                mid-epoch included. A run that has nothing left to do (its
                checkpoint is at ``max_epochs``, say) just loads the
                checkpoint's variables into ``module`` and says so.
        """
        with self._stage("fit", module, datamodule):
            if datamodule is not None:
                if train_dataloaders is not None or val_dataloaders is not None:
                    raise ValueError("pass either dataloaders or datamodule= to fit, not both")
                train_dataloaders = datamodule_loaders(datamodule, "train", required=True)
                val_dataloaders = datamodule_loaders(datamodule, "validation", required=False)
            if train_dataloaders is None:
                raise TypeError("fit needs train_dataloaders (or datamodule=...)")
            self._fit(module, train_dataloaders, val_dataloaders, ckpt_path)

    def _fit(
        self,
        module: JaxModule,
        train_dataloaders: Iterable[Any],
        val_dataloaders: Any,
        ckpt_path: str | os.PathLike[str] | None,
    ) -> None:
        manual = is_manual(module)
        objective = "training_step" if manual else "loss"
        init = () if module._nnx_model() is not None else ("setup",)
        self._check_module(module, *init, "configure_optimizers", objective)
        if manual and module._nnx_model() is not None:
            raise ValueError(
                "manual optimization (training_step) of NNX models is not supported yet"
            )
        if manual and type(module)._overrides("loss"):
            raise TypeError(
                f"{type(module).__name__} defines both loss() and training_step(); define "
                "loss() (one update from one loss) or training_step() (manual optimization)"
            )
        if manual and self.step_options.accumulate_grad_batches > 1:
            raise ValueError(
                "accumulate_grad_batches with manual optimization (training_step) is not "
                "supported; accumulate inside training_step or use optax.MultiSteps"
            )
        if val_dataloaders is not None:
            self._check_module(module, eval_hook(module, "validation"))
        self._train_loader = train_dataloaders
        tx = checks.optimizer(module, manual=manual)
        for callback in self.callbacks:  # features that live in the optimizer (EMA)
            transform = getattr(callback, "transform_optimizer", None)
            if transform is not None:
                if manual:
                    raise ValueError(
                        f"{type(callback).__name__} changes the optimizer, which manual "
                        "optimization (training_step) does not support"
                    )
                tx = transform(tx)
        if self.max_epochs != 1:
            checks.reiterable(train_dataloaders, "train_dataloaders", passes="once per epoch")
        for loader in _as_list(val_dataloaders):
            checks.reiterable(
                loader, "val_dataloaders", passes="in the sanity check and at every validation"
            )

        resume = self._resolve_ckpt_path(ckpt_path) if ckpt_path is not None else None
        meta = read_meta(resume) if resume else None
        skip = 0
        if meta is not None:
            self._adopt_log_dir(meta.get("log_dir"))
            progress = meta["progress"]
            self.current_epoch, skip = progress["epoch"], progress["batch"]
            self.global_step = progress["global_step"]
        # A fresh run always builds its state, even to train 0 steps (max_steps=0
        # initialises the module); one that continues a run may have nothing left.
        continues = resume is not None or self._state is not None
        finished = self._finished(train_dataloaders, skip) if continues else ""
        if finished:
            self._nothing_left(module, resume, finished)
            return

        # Every thread started from here on (prefetching, compiles) is joined on
        # every way out: one still running in XLA when the process exits aborts it.
        with contextlib.ExitStack() as threads:
            batches: Batches | None = self._epoch_batches(
                train_dataloaders, self.current_epoch, skip
            )
            threads.callback(batches.close)
            example = batches.first or self._first_batch(train_dataloaders)
            acc0 = self._start_run(module, tx, example, resume, meta, threads)
            self._progress = (self.current_epoch, skip)
            self._fit_loop(module, train_dataloaders, val_dataloaders, batches, skip, acc0)
        module.variables = self.strategy.unreplicate(self._state).variables
        if module._nnx is not None:  # the user's NNX model holds the trained arrays
            module._nnx.update(module.model, module.variables)
        self._call("on_train_end", module)
        self._call("on_fit_end", module)

    def _fit_loop(
        self,
        module: JaxModule,
        train_dataloaders: Iterable[Any],
        val_dataloaders: Any,
        batches: Batches | None,
        skip: int,
        acc0: TrainMetrics,
    ) -> None:
        _ = self.log_dir  # fixes the run directory on every process at once
        if module.hparams and skip == 0 and self.global_step == 0:
            for logger in self.loggers:
                logger.log_hyperparams(module.hparams)
        epochs = (
            range(self.current_epoch, self.max_epochs)
            if self.max_epochs is not None
            else itertools.count(self.current_epoch)
        )
        try:
            with self._stop_request:
                self._call("on_fit_start", module)
                self._sanity_check(module, val_dataloaders)
                self._call("on_train_start", module)
                self._fit_started = time.monotonic()
                for epoch in epochs:
                    if self._step_limit_reached():
                        break
                    self.current_epoch = epoch
                    if batches is None:
                        batches = self._epoch_batches(train_dataloaders, epoch, 0)
                    with batches:
                        loaders = (train_dataloaders, val_dataloaders)
                        self._train_epoch(module, loaders, batches, epoch, skip, acc0)
                    batches, skip = None, 0
                    if self._stop_signal:
                        self._stop_on_signal(module)
                    self._end_train_epoch(acc0)
                    if self.epoch_completed:
                        if val_dataloaders is not None and self._validate_at_epoch_end:
                            self._evaluate("validation", module, val_dataloaders)
                        self._progress = (epoch + 1, 0)
                    self._call("on_train_epoch_end", module)
                    if self.epoch_completed:
                        self.current_epoch = epoch + 1
                    if self._stopping():
                        break
        except BaseException:
            # Wind down without letting a second failure (a logger on a full disk,
            # say) replace the error that stopped the run.
            with contextlib.suppress(Exception):
                self._drain()
            self._finalize_loggers(quiet=True)
            raise
        self._drain()
        self._finalize_loggers()

    def _train_epoch(
        self,
        module: JaxModule,
        loaders: tuple[Iterable[Any], Any],
        batches: Batches,
        epoch: int,
        skip: int,
        acc0: TrainMetrics,
    ) -> None:
        """One epoch's steps from batch ``skip``; sets `epoch_completed`.

        Validations due after a batch (``val_check_interval``) run there, except
        one due after the epoch's last batch: that one runs at the epoch's end,
        after its last logging interval is reported, as a once-per-epoch one does.
        """
        loader, val_dataloaders = loaders
        self.epoch_completed = False
        # The device numbers batches (1-based) as update * k + micro-batch: this
        # epoch's batch 0 is number offset + 1 (an epoch starts at an update).
        k = self.step_options.accumulate_grad_batches
        self._epoch_offset = self.global_step * k + self._micro - skip
        epoch_batches = self._epoch_batch_count(loader)
        self.num_training_batches = self._num_batches(loader, skip)
        self._validate_at_epoch_end = self.schedule.validate_at_epoch_end(epoch, epoch_batches)
        self._call("on_train_epoch_start", module)
        # A run resumed from a checkpoint taken after batch `skip` (before any
        # validation due there) runs that validation first, as the run it continues did.
        if skip and val_dataloaders is not None:
            self._validate_after(module, val_dataloaders, epoch, skip, epoch_batches)
        for batch_idx, batch in enumerate(batches, start=skip):
            if self._stop_signal or self._step_limit_reached() or self._stopping():
                self.should_stop = True
                return
            self._call("on_train_batch_start", module, batch_idx)
            self._state, self._acc = self._train_step(
                self._state, self._acc, batch.data, batch.mask
            )
            self._throttle(self._acc)
            self.train_samples_seen += batch.host.real
            updated = self._count_update()
            self._progress = (epoch, batch_idx + 1)
            at_report = updated and self.global_step % self.log_every_n_steps == 0
            if at_report:
                self._report_train(acc0)
            self._stop_signal = self._agreed_signal(at_report)
            self._call("on_train_batch_end", module, batch_idx)
            if self._agreed_time_up(at_report):
                self._time_up = self.should_stop = True
            if val_dataloaders is not None and not self._stop_signal:  # else after resuming
                self._validate_after(module, val_dataloaders, epoch, batch_idx + 1, epoch_batches)
        self.epoch_completed = True
        if self._micro:  # an epoch ending between two updates updates with what it has
            self._state = self._flush(self._state)
            self._micro = 0
            self.global_step += 1

    def _agreed_time_up(self, at_report: bool) -> bool:
        """Whether ``max_time`` has passed, by process 0's clock in a multi-process
        run (asked at logging intervals, so that every process stops at one step)."""
        if self.schedule.max_time is None:
            return False
        up = self.schedule.time_up(time.monotonic() - self._fit_started)
        if jax.process_count() == 1:
            return up
        return at_report and bool(distributed.broadcast(np.bool_(up)))

    def _count_update(self) -> bool:
        """Counts a dispatched micro-batch; whether it completed an optimizer update
        (every ``accumulate_grad_batches`` of them): ``global_step`` counts updates."""
        self._micro += 1
        if self._micro < self.step_options.accumulate_grad_batches:
            return False
        self._micro = 0
        self.global_step += 1
        return True

    def _validate_after(
        self, module: JaxModule, val_dataloaders: Any, epoch: int, done: int, total: int | None
    ) -> None:
        """Validates if ``val_check_interval`` says so after batch ``done`` of the
        epoch; after its last batch, at the epoch's end instead."""
        if not self.schedule.validate_after_batch(epoch, done, total, self.global_step):
            return
        if done == total:
            self._validate_at_epoch_end = True
        else:
            self._evaluate("validation", module, val_dataloaders)

    def _stopping(self) -> bool:
        """Whether a requested stop takes effect now: ``should_stop`` waits for
        ``min_epochs``/``min_steps``; ``max_time`` does not."""
        if not self.should_stop:
            return False
        if self._time_up:
            return True
        # current_epoch counts completed epochs (it moves on once one completes)
        return self.schedule.may_stop(self.current_epoch, self.global_step)

    def _sanity_check(self, module: JaxModule, val_dataloaders: Any) -> None:
        """A few validation batches before training, results discarded."""
        if val_dataloaders is None or self.num_sanity_val_steps == 0:
            return
        limit = None if self.num_sanity_val_steps < 0 else self.num_sanity_val_steps
        self._evaluate("validation", module, val_dataloaders, limit=limit, publish=False)

    def _epoch_batches(self, loader: Iterable[Any], epoch: int, skip: int) -> Batches:
        """Epoch ``epoch``'s training batches from batch ``skip`` on (at most the
        limited count per epoch; unshuffled with ``overfit_batches``)."""
        ordered = epoch_loader(
            loader,
            epoch=epoch,
            seed=self.seed,
            skip_batches=skip,
            own=self.use_distributed_sampler,
            rank=jax.process_index(),
            replicas=jax.process_count(),
            shuffle=False if self.overfit_batches is not None else None,
        )
        total = self._common_total(loader, ordered, skip)
        per_epoch = self._epoch_batch_count(loader)
        if self.schedule.limit_train_batches is not None and per_epoch is not None:
            remaining = max(per_epoch - skip, 0)
            if total is None:
                ordered = BatchSlice(ordered, 0, remaining)
            else:
                total = min(total, remaining)
        return self._batches(ordered, "train_dataloaders", allow_empty=skip > 0, total=total)

    def _common_total(self, loader: Any, ordered: Any, skip: int = 0) -> int | None:
        """The batch count every process runs, in a multi-process run."""
        processes = jax.process_count()
        if processes == 1:
            return None
        if self.use_distributed_sampler:
            return common_num_batches(loader, processes, skip)
        from jax.experimental import multihost_utils

        counts = multihost_utils.process_allgather(np.int64(len(ordered)))
        if len(set(counts.tolist())) > 1:
            raise ValueError(
                f"with use_distributed_sampler=False every process must yield as many "
                f"batches; the processes' loaders have {counts.tolist()}"
            )
        return None

    def _step_limit_reached(self) -> bool:
        return self.schedule.step_limit_reached(self.global_step)

    def _epoch_batch_count(self, loader: Any) -> int | None:
        """Training batches per epoch: the loader's (this process's share in a
        multi-process run), cut by ``limit_train_batches``."""
        n = self._num_batches_plain(loader)
        if jax.process_count() > 1 and self.use_distributed_sampler and n is not None:
            n = common_num_batches(loader, jax.process_count())
        return self.schedule.batches("train", n)

    def _num_batches(self, loader: Iterable[Any], skip: int = 0) -> int | None:
        n = self._epoch_batch_count(loader)
        if n is None:
            return None
        n -= skip
        if self.max_steps >= 0:  # batches left until the last update
            k = self.step_options.accumulate_grad_batches
            n = min(n, (self.max_steps - self.global_step) * k - self._micro)
        return n

    def _fetch(self, tree: Any) -> Any:
        return jax.device_get(self.strategy.unreplicate(tree))

    def _check_finite(self, acc: TrainMetrics) -> None:
        bad = int(acc.first_nonfinite)  # the batch's number: update * k + micro-batch
        if bad and self.stop_on_nonfinite_loss:
            step = (bad - 1) // self.step_options.accumulate_grad_batches + 1
            raise NonFiniteLossError(
                f"the loss is not finite at step {step} (epoch {self.current_epoch}, batch "
                f"{bad - 1 - self._epoch_offset}); training stopped and no checkpoint of "
                "it was saved. Lower the learning rate, clip gradients or check that batch; "
                "Trainer(stop_on_nonfinite_loss=False) trains on regardless"
            )

    def _report_train(self, acc0: TrainMetrics) -> None:
        """Reports the values of this logging interval and starts the next one."""
        acc = self._fetch(self._acc)
        self._check_finite(acc)
        self._publish(report("train", self._train_options, acc.metrics, "step"))
        self._acc = self._acc.replace(metrics=acc0.metrics)

    def _end_train_epoch(self, acc0: TrainMetrics) -> None:
        """Reports the epoch's last (partial) interval and its ``on_epoch`` values.

        After a complete epoch the accumulators start over: logging intervals
        never span two epochs. An epoch cut short (``max_steps``, ``should_stop``)
        keeps them, so that a run resumed from its checkpoint continues them
        exactly as an uninterrupted run would.
        """
        acc = self._fetch(self._acc)
        self._check_finite(acc)
        values = report("train", self._train_options, acc.metrics, "step")
        values.update(report("train", self._train_options, acc.epoch, "epoch"))
        self._publish(values)
        if self.epoch_completed:
            self._acc = acc0


def _as_list(loaders: Any) -> list[Any]:
    if loaders is None:
        return []
    return list(loaders) if isinstance(loaders, (list, tuple)) else [loaders]
