"""The program: the compiled steps, the train state they carry, and the steps in flight.

The loops never touch state arrays: they hand the program device batches and
ask it for fetched metrics, checkpoint arrays and evaluation variables.

Start-up order of a fit: XLA compiles the initial state on a worker thread
while the main thread traces the train step, which then compiles in turn while
the main thread sets up the rest of the run. Every thread started here is
registered with the caller's ``threads`` stack, which joins it on every way
out (one still running in XLA when the process exits aborts it).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxlightning.callbacks.plateau import PlateauScaleState
from jaxlightning.data import DeviceBatch
from jaxlightning.data.convert import Rows
from jaxlightning.io.checkpoint import restore, restore_variables
from jaxlightning.loop.multistep import host_steps, resident_steps
from jaxlightning.loop.progress import Progress
from jaxlightning.module import JaxModule
from jaxlightning.strategies import Strategy
from jaxlightning.training.compiling import (
    Background,
    Precompiled,
    compile_with_options,
    in_background,
    join_quietly,
)
from jaxlightning.training.nnx import NnxGraph
from jaxlightning.training.precision import for_storage
from jaxlightning.training.state import TrainState, create_train_state
from jaxlightning.training.step import (
    Metrics,
    Options,
    StepOptions,
    TrainMetrics,
    build_eval_step,
    build_flush,
    build_predict_step,
    build_statistics_step,
    build_train_parts,
    build_train_step,
    checked_setup,
    is_manual,
    zero_eval_metrics,
    zero_train_metrics,
)
from jaxlightning.tuner.cost import StepCost, cost_of, step_cost

# For programs that run once (the initial state): XLA's optimisation level 1
# and, on CPU, its older fusion emitters compile the random initialisers of an
# MNIST-sized MLP in 0.3 s instead of 1.1 s, with bitwise the values of the
# default compile (level 0 is faster still, but rounds differently: 1 ulp).
# Both are private XLA options: `compile_with_options` drops any the backend
# rejects (JAX 0.11 removed the fusion-emitter one).
_RUN_ONCE_OPTIONS = {"xla_backend_optimization_level": 1}
_RUN_ONCE_CPU_OPTIONS = {**_RUN_ONCE_OPTIONS, "xla_cpu_use_fusion_emitters": False}


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite."""


def shard_shapes(tree: Any, rows: int) -> Any:
    """Abstract shapes of one device's shard of a host batch, in the dtypes JAX
    will give it (int64 labels become int32 unless x64 is enabled)."""

    def shard(x: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((rows, *x.shape[1:]), jax.dtypes.canonicalize_dtype(x.dtype))

    return jax.tree.map(shard, tree)


class Program:
    """Owns the train state, the compiled steps and the bound on steps in flight.

    Args:
        strategy: lays out the state and compiles the per-device functions.
        options: what the train step does besides the update (precision,
            clipping, accumulation).
        seed: seeds initialisation and every per-device, per-step key.
        progress: the run's position (named in non-finite loss errors).
        stop_on_nonfinite_loss: raise `NonFiniteLossError` at the next report.
        steps_per_execution: the most batches `train_group` runs in one dispatch.
    """

    def __init__(
        self,
        strategy: Strategy,
        options: StepOptions,
        *,
        seed: int,
        progress: Progress,
        stop_on_nonfinite_loss: bool = True,
        steps_per_execution: int = 1,
    ) -> None:
        self.strategy = strategy
        self.options = options
        self.seed = seed
        self.progress = progress
        self.stop_on_nonfinite_loss = stop_on_nonfinite_loss
        self.steps_per_execution = steps_per_execution
        self.train_options: Options = {}
        self.fit_module: JaxModule | None = None  # whose variables the state holds
        self._state: TrainState | None = None
        self._acc: TrainMetrics | None = None
        self._acc0: TrainMetrics | None = None
        self._train_step: Any = None
        self._flush: Any = None
        self._steps: Any = None  # the train step as jitted (for groups of batches)
        self._group_fns: dict[str, Any] = {}
        self._eval_fns: dict[Any, Any] = {}
        # The last evaluation's step and the shapes it was called with.
        self._last_eval: tuple[Any, tuple[Any, ...]] | None = None
        self._in_flight: deque[Any] = deque()
        self.mapped = 0  # how many times `map_state` replaced the state

    # ----------------------------------------------------------- the state
    @property
    def started(self) -> bool:
        """Whether a fit built (or restored) a train state."""
        return self._state is not None

    def state_copy(self) -> TrainState | None:
        """One (unreplicated) copy of the train state that later steps leave
        valid (the steps donate their input buffers); ``None`` before `fit`."""
        if self._state is None:
            return None
        return jax.tree.map(lambda x: x.copy(), self.strategy.unreplicate(self._state))

    def live_state(self) -> TrainState:
        """The placed train state itself: valid until the next train step."""
        if self._state is None:
            raise RuntimeError("fit has not started")
        return self._state

    def trained_variables(self) -> Any:
        """The state's variables (one copy), to hand back to the module."""
        return self.strategy.unreplicate(self.live_state()).variables

    def checkpoint_tree(self) -> dict[str, Any]:
        """What a checkpoint writes: the state's arrays and the metric
        accumulator, after the steps in flight; refuses a non-finite loss, and
        a state ahead of the batch the hooks are at (several per dispatch)."""
        if not self.started:
            raise RuntimeError("nothing to checkpoint: fit has not started")
        if self.progress.steps_ahead:
            raise RuntimeError(
                f"a checkpoint now would hold a train state {self.progress.steps_ahead} "
                "step(s) ahead of this batch (steps_per_execution runs several batches per "
                "dispatch); save at the end of a dispatch: in on_train_batch_end when "
                "trainer.steps_ahead == 0, or with ModelCheckpoint(every_n_train_steps=...), "
                "which ends dispatches at its steps"
            )
        self.drain()
        acc = self.fetch_metrics()
        return {"state": self.strategy.checkpoint_arrays(self.live_state()), "acc": acc}

    # ------------------------------------------------------------- start-up
    def start(
        self,
        module: JaxModule,
        tx: optax.GradientTransformation,
        example: DeviceBatch,
        resume: str | None,
        threads: contextlib.ExitStack,
    ) -> None:
        """Builds (or restores from ``resume``) the state and compiles the train step."""
        shapes, pending_state = self._start_init_state(module, tx, example)
        threads.callback(join_quietly, pending_state)
        rows = example.host.mask.shape[0] // self.strategy.num_local_shards
        acc0, self.train_options = zero_train_metrics(
            module, shapes, shard_shapes(example.host.data, rows), tx, self.options
        )
        train_step = self._compile_train(module, tx)
        self._steps, self._group_fns = train_step, {}
        train_step = self.strategy.precompile(train_step, shapes, acc0, example.data, example.mask)
        if isinstance(train_step, Precompiled):
            threads.callback(train_step.join)
        self._train_step = train_step
        self._flush = None
        if self.options.accumulate_grad_batches > 1:
            self._flush = self.strategy.compile_global(build_flush(tx, self.options))
        state = pending_state.result()
        acc = acc0
        if resume is not None:
            restored = restore(resume, {"state": state, "acc": acc0})
            state, acc = restored["state"], restored["acc"]
        self.progress.micro = int(getattr(state, "micro", 0))  # since the last update
        self._state = self.strategy.place_state(state)
        self._acc = self.strategy.replicate(acc)
        self._acc0 = self.strategy.replicate(acc0)
        self._eval_fns.clear()
        self.fit_module = module

    def _compile_train(self, module: JaxModule, tx: optax.GradientTransformation) -> Any:
        """``module``'s train step, compiled by the strategy (not yet for any shapes)."""
        if is_manual(module):
            return self.strategy.compile_manual(build_train_step(module, tx, self.options))
        parts = build_train_parts(
            module,
            tx,
            self.options,
            self.strategy.reduce_grads(),
            self.strategy.gathering(),
        )
        return self.strategy.compile_train(parts)

    def _start_init_state(
        self, module: JaxModule, tx: optax.GradientTransformation, first: DeviceBatch
    ) -> tuple[Any, Background]:
        """The initial train state's shapes now, and the state itself compiled
        and computed on a worker thread while the caller traces the train step.
        The caller must wait for the future on every path (`join_quietly`)."""
        init, args = self._init_program(module, tx, first)
        traced = init.trace(*args)
        lowered = traced.lower()
        return traced.out_info, in_background(lambda: self._compile_once(lowered)(*args))

    def _compile_once(self, lowered: Any) -> Any:
        # Runs once: compiling it quickly matters more than running it quickly.
        options = _RUN_ONCE_CPU_OPTIONS if self.strategy.on_cpu else _RUN_ONCE_OPTIONS
        return compile_with_options(lowered, options)

    def _example(self, first: DeviceBatch) -> Any:
        """One device's share of the first batch, for ``setup``."""
        rows = first.host.mask.shape[0] // self.strategy.num_local_shards
        return jax.tree.map(lambda x: x[:rows], first.host.data)

    def _init_function(
        self, module: JaxModule, tx: optax.GradientTransformation | None, *, boxed: bool
    ) -> Callable[..., Any]:
        """``(seed, variables, example) -> state`` (without ``tx``, just the
        variables); with ``boxed``, flax partitioning annotations kept."""
        model = module._nnx_model()
        if model is not None and module._nnx is None:  # split on the host, once
            module._nnx = NnxGraph(model)
        precision, accumulate = self.options.precision, self.options.accumulate_grad_batches

        def jl_init(seed, variables, example):
            init_rng, train_rng = jax.random.split(jax.random.PRNGKey(seed))
            if variables is None:
                variables = checked_setup(module, init_rng, example)
            variables = for_storage(variables, precision)
            if tx is None:
                out = variables
            else:
                out = create_train_state(variables, tx, train_rng, accumulate)
            # Partitioning annotations only say where arrays go: the state holds
            # plain arrays, laid out by the strategy.
            return out if boxed else nn.meta.unbox(out)

        return jl_init

    def _init_program(
        self, module: JaxModule, tx: optax.GradientTransformation | None, first: DeviceBatch
    ) -> tuple[Any, tuple[Any, ...]]:
        """The jitted initialisation and its arguments. A strategy that lays out
        the state (`Strategy.plan`) gets its annotated shapes first, and the
        program builds it with that layout."""
        args = (self.seed, module.variables, self._example(first))

        def annotated() -> Any:
            return jax.eval_shape(self._init_function(module, tx, boxed=True), *args)

        init = self._init_function(module, tx, boxed=False)
        if tx is None:
            shardings = self.strategy.plan_variables(annotated)
        else:
            shardings = self.strategy.plan(annotated)
        if shardings is None:
            return jax.jit(init), args
        return jax.jit(init, out_shardings=shardings), args

    def _variables_layout(self, module: JaxModule, first: DeviceBatch) -> Callable[[], Any]:
        """The annotated shapes of ``module``'s variables, on demand."""
        args = (self.seed, module.variables, self._example(first))
        return lambda: jax.eval_shape(self._init_function(module, None, boxed=True), *args)

    # ------------------------------------------------------------- training
    def train(self, batch: DeviceBatch) -> None:
        """Dispatches one train step (waits for an older one past the bound)."""
        self._state, self._acc = self._train_step(self._state, self._acc, batch.data, batch.mask)
        self.throttle(self._acc)

    def set_optimizer_state(self, kind: type, **values: Any) -> None:
        """Writes host ``values`` into the named fields of every node of type
        ``kind`` (a NamedTuple) in the train state's optimizer state, each leaf
        keeping its shape, dtype and placement: the next step reads them, and
        nothing recompiles."""
        if not values:
            return

        def replace(node: Any) -> Any:
            if not isinstance(node, kind):
                return node
            return node._replace(**{f: _put_like(getattr(node, f), v) for f, v in values.items()})

        found = []

        def is_node(node: Any) -> bool:
            if isinstance(node, kind):
                found.append(node)
                return True
            return False

        state = self.live_state()
        opt_state = jax.tree.map(replace, state.opt_state, is_leaf=is_node)
        if not found:
            raise RuntimeError(f"the optimizer state holds no {kind.__name__}")
        self._state = state.replace(opt_state=opt_state)

    def set_plateau_scale(self, value: float) -> None:
        """Writes ``value`` as the train state's plateau scale (`plateau_scale`'s
        state): the next step multiplies its update by it, no recompile."""
        self.set_optimizer_state(PlateauScaleState, scale=value)

    def map_state(self, fn: Callable[[TrainState], TrainState]) -> None:
        """Replaces the train state by ``fn(state)``, compiled as one program the
        same on every device (after the steps in flight)."""
        self.drain()
        self._state = self.strategy.compile_global(fn)(self.live_state())
        self.mapped += 1

    def recompute_batch_statistics(self, module: JaxModule, batches: Any) -> None:
        """Sets the state's ``batch_stats`` to the mean over ``batches`` of each
        batch's statistics under the state's parameters (`build_statistics_step`)."""
        state = self.live_state()
        step = self.strategy.compile(
            build_statistics_step(module, self.seed, self.options.precision),
            sharded_args=(False, False, True, True),
            sharded_out=False,
        )
        local = jax.eval_shape(self.strategy.unreplicate, state.model_state["batch_stats"])
        zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), local)
        acc = self.strategy.replicate((zeros, np.zeros((), np.int32)))
        for batch in batches:
            acc = step(state.variables, acc, batch.data, batch.mask)
            self.throttle(acc)
        self.drain()
        sums, n = self.fetch(acc)
        if int(n) == 0:
            return
        stats = jax.tree.map(
            lambda leaf, total: _put_like(leaf, np.asarray(total) / int(n)),
            state.model_state["batch_stats"],
            sums,
        )
        self._state = state.replace(model_state={**state.model_state, "batch_stats": stats})
        self.mapped += 1

    def ready(self) -> None:
        """Waits for the train step's ahead-of-time compile (errors surface at
        the first step)."""
        if isinstance(self._train_step, Precompiled):
            self._train_step.join()

    def train_cost(self) -> StepCost | None:
        """XLA's count of one train step on one device (waits for its compile);
        ``None`` where the strategy compiles at the first call instead."""
        step = self._train_step
        if isinstance(step, Precompiled):
            compiled = step.compiled()
            return None if compiled is None else step_cost(compiled)
        return None

    def cost_at(
        self, module: JaxModule, tx: optax.GradientTransformation, example: DeviceBatch, rows: int
    ) -> StepCost | None:
        """XLA's count of ``module``'s train step for a global batch of ``rows``
        rows (a multiple of the shards), like ``example``'s otherwise: compiled
        from shapes alone, never run, the state untouched."""
        init, args = self._init_program(module, tx, example)
        state = init.trace(*args).out_info
        per_shard = rows // self.strategy.num_local_shards

        data = shard_shapes(example.host.data, rows)  # the global batch's shapes
        mask = Rows(jax.ShapeDtypeStruct((rows,), bool), jax.ShapeDtypeStruct((rows,), jnp.int32))
        acc0, _ = zero_train_metrics(
            module, state, shard_shapes(example.host.data, per_shard), tx, self.options
        )
        acc0 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), acc0)
        return cost_of(self._compile_train(module, tx), state, acc0, data, mask)

    def train_group(self, batches: list[Any]) -> None:
        """Dispatches the train steps of ``batches`` as one program (`multistep`):
        the state ends as ``train`` of each in turn would leave it. A group
        shorter than ``steps_per_execution`` (cut by a report, a validation, an
        epoch's end) runs batch by batch instead: one group program to compile,
        not one per length."""
        if len(batches) < self.steps_per_execution or len(batches) == 1:
            for batch in batches:
                self.train(batch)
            return
        resident = getattr(batches[0], "dataset", None)
        if resident is not None and all(getattr(b, "dataset", None) is resident for b in batches):
            if "resident" not in self._group_fns:
                replicated, sharded = self.strategy.batch_placement  # type: ignore[misc]
                self._group_fns["resident"] = resident_steps(self._steps, replicated, sharded)
            indices = np.stack([b.indices for b in batches])
            rows = jax.tree.map(lambda *r: np.stack(r), *(b.rows for b in batches))
            self._state, self._acc = self._group_fns["resident"](
                self._state, self._acc, resident.data, indices, rows
            )
        else:
            if "host" not in self._group_fns:  # a ShardMapStrategy's (checks.steps_per_execution)
                sharded = self.strategy.batch_sharding  # type: ignore[attr-defined]
                self._group_fns["host"] = host_steps(self._steps, sharded)
            data, masks = tuple(b.data for b in batches), tuple(b.mask for b in batches)
            self._state, self._acc = self._group_fns["host"](self._state, self._acc, data, masks)
        self.throttle(self._acc)

    def flush(self) -> None:
        """Applies the gradient accumulated so far (an epoch ending between updates)."""
        self._state = self._flush(self._state)

    def fetch_metrics(self) -> TrainMetrics:
        """The train accumulator on the host (a sync); raises `NonFiniteLossError`
        when a step since the last reset had a non-finite loss."""
        acc = self.fetch(self._acc)
        bad = int(acc.first_nonfinite)  # the device's number of the batch
        if bad and self.stop_on_nonfinite_loss:
            step, batch = self.progress.where(bad)
            raise NonFiniteLossError(
                f"the loss is not finite at step {step} (epoch "
                f"{self.progress.current_epoch}, batch {batch}); "
                "training stopped and no checkpoint of it was saved. Lower the learning rate, "
                "clip gradients or check that batch; Trainer(stop_on_nonfinite_loss=False) "
                "trains on regardless"
            )
        return acc

    def snapshot(self) -> tuple[TrainState, TrainMetrics]:
        """A copy, on the devices, of the train state and the accumulators,
        which later steps leave valid (`restore` puts it back)."""
        return jax.tree.map(lambda x: x.copy(), (self.live_state(), self._acc))

    def restore(self, snapshot: tuple[TrainState, TrainMetrics]) -> None:
        """Puts a `snapshot` back (a copy of it: it stays valid for another)."""
        self.drain()
        self._state, self._acc = jax.tree.map(lambda x: x.copy(), snapshot)

    def reset_interval(self, acc: TrainMetrics) -> None:
        """Starts the next logging interval (``acc``: the fetched accumulator)."""
        assert self._acc is not None and self._acc0 is not None
        self._acc = self._acc.replace(metrics=self._acc0.metrics)

    def reset_epoch(self) -> None:
        """Starts a new epoch's accumulators (intervals never span two epochs)."""
        self._acc = self._acc0

    def fetch(self, tree: Any) -> Any:
        return jax.device_get(self.strategy.unreplicate(tree))

    # ------------------------------------------------------------ in flight
    def throttle(self, token: Any) -> None:
        """Bounds the steps in flight by waiting on the oldest one's output."""
        self._in_flight.append(token)
        if len(self._in_flight) > self.strategy.max_in_flight:
            jax.block_until_ready(self._in_flight.popleft())

    def drain(self) -> None:
        """Waits for every step in flight."""
        while self._in_flight:
            jax.block_until_ready(self._in_flight.popleft())

    # ----------------------------------------------------------- evaluation
    def eval_variables(
        self,
        module: JaxModule,
        first: DeviceBatch,
        checkpoint: str | None,
        swaps: list[Callable[[TrainState], Any]],
    ) -> tuple[Any, bool]:
        """The placed variables an evaluation of ``module`` uses, and whether
        they are fresh (neither trained nor loaded).

        A ``checkpoint``'s variables (which the module then keeps); else, while
        ``module`` is the one this program trains, the state's (or those a
        callback swaps in: EMA); else the module's own, or freshly initialised.
        """
        if checkpoint is not None:
            expected = self.init_variables(module, first, abstract=True)
            module.variables = restore_variables(checkpoint, expected)
            if self.fit_module is module:  # its variables no longer are the fit's state
                self.fit_module = None
            layout = self._variables_layout(module, first)
            return self.strategy.place_variables(module.variables, layout), False
        if self._state is not None and self.fit_module is module:
            variables = self._state.variables
            for swap in swaps:
                variables = swap(self._state)
            return variables, False
        fresh = module.variables is None
        variables = self.init_variables(module, first)
        return self.strategy.place_variables(
            variables, self._variables_layout(module, first)
        ), fresh

    def init_variables(
        self, module: JaxModule, first: DeviceBatch, *, abstract: bool = False
    ) -> Any:
        """The module's variables (its own, else initialised) as one program;
        with ``abstract`` only their shapes."""
        if abstract:
            args = (self.seed, module.variables, self._example(first))
            return jax.eval_shape(self._init_function(module, None, boxed=False), *args)
        init, args = self._init_program(module, None, first)
        return self._compile_once(init.trace(*args).lower())(*args)

    def forget(self, module: JaxModule) -> None:
        """``module``'s variables were replaced: they no longer are the fit's state."""
        if self.fit_module is module:
            self.fit_module = None

    def eval_step(
        self,
        module: JaxModule,
        hook: str,
        first: DeviceBatch,
        variables: Any,
        dataloader_idx: int | None = None,
    ) -> tuple[Callable[..., Any], Metrics, Options]:
        """The compiled evaluation of ``hook``, its empty accumulator and the
        options of what it logs (compiled once per module, hook, shapes and,
        with several loaders, loader index)."""
        rows = first.host.mask.shape[0] // self.strategy.num_local_shards
        example = shard_shapes(first.host.data, rows)
        shapes = (jax.tree.structure(example), tuple(jax.tree.leaves(example)))
        key = ("eval", hook, module, shapes, dataloader_idx)
        if key not in self._eval_fns:
            compiled = self.strategy.compile(
                build_eval_step(module, hook, self.options.precision, dataloader_idx),
                sharded_args=(False, False, True, True),
                sharded_out=False,
            )
            local = jax.eval_shape(self.strategy.unreplicate, variables)
            zeros, options = zero_eval_metrics(module, hook, local, example, dataloader_idx)
            self._eval_fns[key] = (compiled, self.strategy.replicate(zeros), options)
        step = self._eval_fns[key]
        call = (variables, step[1], first.data, first.mask)
        self._last_eval = (step[0], jax.tree.map(_abstract, call))
        return step

    def eval_cost(self) -> StepCost | None:
        """XLA's count of the last evaluation's step on one device (the compile
        its calls used: found in JAX's cache, not compiled again); ``None``
        before any evaluation, under pmap and in multi-process runs."""
        if self._last_eval is None or jax.process_count() > 1:
            return None
        compiled, call = self._last_eval
        return cost_of(compiled, *call)

    def predict_step(self, module: JaxModule) -> Callable[..., Any]:
        """The compiled ``predict_step`` of ``module`` (compiled once)."""
        key = ("predict", module)
        if key not in self._eval_fns:
            self._eval_fns[key] = self.strategy.compile(
                build_predict_step(module, self.options.precision),
                sharded_args=(False, True, True),
                sharded_out=True,
            )
        return self._eval_fns[key]


def _put_like(leaf: jax.Array, value: Any) -> jax.Array:
    """Host ``value`` (broadcast to ``leaf``'s shape) placed as ``leaf`` is."""
    host = np.broadcast_to(np.asarray(value, leaf.dtype), leaf.shape)
    return jax.make_array_from_callback(leaf.shape, leaf.sharding, lambda i: host[i])


def _abstract(x: Any) -> Any:
    """A placed array's shape, dtype and sharding: what its compile depends on."""
    if not isinstance(x, jax.Array):
        return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=x.weak_type)
