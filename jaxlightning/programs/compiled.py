"""The compiled training programs of a run: initialisation, the train step and
its groups, the accumulation flush, BatchNorm statistics, and what XLA says
each costs and needs in memory (evaluation and prediction: `evaluation.py`).

`CompiledSteps` builds and caches programs; it holds no train state (that is
`HeldState`'s). Initial states compile with settings that favour compile time,
since they run once.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxlightning.adapters.lora import adapters_alone, with_base
from jaxlightning.data import DeviceBatch
from jaxlightning.data.convert import Rows
from jaxlightning.data.resident import ResidentBatch
from jaxlightning.module import JaxModule
from jaxlightning.programs.multistep import host_steps, resident_step, resident_steps
from jaxlightning.strategies import FSDPStrategy, ShardMapStrategy, Strategy
from jaxlightning.training import contract
from jaxlightning.training.precision import for_storage
from jaxlightning.training.state import create_train_state
from jaxlightning.training.step import (
    Options,
    StepOptions,
    build_flush,
    build_statistics_step,
    build_train_parts,
    build_train_step,
    checked_setup,
    is_manual,
    zero_train_metrics,
)
from jaxlightning.xla import memory
from jaxlightning.xla.compiling import Background, compile_with_options, in_background
from jaxlightning.xla.cost import StepCost, cost_of

# For programs that run once (the initial state): XLA's optimisation level 1
# and, on CPU, its older fusion emitters compile the random initialisers of an
# MNIST-sized MLP in 0.3 s instead of 1.1 s, with bitwise the values of the
# default compile (level 0 is faster still, but rounds differently: 1 ulp).
# Both are private XLA options: `compile_with_options` drops any the backend
# rejects (JAX 0.11 removed the fusion-emitter one).
_RUN_ONCE_OPTIONS = {"xla_backend_optimization_level": 1}
_RUN_ONCE_CPU_OPTIONS = {**_RUN_ONCE_OPTIONS, "xla_cpu_use_fusion_emitters": False}


def shard_shapes(tree: Any, rows: int) -> Any:
    """Abstract shapes of one device's shard of a host batch, in the dtypes JAX
    will give it (int64 labels become int32 unless x64 is enabled)."""

    def shard(x: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((rows, *x.shape[1:]), jax.dtypes.canonicalize_dtype(x.dtype))

    return jax.tree.map(shard, tree)


class CompiledSteps:
    """Compiles (once per module, hook and shapes) the programs a run calls.

    Args:
        strategy: compiles the per-device functions and lays out their outputs.
        options: what the train step does besides the update.
        seed: seeds initialisation.
    """

    def __init__(self, strategy: Strategy, options: StepOptions, *, seed: int) -> None:
        self.strategy = strategy
        self.options = options
        self.seed = seed
        self._groups: dict[str, Any] = {}

    def shard_rows(self, batch: DeviceBatch) -> int:
        return batch.host.mask.shape[0] // self.strategy.num_local_shards

    # ------------------------------------------------------- initial states
    def init_state(
        self, module: JaxModule, tx: optax.GradientTransformation, first: DeviceBatch
    ) -> tuple[Any, Background]:
        """The initial train state's shapes now, and the state itself compiled
        and computed on a worker thread while the caller traces the train step.
        The caller must wait for the future on every path (`join_quietly`)."""
        init, args = self._init_program(module, tx, first)
        traced = init.trace(*args)
        lowered = traced.lower()
        return traced.out_info, in_background(lambda: self._compile_once(lowered)(*args))

    def init_variables(
        self, module: JaxModule, first: DeviceBatch, *, abstract: bool = False
    ) -> Any:
        """The module's variables (its own, else initialised) as one program;
        with ``abstract`` only their shapes."""
        self._start_from_pretrained(module, first)
        if abstract:
            args = (self.seed, module.variables, self._example(first))
            return jax.eval_shape(self._init_function(module, None, boxed=False), *args)
        init, args = self._init_program(module, None, first)
        return self._compile_once(init.trace(*args).lower())(*args)

    def variables_layout(self, module: JaxModule, first: DeviceBatch) -> Callable[[], Any]:
        """The annotated shapes of ``module``'s variables, on demand."""
        self._start_from_pretrained(module, first)
        args = (self.seed, module.variables, self._example(first))
        return lambda: jax.eval_shape(self._init_function(module, None, boxed=True), *args)

    def _start_from_pretrained(self, module: JaxModule, first: DeviceBatch) -> None:
        """Sets ``module.variables`` from its ``pretrained`` hook (once: not
        where it has variables, unless they are only LoRA adapters, which join
        the pretrained ones), given the tree ``setup`` would build with the
        strategy's layout, so that each process reads only its devices' blocks."""
        adapters = module.variables
        if not contract.overrides(module, "pretrained"):
            return
        if adapters is not None and not adapters_alone(adapters):
            return
        args = (self.seed, None, self._example(first))
        annotated = functools.partial(
            jax.eval_shape, self._init_function(module, None, boxed=True, adapt=False), *args
        )
        abstract = nn.meta.unbox(annotated())
        shardings = self.strategy.plan_variables(annotated)
        if shardings is not None:
            abstract = jax.tree.map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                abstract,
                shardings,
            )
        with contract.in_hook(module, "pretrained"):
            variables = module.pretrained(abstract)
        if adapters is not None:  # an adapter checkpoint's, beside the frozen weights
            variables = {**variables, "params": with_base(variables["params"], adapters["params"])}
        module.variables = variables

    def _compile_once(self, lowered: Any) -> Any:
        # Runs once: compiling it quickly matters more than running it quickly.
        options = _RUN_ONCE_CPU_OPTIONS if self.strategy.on_cpu else _RUN_ONCE_OPTIONS
        return compile_with_options(lowered, options)

    def _example(self, first: DeviceBatch) -> Any:
        """One device's share of the first batch, for ``setup``."""
        rows = self.shard_rows(first)
        return jax.tree.map(lambda x: x[:rows], first.host.data)

    def _init_function(
        self,
        module: JaxModule,
        tx: optax.GradientTransformation | None,
        *,
        boxed: bool,
        adapt: bool = True,
    ) -> Callable[..., Any]:
        """``(seed, variables, example) -> state`` (without ``tx``, just the
        variables); with ``boxed``, flax partitioning annotations kept; with
        ``adapt``, the module's LoRA adapters added."""
        contract.prepare_nnx(module)
        precision, accumulate = self.options.precision, self.options.accumulate_grad_batches

        def jl_init(seed, variables, example):
            init_rng, train_rng = jax.random.split(jax.random.PRNGKey(seed))
            if variables is None:
                variables = checked_setup(module, init_rng, example)
            variables = for_storage(variables, precision)
            if module.lora is not None and adapt:
                variables = module.lora.adapt(variables, jax.random.fold_in(init_rng, 1))
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
        self._start_from_pretrained(module, first)
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

    # ------------------------------------------------------------- training
    def train_step(self, module: JaxModule, tx: optax.GradientTransformation) -> Any:
        """``module``'s train step, compiled by the strategy (not yet for any
        shapes); the groups of several batches are built from it."""
        step = self._compile_train(module, tx)
        self._groups = {"step": step}
        return step

    def _compile_train(self, module: JaxModule, tx: optax.GradientTransformation) -> Any:
        if is_manual(module):
            return self.strategy.compile_manual(build_train_step(module, tx, self.options))
        parts = build_train_parts(
            module, tx, self.options, self.strategy.reduce_grads(), self.strategy.gathering()
        )
        return self.strategy.compile_train(parts)

    def flush(self, tx: optax.GradientTransformation) -> Any:
        """The program that applies a partial accumulation window."""
        return self.strategy.compile_global(build_flush(tx, self.options))

    def group(self, resident: bool, state: Any) -> Any:
        """The program that runs the train step over a group of batches: gathered
        from the resident dataset inside it, or handed over as host batches. It
        is built at the fit's first group, for the layout of the held ``state``
        (which it keeps)."""
        kind = "resident" if resident else "host"
        if kind not in self._groups:
            step = self._groups["step"]
            layout = jax.tree.map(lambda x: x.sharding, state)
            if resident:
                replicated, sharded = self.strategy.batch_placement  # type: ignore[misc]
                self._groups[kind] = resident_steps(step, replicated, sharded, layout)
            else:  # a ShardMapStrategy's (the only one that groups steps)
                sharding = self.strategy.batch_sharding  # type: ignore[attr-defined]
                self._groups[kind] = host_steps(step, sharding, layout)
        return self._groups[kind]

    def resident_step(self) -> Any:
        """The train step on one batch of a resident dataset, gathering its rows
        in the same dispatch (`multistep.resident_step`)."""
        if "resident_step" not in self._groups:
            replicated, sharded = self.strategy.batch_placement  # type: ignore[misc]
            self._groups["resident_step"] = resident_step(self._groups["step"], replicated, sharded)
        return self._groups["resident_step"]

    def statistics_step(self, module: JaxModule) -> Any:
        """One batch's BatchNorm statistics under given parameters, summed."""
        return self.strategy.compile(
            build_statistics_step(module, self.seed, self.options.precision),
            sharded_args=(False, False, True, True),
            sharded_out=False,
        )

    def zero_train_metrics(
        self, module: JaxModule, state: Any, example: DeviceBatch, tx: optax.GradientTransformation
    ) -> tuple[Any, Options]:
        rows = self.shard_rows(example)
        return zero_train_metrics(
            module, state, shard_shapes(example.host.data, rows), tx, self.options
        )

    def cost_at(
        self, module: JaxModule, tx: optax.GradientTransformation, example: DeviceBatch, rows: int
    ) -> StepCost | None:
        """XLA's count of ``module``'s train step for a global batch of ``rows``
        rows (a multiple of the shards), like ``example``'s otherwise: compiled
        from shapes alone, never run, no state built."""
        return self._state_and_cost(module, tx, example, rows)[1]

    def _state_and_cost(
        self, module: JaxModule, tx: optax.GradientTransformation, example: DeviceBatch, rows: int
    ) -> tuple[Any, StepCost | None]:
        """The state's shapes (with their layout) and `cost_at`."""
        init, args = self._init_program(module, tx, example)
        state = init.trace(*args).out_info
        per_shard = rows // self.strategy.num_local_shards
        data, mask = batch_shapes(example, rows)
        acc0, _ = zero_train_metrics(
            module, state, shard_shapes(example.host.data, per_shard), tx, self.options
        )
        acc0 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), acc0)
        return state, cost_of(self._compile_train(module, tx), state, acc0, data, mask)

    def budget_at(
        self,
        module: JaxModule,
        tx: optax.GradientTransformation,
        example: DeviceBatch,
        limit: int | None,
    ) -> memory.MemoryBudget | None:
        """`memory_budget` of ``module``'s train step on batches like
        ``example``, compiled from shapes (no state built, nothing run)."""
        state, cost = self._state_and_cost(module, tx, example, example.host.mask.shape[0])
        if cost is None:
            return None
        return self.memory_budget(module, tx, example, cost, state, limit)

    def memory_budget(
        self,
        module: JaxModule,
        tx: optax.GradientTransformation,
        example: DeviceBatch,
        cost: StepCost,
        state: Any,
        limit: int | None,
    ) -> memory.MemoryBudget:
        """The budget of the train step whose XLA count is ``cost`` (called on
        ``state``'s shapes and batches like ``example``) against ``limit``,
        with the copy of a dataset kept on the devices beside it; when it does
        not fit, with the fixes XLA finds that do (compiled from shapes at a
        smaller batch and more accumulation; nothing runs), and the batches
        from the host where the dataset's copy is what does not fit."""
        rows, shards = example.host.mask.shape[0], self.strategy.num_local_shards
        batch = shard_shapes(example.host.data, rows // shards)
        resident = resident_bytes(example)
        found = memory.budget(cost, state, batch, limit, resident)
        if found.fits:
            return found

        def peak_at(rows: int, accumulate: int, strategy: Strategy = self.strategy) -> int | None:
            options = dataclasses.replace(self.options, accumulate_grad_batches=accumulate)
            other = CompiledSteps(strategy, options, seed=self.seed)
            cost = other.cost_at(module, tx, example, rows)
            return None if cost is None else cost.peak_bytes + resident

        accumulate = self.options.accumulate_grad_batches
        batch = memory.smaller_batch(rows, shards, accumulate, peak_at, found.limit)
        candidates = [batch] if batch is not None else []
        if resident:
            candidates.append(("data_on_device=False", lambda: found.peak))
        if type(self.strategy) is ShardMapStrategy and self.strategy.num_devices > 1:
            fsdp = FSDPStrategy()
            fsdp.setup(self.strategy.devices)
            candidates.append(("strategy='fsdp'", lambda: peak_at(rows, accumulate, fsdp)))
        return memory.with_fixes(found, candidates)


def zeros_like_local(strategy: Strategy, tree: Any) -> Any:
    """Host zeros shaped as one device's copy of the placed ``tree``."""
    local = jax.eval_shape(strategy.unreplicate, tree)
    return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), local)


def resident_bytes(example: Any) -> int:
    """Bytes of the dataset's copy a device keeps beside the train step when
    ``example`` is a resident dataset's batch (0 for one from the host)."""
    if isinstance(example, ResidentBatch):
        return memory.device_bytes(example.dataset.data)
    return 0


def batch_shapes(example: Any, rows: int | None = None) -> tuple[Any, Rows]:
    """Abstract shapes of a global batch like ``example``'s (of ``rows`` rows,
    default its own) and of its `Rows`: a step compiles for it from them."""
    rows = example.host.mask.shape[0] if rows is None else rows
    data = shard_shapes(example.host.data, rows)
    return data, Rows(jax.ShapeDtypeStruct((rows,), bool), jax.ShapeDtypeStruct((rows,), jnp.int32))


def batch_args(batch: Any) -> tuple[Any, ...]:
    """``batch`` as a step takes it: its data and mask, or for a resident
    dataset's batch what the step gathers it from (`ResidentBatch.gathering`)."""
    if isinstance(batch, ResidentBatch):
        return batch.gathering
    return batch.data, batch.mask
