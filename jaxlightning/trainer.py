"""The Trainer: the loop that orchestrates data, steps, metrics and hooks."""

from __future__ import annotations

import itertools
import os
import warnings
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax

from jaxlightning.callbacks import Callback, TQDMProgressBar
from jaxlightning.data import DeviceBatch, Padder, Prefetcher, loader_batch_size
from jaxlightning.loggers import Logger, TensorBoardLogger
from jaxlightning.module import JaxModule
from jaxlightning.state import TrainState, create_train_state
from jaxlightning.step import (
    AXIS,
    Metrics,
    build_eval_step,
    build_predict_step,
    build_train_step,
)
from jaxlightning.strategies import Strategy, resolve_strategy

_STAGE_PREFIX = {"validation": "val", "test": "test"}


def _resolve_devices(devices: int | str | Sequence[jax.Device]) -> list[jax.Device]:
    local = jax.local_devices()
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


def _zeros_like_metrics(fn: Any, *args: Any) -> Metrics:
    """Zero accumulators with the names a per-device function logs.

    Traces ``fn`` abstractly under `jax.vmap` over a one-device axis, which
    provides the collective axis without compiling or touching devices.
    """
    shapes = jax.eval_shape(jax.vmap(fn, axis_name=AXIS, in_axes=(None, None, 0, 0)), *args)
    metrics = shapes[1] if isinstance(shapes, tuple) else shapes
    return jax.tree.map(lambda s: np.zeros(s.shape[1:], s.dtype), metrics)


def _leading_one(tree: Any, rows: int) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((1, rows, *x.shape[1:]), x.dtype), tree)


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
        seed: seeds initialisation and every per-device, per-step key.
        callbacks: `Callback` instances, called in order.
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
        self.strategy = resolve_strategy(strategy)
        self.strategy.setup(_resolve_devices(devices))
        if logger is True:
            logger = TensorBoardLogger(self.default_root_dir)
        self.logger: Logger | None = logger or None
        self.callbacks: list[Callback] = list(callbacks or [])
        if enable_progress_bar and not any(isinstance(c, TQDMProgressBar) for c in self.callbacks):
            self.callbacks.append(TQDMProgressBar())

        self.global_step = 0
        self.current_epoch = 0
        self.callback_metrics: dict[str, float] = {}
        self.logged_metrics: dict[str, float] = {}
        self.num_training_batches: int | None = None
        self.num_eval_batches: int | None = None
        self.should_stop = False
        self._state: TrainState | None = None
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

    def _batches(self, loader: Iterable[Any], name: str) -> tuple[DeviceBatch, Iterator[Any]]:
        """Starts prefetching ``loader``; returns its first batch and the iterator."""
        padder = Padder(self.num_devices, loader_batch_size(loader))
        put = self.strategy.put_batch

        def prepare(raw: Any) -> DeviceBatch:
            host = padder(raw)
            data, mask = put((host.data, host.mask))
            return DeviceBatch(host, data, mask)

        prefetcher = Prefetcher(loader, prepare)
        iterator = iter(prefetcher)
        try:
            first = next(iterator)
        except StopIteration:
            prefetcher.close()
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
        rows = first.host.mask.shape[0] // self.num_devices
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

        return jax.jit(jl_init)(self.seed, module.variables, self._example(first))

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
    ) -> None:
        """Trains ``module``; validates on ``val_dataloaders`` per the schedule."""
        self._check_module(module, "setup", "configure_optimizers", "loss")
        if val_dataloaders is not None:
            self._check_module(module, "eval_step")
        tx = module.configure_optimizers()
        if not isinstance(tx, optax.GradientTransformation):
            raise TypeError(
                f"configure_optimizers() returned {type(tx).__name__}; return an optax "
                "GradientTransformation such as optax.adam(1e-3)"
            )

        first, batches = self._batches(train_dataloaders, "train_dataloaders")
        state = self._init_state(module, tx, first)

        step_fn = build_train_step(module, tx)
        rows = first.host.mask.shape[0] // self.num_devices
        acc0 = _zeros_like_metrics(
            step_fn,
            state,
            None,
            _leading_one(first.host.data, rows),
            jax.ShapeDtypeStruct((1, rows), bool),
        )
        train_step = self.strategy.compile(
            step_fn,
            sharded_args=(False, False, True, True),
            sharded_out=(False, False),
            donate_argnums=(0,),
        )
        self._state = self.strategy.replicate(state)
        acc0 = self.strategy.replicate(acc0)
        acc = acc0
        self._eval_fns.clear()
        self._fit_module = module
        self.should_stop = False

        if self.logger is not None and module.hparams:
            self.logger.log_hyperparams(module.hparams)
        self._call("on_fit_start", module)
        epochs = (
            range(self.current_epoch, self.max_epochs)
            if self.max_epochs
            else itertools.count(self.current_epoch)
        )
        try:
            for epoch in epochs:
                self.current_epoch = epoch
                self.num_training_batches = self._num_batches(train_dataloaders)
                if batches is None:
                    _, batches = self._batches(train_dataloaders, "train_dataloaders")
                self._call("on_train_epoch_start", module)
                completed = False
                for batch_idx, batch in enumerate(batches):
                    self._state, acc = train_step(self._state, acc, batch.data, batch.mask)
                    self._throttle(acc)
                    self.global_step += 1
                    if self.global_step % self.log_every_n_steps == 0:
                        self._report_train(acc, log=True)
                        acc = acc0
                    self._call("on_train_batch_end", module, batch_idx)
                    if self._step_limit_reached():
                        self.should_stop = True
                        break
                else:
                    completed = True
                batches.close()
                batches = None
                self._report_train(acc, log=False)
                if val_dataloaders is not None and (epoch + 1) % self.check_val_every_n_epoch == 0:
                    results = self._evaluate("validation", module, val_dataloaders)
                    self._log({k: v for r in results for k, v in r.items()})
                self._call("on_train_epoch_end", module)
                if completed:
                    self.current_epoch = epoch + 1
                if self.should_stop:
                    break
        finally:
            if batches is not None:
                batches.close()
            self._drain()
            if self.logger is not None:
                self.logger.finalize()
        module.variables = self.strategy.unreplicate(self._state).variables
        self._call("on_fit_end", module)

    def _step_limit_reached(self) -> bool:
        return self.max_steps >= 0 and self.global_step >= self.max_steps

    def _num_batches(self, loader: Iterable[Any]) -> int | None:
        try:
            n = len(loader)  # type: ignore[arg-type]
        except TypeError:
            return None
        if self.max_steps >= 0:
            n = min(n, self.max_steps - self.global_step)
        return n

    def _fetch(self, metrics: Metrics) -> Any:
        return jax.device_get(self.strategy.unreplicate(metrics))

    def _report_train(self, acc: Metrics, *, log: bool) -> None:
        values = _host_values(self._fetch(acc), "train")
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

    # ------------------------------------------------------------ evaluation
    def _eval_variables(self, module: JaxModule, first: DeviceBatch) -> Any:
        if self._state is not None and self._fit_module is module:
            return self._state.variables
        if module.variables is None:
            warnings.warn(
                f"{type(module).__name__} has no trained variables (fit was not run): "
                "evaluating the freshly initialised model",
                stacklevel=3,
            )
        return self.strategy.replicate(self._init_state(module, None, first))

    def _evaluate(self, stage: str, module: JaxModule, dataloaders: Any) -> list[dict[str, float]]:
        loaders = list(dataloaders) if isinstance(dataloaders, (list, tuple)) else [dataloaders]
        prefix = _STAGE_PREFIX[stage]
        results = []
        for i, loader in enumerate(loaders):
            suffix = f"/dataloader_idx_{i}" if len(loaders) > 1 else ""
            metrics = self._evaluate_loader(stage, module, loader)
            results.append({k + suffix: v for k, v in _host_values(metrics, prefix).items()})
        return results

    def _evaluate_loader(self, stage: str, module: JaxModule, loader: Any) -> Metrics:
        first, batches = self._batches(loader, f"the {stage} dataloader")
        variables = self._eval_variables(module, first)
        rows = first.host.mask.shape[0] // self.num_devices
        example = _leading_one(first.host.data, rows)
        key = ("eval", module, jax.tree.structure(example), tuple(jax.tree.leaves(example)))
        if key not in self._eval_fns:
            step_fn = build_eval_step(module)
            compiled = self.strategy.compile(
                step_fn, sharded_args=(False, False, True, True), sharded_out=False
            )
            zeros = _zeros_like_metrics(
                step_fn,
                jax.eval_shape(self.strategy.unreplicate, variables),
                None,
                example,
                jax.ShapeDtypeStruct((1, rows), bool),
            )
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

    @staticmethod
    def _num_batches_plain(loader: Any) -> int | None:
        try:
            return len(loader)
        except TypeError:
            return None

    def validate(self, module: JaxModule, dataloaders: Any) -> list[dict[str, float]]:
        """Evaluates ``module`` with its ``eval_step``; returns ``[{"val/...": v}]``."""
        return self._run_eval_stage("validation", module, dataloaders)

    def test(self, module: JaxModule, dataloaders: Any) -> list[dict[str, float]]:
        """Like `validate`, with ``test/`` names."""
        return self._run_eval_stage("test", module, dataloaders)

    def _run_eval_stage(
        self, stage: str, module: JaxModule, dataloaders: Any
    ) -> list[dict[str, float]]:
        self._check_module(module, "eval_step")
        results = self._evaluate(stage, module, dataloaders)
        values = {k: v for r in results for k, v in r.items()}
        self._log(values)
        if self.logger is not None:
            self.logger.finalize()
        return results

    def predict(self, module: JaxModule, dataloaders: Any) -> Any:
        """Runs ``predict_step`` over ``dataloaders``.

        Returns:
            The outputs concatenated over batches, padding removed: one row per
            dataset example, in order (numpy arrays, same pytree structure as
            ``predict_step``'s output). A list of those for a list of loaders.
        """
        self._check_module(module, "predict_step")
        if isinstance(dataloaders, (list, tuple)):
            return [self._predict_loader(module, d) for d in dataloaders]
        return self._predict_loader(module, dataloaders)

    def _predict_loader(self, module: JaxModule, loader: Any) -> Any:
        first, batches = self._batches(loader, "the predict dataloader")
        variables = self._eval_variables(module, first)
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
        rows = [jax.tree.map(lambda x, n=n: x[:n], self.strategy.gather(o)) for o, n in outputs]
        return jax.tree.map(lambda *xs: np.concatenate(xs), *rows)
