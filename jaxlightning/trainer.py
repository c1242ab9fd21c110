"""The Trainer: the loop that orchestrates data, steps, metrics and hooks."""

from __future__ import annotations

import glob
import itertools
import os
import re
import signal
import warnings
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from torch.utils.data import RandomSampler

from jaxlightning import compile_cache, distributed
from jaxlightning.callbacks import Callback, ModelCheckpoint, TQDMProgressBar
from jaxlightning.checkpoint import find_last, json_safe, read_meta, restore, restore_variables
from jaxlightning.data import DeviceBatch, Padder, Prefetcher, loader_batch_size
from jaxlightning.loggers import Logger, TensorBoardLogger
from jaxlightning.module import JaxModule
from jaxlightning.sampling import EpochSampler, common_num_batches, epoch_loader
from jaxlightning.signals import StopRequest
from jaxlightning.state import TrainState, create_train_state
from jaxlightning.step import (
    Metrics,
    TrainMetrics,
    build_eval_step,
    build_predict_step,
    build_train_step,
    zero_eval_metrics,
    zero_train_metrics,
)
from jaxlightning.strategies import Strategy, resolve_strategy

_STAGE_PREFIX = {"validation": "val", "test": "test"}


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite."""


_PAD_BATCH = object()
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


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
        return list(devices)
    raise ValueError(f"devices={devices!r}: use 'auto', a count, or a list of jax devices")


def _host_values(metrics: Mapping[str, Any], prefix: str) -> dict[str, float]:
    """Host metric values from fetched clu averages; empty averages are left out."""
    return {
        f"{prefix}/{name}": float(m.total / m.count)
        for name, m in metrics.items()
        if int(m.count) > 0
    }


def _shard_shapes(tree: Any, rows: int) -> Any:
    """Abstract shapes of one device's shard of a host batch."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype), tree)


class Trainer:
    """Trains a `JaxModule` data-parallel over the local devices.

    Example:
        ```python
        trainer = jl.Trainer(max_epochs=10)
        trainer.fit(LitDigits(), train_loader, val_loader)
        trainer.validate(model, val_loader)  # [{"val/acc": 0.97, ...}]
        ```

    Args:
        max_epochs: stop after this many epochs (default 1000 when ``max_steps``
            is not set either, as in Lightning).
        max_steps: stop after this many optimizer steps (-1: no limit).
        devices: ``"auto"`` (all local devices), a count, or a list of devices.
        strategy: ``"auto"`` (= ``"shard_map"``), ``"pmap"``, ``"shard_map"`` or
            a `Strategy` instance.
        log_every_n_steps: report ``train/*`` averages every this many steps.
        check_val_every_n_epoch: validate after every this many epochs.
        default_root_dir: where logs go (default: the working directory).
        logger: ``True`` for a `TensorBoardLogger`, ``False`` for none, or a `Logger`.
        enable_progress_bar: show tqdm bars.
        seed: seeds initialisation, every per-device, per-step key, and the
            order of shuffled DataLoaders (seeded per epoch).
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
    """

    def __init__(
        self,
        *,
        max_epochs: int | None = None,
        max_steps: int = -1,
        devices: int | str | Sequence[jax.Device] = "auto",
        strategy: str | Strategy = "auto",
        log_every_n_steps: int = 50,
        check_val_every_n_epoch: int = 1,
        default_root_dir: str | os.PathLike[str] | None = None,
        logger: bool | Logger = True,
        enable_progress_bar: bool = True,
        seed: int = 0,
        callbacks: Sequence[Callback] | None = None,
        enable_checkpointing: bool = True,
        stop_on_nonfinite_loss: bool = True,
        use_distributed_sampler: bool = True,
        num_nodes: int | None = None,
        compilation_cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if max_epochs is None and max_steps == -1:
            max_epochs = 1000
        if log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps must be >= 1, got {log_every_n_steps}")
        if check_val_every_n_epoch < 1:
            raise ValueError(f"check_val_every_n_epoch must be >= 1, got {check_val_every_n_epoch}")
        self.max_epochs = max_epochs
        self.max_steps = max_steps
        self.log_every_n_steps = log_every_n_steps
        self.check_val_every_n_epoch = check_val_every_n_epoch
        self.default_root_dir = os.fspath(default_root_dir or os.getcwd())
        self.seed = seed
        distributed.initialize(num_nodes)  # before anything touches the devices
        if compilation_cache_dir is not None:
            compile_cache.enable(compilation_cache_dir)
        self.strategy = resolve_strategy(strategy)
        self.strategy.setup(_resolve_devices(devices))
        if logger is True:
            logger = TensorBoardLogger(self.default_root_dir)
        self.logger: Logger | None = logger or None
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

        self.global_step = 0
        self.current_epoch = 0
        self.callback_metrics: dict[str, float] = {}
        self.logged_metrics: dict[str, float] = {}
        self.num_training_batches: int | None = None
        self.num_eval_batches: int | None = None
        self.should_stop = False
        self.epoch_completed = False
        self._state: TrainState | None = None
        self._acc: TrainMetrics | None = None
        self._progress = (0, 0)  # (epoch, batch) of the next batch to train on
        self._epoch_offset = 0  # global step before the current epoch's batch 0
        self._stop_request = StopRequest()
        self._stop_signal = 0
        self._in_flight: deque[Any] = deque()
        self._eval_fns: dict[Any, Any] = {}
        self._fit_module: JaxModule | None = None

    # ------------------------------------------------------------ properties
    @property
    def state(self) -> TrainState | None:
        """One (unreplicated) copy of the train state; ``None`` before `fit`."""
        return None if self._state is None else self.strategy.unreplicate(self._state)

    @property
    def num_devices(self) -> int:
        return self.strategy.num_devices

    @property
    def log_dir(self) -> str | None:
        return self.logger.log_dir if self.logger is not None else None

    # --------------------------------------------------------------- helpers
    def _call(self, hook: str, module: JaxModule, *args: Any) -> None:
        for callback in self.callbacks:
            fn = getattr(callback, hook, None)
            if fn is not None:
                fn(self, module, *args)

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
    ) -> tuple[DeviceBatch | None, Iterator[DeviceBatch]]:
        """Starts prefetching ``loader``; returns its first batch and the iterator.

        With ``total``, yields exactly that many batches, adding all-padding
        ones at the end: every process of a multi-process run must run the same
        number of steps.
        """
        padder = Padder(self.strategy.num_local_devices, loader_batch_size(loader))
        put = self.strategy.put_batch

        def prepare(raw: Any) -> DeviceBatch:
            host = padder.empty() if raw is _PAD_BATCH else padder(raw)
            data, mask = put((host.data, host.mask))
            return DeviceBatch(host, data, mask)

        source = loader if total is None else _exactly(loader, total)
        prefetcher = Prefetcher(source, prepare, depth=self.strategy.prefetch_depth)
        iterator = iter(prefetcher)
        try:
            first = next(iterator)
        except StopIteration:
            prefetcher.close()
            if allow_empty:
                return None, iter(())
            raise ValueError(
                f"{name} yielded no batches; check the dataset's length and the "
                "DataLoader's drop_last setting"
            ) from None
        except BaseException:
            prefetcher.close()
            raise

        def run() -> Iterator[DeviceBatch]:
            try:
                yield from itertools.chain([first], iterator)
            finally:
                prefetcher.close()

        return first, run()

    def _example(self, first: DeviceBatch) -> Any:
        """One device's share of the first batch, for ``setup``."""
        rows = first.host.mask.shape[0] // self.strategy.num_local_devices
        return jax.tree.map(lambda x: x[:rows], first.host.data)

    def _init_state(
        self, module: JaxModule, tx: optax.GradientTransformation | None, first: DeviceBatch
    ) -> Any:
        """The initial train state (or, without ``tx``, just the variables).

        One compiled function: building the state op by op would compile each
        initialiser separately, which dominates the start-up of small models.
        The module's own ``variables`` (from an earlier fit) take precedence.
        """

        def jl_init(seed, variables, example):
            init_rng, train_rng = jax.random.split(jax.random.PRNGKey(seed))
            if variables is None:
                variables = module.setup(init_rng, example)
            if tx is None:
                return variables
            return create_train_state(variables, tx, train_rng)

        # Runs once: compiling it quickly matters more than running it quickly
        # (measured: 3x faster to compile, same values).
        init = jax.jit(jl_init, compiler_options=_FAST_COMPILE)
        return init(self.seed, module.variables, self._example(first))

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

    # ------------------------------------------------------------------- fit
    def fit(
        self,
        module: JaxModule,
        train_dataloaders: Iterable[Any],
        val_dataloaders: Iterable[Any] | Sequence[Iterable[Any]] | None = None,
        *,
        ckpt_path: str | os.PathLike[str] | None = None,
    ) -> None:
        """Trains ``module``; validates on ``val_dataloaders`` per the schedule.

        Args:
            module: the model.
            train_dataloaders: the training batches (a DataLoader, usually).
            val_dataloaders: one loader or a list, or ``None``.
            ckpt_path: resume from a checkpoint: ``"last"``, ``"best"`` or a
                checkpoint folder. The run continues exactly where it stopped,
                mid-epoch included.
        """
        self._check_module(module, "setup", "configure_optimizers", "loss")
        if val_dataloaders is not None:
            self._check_module(module, "eval_step")
        tx = module.configure_optimizers()
        if not isinstance(tx, optax.GradientTransformation):
            raise TypeError(
                f"configure_optimizers() returned {type(tx).__name__}; return an optax "
                "GradientTransformation such as optax.adam(1e-3)"
            )
        resume = self._resolve_ckpt_path(ckpt_path) if ckpt_path is not None else None
        meta = read_meta(resume) if resume else None
        if meta is not None:
            self._adopt_log_dir(meta.get("log_dir"))
            progress = meta["progress"]
            self.current_epoch, skip = progress["epoch"], progress["batch"]
            self.global_step = progress["global_step"]
        else:
            skip = 0

        first, batches = self._epoch_batches(train_dataloaders, self.current_epoch, skip)
        if first is None:  # a resumed epoch with no batches left
            example_first, example_batches = self._epoch_batches(train_dataloaders, 0, 0)
            example_batches.close()
        else:
            example_first = first
        state = self._init_state(module, tx, example_first)
        step_fn = build_train_step(module, tx)
        rows = example_first.host.mask.shape[0] // self.strategy.num_local_devices
        acc0 = zero_train_metrics(module, state, _shard_shapes(example_first.host.data, rows))
        acc = acc0
        if resume is not None:
            restored = restore(resume, {"state": state, "acc": acc0})
            state, acc = restored["state"], restored["acc"]
            self._load_callback_states(meta.get("callbacks", {}))
        train_step = self.strategy.compile(
            step_fn,
            sharded_args=(False, False, True, True),
            sharded_out=(False, False),
            donate_argnums=(0,),
        )
        self._state = self.strategy.replicate(state)
        acc0 = self.strategy.replicate(acc0)
        self._acc = self.strategy.replicate(acc)
        self._eval_fns.clear()
        self._fit_module = module
        self.should_stop = False
        self._stop_signal = 0
        self._progress = (self.current_epoch, skip)

        _ = self.log_dir  # fixes the run directory on every process at once
        if self.logger is not None and module.hparams and resume is None:
            self.logger.log_hyperparams(module.hparams)
        self._call("on_fit_start", module)
        epochs = (
            range(self.current_epoch, self.max_epochs)
            if self.max_epochs is not None
            else itertools.count(self.current_epoch)
        )
        try:
            with self._stop_request:
                for epoch in epochs:
                    if self._step_limit_reached():
                        break
                    self.current_epoch = epoch
                    self.epoch_completed = False
                    if batches is None:
                        _, batches = self._epoch_batches(train_dataloaders, epoch, 0)
                    self._epoch_offset = self.global_step - skip
                    self.num_training_batches = self._num_batches(train_dataloaders, skip)
                    self._call("on_train_epoch_start", module)
                    for batch_idx, batch in enumerate(batches, start=skip):
                        if self._step_limit_reached() or self._stop_signal:
                            self.should_stop = True
                            break
                        self._state, self._acc = train_step(
                            self._state, self._acc, batch.data, batch.mask
                        )
                        self._throttle(self._acc)
                        self.global_step += 1
                        self._progress = (epoch, batch_idx + 1)
                        at_report = self.global_step % self.log_every_n_steps == 0
                        if at_report:
                            self._report_train(log=True)
                            self._acc = acc0
                        self._stop_signal = self._agreed_signal(at_report)
                        self._call("on_train_batch_end", module, batch_idx)
                    else:
                        self.epoch_completed = True
                    batches.close()
                    batches, skip = None, 0
                    if self._stop_signal:
                        self._stop_on_signal(module)
                    if self.epoch_completed:
                        self._report_train(log=False)
                        if val_dataloaders is not None and (
                            (epoch + 1) % self.check_val_every_n_epoch == 0
                        ):
                            results = self._evaluate("validation", module, val_dataloaders)
                            self._log({k: v for r in results for k, v in r.items()})
                        self._progress = (epoch + 1, 0)
                    self._call("on_train_epoch_end", module)
                    if self.epoch_completed:
                        self.current_epoch = epoch + 1
                    if self.should_stop:
                        break
                self._report_train(log=False)
        except BaseException:
            self._call("teardown", module)
            raise
        finally:
            if batches is not None:
                batches.close()
            self._drain()
            if self.logger is not None:
                self.logger.finalize()
        module.variables = self.strategy.unreplicate(self._state).variables
        self._call("on_fit_end", module)

    def _epoch_batches(
        self, loader: Iterable[Any], epoch: int, skip: int
    ) -> tuple[DeviceBatch | None, Iterator[DeviceBatch]]:
        ordered = epoch_loader(
            loader,
            epoch=epoch,
            seed=self.seed,
            skip_batches=skip,
            own=self.use_distributed_sampler,
            rank=jax.process_index(),
            replicas=jax.process_count(),
        )
        return self._batches(
            ordered,
            "train_dataloaders",
            allow_empty=skip > 0,
            total=self._common_total(loader, ordered, skip),
        )

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
        return self.max_steps >= 0 and self.global_step >= self.max_steps

    def _num_batches(self, loader: Iterable[Any], skip: int = 0) -> int | None:
        n = self._num_batches_plain(loader)
        if n is None:
            return None
        n -= skip
        if self.max_steps >= 0:
            n = min(n, self.max_steps - self.global_step)
        return n

    def _fetch(self, tree: Any) -> Any:
        return jax.device_get(self.strategy.unreplicate(tree))

    def _check_finite(self, acc: TrainMetrics) -> None:
        bad = int(acc.first_nonfinite)
        if bad and self.stop_on_nonfinite_loss:
            raise NonFiniteLossError(
                f"the loss is not finite at step {bad} (epoch {self.current_epoch}, batch "
                f"{bad - 1 - self._epoch_offset}); training stopped and no checkpoint of "
                "it was saved. Lower the learning rate, clip gradients or check that batch; "
                "Trainer(stop_on_nonfinite_loss=False) trains on regardless"
            )

    def _report_train(self, *, log: bool) -> None:
        acc = self._fetch(self._acc)
        self._check_finite(acc)
        values = _host_values(acc.metrics, "train")
        if not values:
            return
        self.callback_metrics = {**self.callback_metrics, **values}
        if log:
            self._log(values)

    def _log(self, values: dict[str, float]) -> None:
        self.logged_metrics = {**values, "epoch": float(self.current_epoch)}
        self.callback_metrics = {**self.callback_metrics, **values}
        if self.logger is not None:
            self.logger.log_metrics(self.logged_metrics, step=self.global_step)

    # ----------------------------------------------------------- checkpoints
    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        """The first `ModelCheckpoint` among the callbacks."""
        return next((c for c in self.callbacks if isinstance(c, ModelCheckpoint)), None)

    def _callback_keys(self) -> list[tuple[str, Callback]]:
        seen: dict[str, int] = {}
        keys = []
        for cb in self.callbacks:
            name = type(cb).__name__
            seen[name] = seen.get(name, 0) + 1
            keys.append((name if seen[name] == 1 else f"{name}_{seen[name]}", cb))
        return keys

    def _load_callback_states(self, states: Mapping[str, Any]) -> None:
        for key, cb in self._callback_keys():
            if key in states and hasattr(cb, "load_state_dict"):
                cb.load_state_dict(states[key])

    def checkpoint_payload(self, module: JaxModule) -> tuple[Any, dict[str, Any]]:
        """What a checkpoint of the run holds now: arrays and a JSON record.

        Waits for the steps in flight, and refuses (`NonFiniteLossError`) when
        a step since the last report had a non-finite loss, so a bad state is
        never saved.
        """
        if self._state is None:
            raise RuntimeError("nothing to checkpoint: fit has not started")
        self._drain()
        acc = self._fetch(self._acc)
        self._check_finite(acc)
        tree = {"state": jax.device_get(self.strategy.unreplicate(self._state)), "acc": acc}
        epoch, batch = self._progress
        meta = {
            "progress": {"epoch": epoch, "batch": batch, "global_step": self.global_step},
            "callbacks": {
                key: cb.state_dict()
                for key, cb in self._callback_keys()
                if hasattr(cb, "state_dict") and cb.state_dict()
            },
            "hparams": json_safe(module.hparams),
            "module": f"{type(module).__module__}.{type(module).__qualname__}",
            "seed": self.seed,
            "log_dir": self.log_dir,
            "num_devices": self.num_devices,
        }
        return tree, meta

    def _agreed_signal(self, at_report: bool) -> int:
        """The stop signal every process acts on, so that all stop at one step.

        Alone, a signal counts at the next step. In a multi-process run the
        processes compare notes at each logging interval (a collective).
        """
        signum = self._stop_request.signum or 0
        if jax.process_count() == 1:
            return signum
        if not at_report:
            return 0
        from jax.experimental import multihost_utils

        return int(np.max(multihost_utils.process_allgather(np.int32(signum))))

    def _stop_on_signal(self, module: JaxModule) -> None:
        name = signal.Signals(self._stop_signal).name
        checkpoints = [c for c in self.callbacks if isinstance(c, ModelCheckpoint)]
        paths = [c.save(self, module) for c in checkpoints]
        for c in checkpoints:
            c.finish(prune=True)
        if not distributed.is_rank_zero():
            pass
        elif paths:
            print(
                f"Received {name} at step {self.global_step}: saved {paths[0]}. Resume with "
                "trainer.fit(model, ..., ckpt_path='last') (or that path).",
                flush=True,
            )
        else:
            print(
                f"Received {name} at step {self.global_step}: no ModelCheckpoint, nothing saved.",
                flush=True,
            )
        raise SystemExit(128 + self._stop_signal)

    def _checkpoint_dirs(self) -> list[str]:
        dirs = []
        cb = self.checkpoint_callback
        if cb is not None and cb.dirpath is not None:
            dirs.append(os.path.abspath(cb.dirpath))
        if isinstance(self.logger, TensorBoardLogger):
            root = os.path.join(self.logger.save_dir, self.logger.name)
            dirs += glob.glob(os.path.join(root, "version_*", "checkpoints"))
        dirs.append(os.path.join(self.default_root_dir, "checkpoints"))
        return dirs

    def _resolve_ckpt_path(self, ckpt_path: str | os.PathLike[str]) -> str:
        if ckpt_path not in ("last", "best"):
            return os.path.abspath(os.fspath(ckpt_path))
        cb = self.checkpoint_callback
        if ckpt_path == "best" and cb is not None and cb.best_model_path:
            return cb.best_model_path
        last = find_last(self._checkpoint_dirs())
        if last is None:
            raise FileNotFoundError(
                f"ckpt_path={ckpt_path!r}: no complete checkpoint in "
                f"{sorted(set(self._checkpoint_dirs()))}; pass a checkpoint folder instead"
            )
        if ckpt_path == "last":
            return last
        best = read_meta(last).get("callbacks", {}).get("ModelCheckpoint", {})
        if not best.get("best_model_path"):
            raise FileNotFoundError(f"ckpt_path='best': {last} records no best checkpoint")
        return best["best_model_path"]

    def _adopt_log_dir(self, log_dir: str | None) -> None:
        """Resumes logging into the checkpoint's run directory (one run in TensorBoard)."""
        logger = self.logger
        if not (log_dir and isinstance(logger, TensorBoardLogger)) or logger._version is not None:
            return
        parent, leaf = os.path.split(os.path.abspath(log_dir))
        root = os.path.abspath(os.path.join(logger.save_dir, logger.name))
        match = re.fullmatch(r"version_(\d+)", leaf)
        if parent == root and match:
            logger._version = int(match.group(1))

    # ------------------------------------------------------------ evaluation
    def _eval_variables(self, module: JaxModule, first: DeviceBatch, ckpt_path: Any) -> Any:
        if ckpt_path is not None:
            path = self._resolve_ckpt_path(ckpt_path)
            expected = self._init_state(module, None, first)
            module.variables = restore_variables(path, expected)
            return self.strategy.replicate(module.variables)
        if self._state is not None and self._fit_module is module:
            return self._state.variables
        if module.variables is None:
            warnings.warn(
                f"{type(module).__name__} has no trained variables (fit was not run and no "
                "ckpt_path given): evaluating the freshly initialised model",
                stacklevel=4,
            )
        return self.strategy.replicate(self._init_state(module, None, first))

    def _evaluate(
        self, stage: str, module: JaxModule, dataloaders: Any, ckpt_path: Any = None
    ) -> list[dict[str, float]]:
        loaders = list(dataloaders) if isinstance(dataloaders, (list, tuple)) else [dataloaders]
        prefix = _STAGE_PREFIX[stage]
        results = []
        for i, loader in enumerate(loaders):
            suffix = f"/dataloader_idx_{i}" if len(loaders) > 1 else ""
            metrics = self._evaluate_loader(stage, module, loader, ckpt_path if i == 0 else None)
            results.append({k + suffix: v for k, v in _host_values(metrics, prefix).items()})
        return results

    def _evaluate_loader(
        self, stage: str, module: JaxModule, loader: Any, ckpt_path: Any = None
    ) -> Metrics:
        first, batches = self._eval_batches(loader, f"the {stage} dataloader")
        variables = self._eval_variables(module, first, ckpt_path)
        rows = first.host.mask.shape[0] // self.strategy.num_local_devices
        example = _shard_shapes(first.host.data, rows)
        key = ("eval", module, jax.tree.structure(example), tuple(jax.tree.leaves(example)))
        if key not in self._eval_fns:
            compiled = self.strategy.compile(
                build_eval_step(module), sharded_args=(False, False, True, True), sharded_out=False
            )
            local = jax.eval_shape(self.strategy.unreplicate, variables)
            zeros = zero_eval_metrics(module, local, example)
            self._eval_fns[key] = (compiled, self.strategy.replicate(zeros))
        eval_step, acc = self._eval_fns[key]
        self.num_eval_batches = self._num_batches_plain(loader)
        self._call(f"on_{stage}_start", module)
        for batch_idx, batch in enumerate(batches):
            acc = eval_step(variables, acc, batch.data, batch.mask)
            self._throttle(acc)
            self._call(f"on_{stage}_batch_end", module, batch_idx)
        self._drain()
        self._call(f"on_{stage}_end", module)
        return self._fetch(acc)

    def _eval_batches(self, loader: Any, name: str) -> tuple[DeviceBatch, Iterator[DeviceBatch]]:
        """An evaluation loader's batches: in a multi-process run, this process's share."""
        if jax.process_count() == 1:
            return self._batches(loader, name)  # type: ignore[return-value]
        ordered = epoch_loader(
            loader,
            epoch=0,
            seed=self.seed,
            own=self.use_distributed_sampler,
            rank=jax.process_index(),
            replicas=jax.process_count(),
        )
        total = self._common_total(loader, ordered)
        return self._batches(ordered, name, total=total)  # type: ignore[return-value]

    @staticmethod
    def _num_batches_plain(loader: Any) -> int | None:
        try:
            return len(loader)
        except TypeError:
            return None

    def validate(
        self, module: JaxModule, dataloaders: Any, *, ckpt_path: Any = None
    ) -> list[dict[str, float]]:
        """Evaluates ``module`` with its ``eval_step``; returns ``[{"val/...": v}]``.

        Uses the module's trained variables, or those of ``ckpt_path``
        (``"last"``, ``"best"`` or a checkpoint folder), which it then keeps.
        """
        return self._run_eval_stage("validation", module, dataloaders, ckpt_path)

    def test(
        self, module: JaxModule, dataloaders: Any, *, ckpt_path: Any = None
    ) -> list[dict[str, float]]:
        """Like `validate`, with ``test/`` names."""
        return self._run_eval_stage("test", module, dataloaders, ckpt_path)

    def _run_eval_stage(
        self, stage: str, module: JaxModule, dataloaders: Any, ckpt_path: Any
    ) -> list[dict[str, float]]:
        self._check_module(module, "eval_step")
        _ = self.log_dir  # fixes the run directory on every process at once
        results = self._evaluate(stage, module, dataloaders, ckpt_path)
        values = {k: v for r in results for k, v in r.items()}
        self._log(values)
        if self.logger is not None:
            self.logger.finalize()
        return results

    def predict(self, module: JaxModule, dataloaders: Any, *, ckpt_path: Any = None) -> Any:
        """Runs ``predict_step`` over ``dataloaders`` (with ``ckpt_path``'s variables).

        Returns:
            The outputs concatenated over batches, padding removed: one row per
            dataset example, in order (numpy arrays, same pytree structure as
            ``predict_step``'s output). A list of those for a list of loaders.
        """
        self._check_module(module, "predict_step")
        if isinstance(dataloaders, (list, tuple)):
            return [
                self._predict_loader(module, d, ckpt_path if i == 0 else None)
                for i, d in enumerate(dataloaders)
            ]
        return self._predict_loader(module, dataloaders, ckpt_path)

    def _predict_loader(self, module: JaxModule, loader: Any, ckpt_path: Any) -> Any:
        first, batches = self._eval_batches(loader, "the predict dataloader")
        variables = self._eval_variables(module, first, ckpt_path)
        key = ("predict", module)
        if key not in self._eval_fns:
            self._eval_fns[key] = self.strategy.compile(
                build_predict_step(module), sharded_args=(False, True), sharded_out=True
            )
        predict_step = self._eval_fns[key]
        self.num_eval_batches = self._num_batches_plain(loader)
        self._call("on_predict_start", module)
        outputs = []
        for batch_idx, batch in enumerate(batches):
            out = predict_step(variables, batch.data)
            self._throttle(out)
            outputs.append((out, batch.host.real))
            self._call("on_predict_batch_end", module, batch_idx)
        self._drain()
        self._call("on_predict_end", module)
        if jax.process_count() > 1:
            return self._assemble_predictions(loader, [o for o, _ in outputs])
        rows = [jax.tree.map(lambda x, n=n: x[:n], self.strategy.gather(o)) for o, n in outputs]
        return jax.tree.map(lambda *xs: np.concatenate(xs), *rows)

    def _assemble_predictions(self, loader: Any, outputs: list[Any]) -> Any:
        """Every process's rows, back in dataset order (multi-process runs)."""
        if not self.use_distributed_sampler:
            raise ValueError(
                "predict in a multi-process run needs use_distributed_sampler=True, so the "
                "Trainer knows which process holds which example"
            )
        processes, b = jax.process_count(), loader.batch_size
        sampler = EpochSampler(
            len(loader.dataset),
            shuffle=isinstance(loader.sampler, RandomSampler),
            seed=self.seed,
            replicas=processes,
        )
        shares = [sampler.share(p) for p in range(processes)]
        gathered = [self.strategy.gather(o) for o in outputs]
        padded = jax.tree.leaves(gathered[0])[0].shape[0] // processes

        def place(*steps: np.ndarray) -> np.ndarray:
            out = np.empty((len(loader.dataset), *steps[0].shape[1:]), steps[0].dtype)
            for k, rows in enumerate(steps):
                for p, share in enumerate(shares):
                    idx = share[k * b : (k + 1) * b]
                    out[idx] = rows[p * padded : p * padded + len(idx)]
            return out

        return jax.tree.map(place, *gathered)
