"""Start-up of a fit: the initial train state and the compiled train step.

Part of the Trainer, kept in its own file so that the training loop reads on
its own. Start-up order: XLA compiles the initial state on a worker thread
while the main thread traces the train step, which then compiles in turn while
the main thread sets up the rest of the run. Every thread started here is
registered with the caller's ``threads`` stack, which joins it on every way
out (one still running in XLA when the process exits aborts it).
"""

from __future__ import annotations

import contextlib
from typing import Any

import flax.linen as nn
import jax
import optax

from jaxlightning.checkpoint import restore
from jaxlightning.compiling import (
    Background,
    Precompiled,
    compile_with_options,
    in_background,
    join_quietly,
)
from jaxlightning.data import DeviceBatch
from jaxlightning.evaluation import shard_shapes
from jaxlightning.module import JaxModule
from jaxlightning.nnx_support import NnxGraph
from jaxlightning.precision import for_storage
from jaxlightning.state import create_train_state
from jaxlightning.step import (
    TrainMetrics,
    build_flush,
    build_train_parts,
    build_train_step,
    checked_setup,
    gradient_view,
    is_manual,
    zero_train_metrics,
)

# For programs that run once (the initial state): XLA's optimisation level 1
# and, on CPU, its older fusion emitters compile the random initialisers of an
# MNIST-sized MLP in 0.3 s instead of 1.1 s, with bitwise the values of the
# default compile (level 0 is faster still, but rounds differently: 1 ulp).
# Both are private XLA options: `compile_with_options` drops any the backend
# rejects (JAX 0.11 removed the fusion-emitter one).
_RUN_ONCE_OPTIONS = {"xla_backend_optimization_level": 1}
_RUN_ONCE_CPU_OPTIONS = {**_RUN_ONCE_OPTIONS, "xla_cpu_use_fusion_emitters": False}


class StartupMixin:
    """Builds (or restores) the train state and compiles the train step."""

    def _example(self, first: DeviceBatch) -> Any:
        """One device's share of the first batch, for ``setup``."""
        rows = first.host.mask.shape[0] // self.strategy.num_local_shards
        return jax.tree.map(lambda x: x[:rows], first.host.data)

    def _init_state(
        self,
        module: JaxModule,
        tx: optax.GradientTransformation | None,
        first: DeviceBatch,
        *,
        abstract: bool = False,
        boxed: bool = False,
    ) -> Any:
        """The initial train state (or, without ``tx``, just the variables).

        One compiled function: building the state op by op would compile each
        initialiser separately, which dominates the start-up of small models.
        The module's own ``variables`` (from an earlier fit) take precedence.
        With ``abstract``, only the shapes, without compiling or running (with
        ``boxed`` too, flax partitioning annotations kept).
        A strategy that shards the state has it built sharded, never whole on one device.
        """
        if abstract:
            init, args = self._init_program(module, tx, first, plan=False, boxed=boxed)
            return jax.eval_shape(init, *args)
        init, args = self._init_program(module, tx, first)
        return self._compile_once(init.trace(*args).lower())(*args)

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

    def _init_program(
        self,
        module: JaxModule,
        tx: optax.GradientTransformation | None,
        first: DeviceBatch,
        *,
        plan: bool = True,
        boxed: bool = False,
    ) -> tuple[Any, tuple[Any, ...]]:
        """The jitted initialisation and its arguments. With ``plan``, a strategy
        that shards the state lays it out first (from its annotated shapes), and
        the program builds it with that layout."""
        model = module._nnx_model()
        if model is not None and module._nnx is None:  # split on the host, once
            module._nnx = NnxGraph(model)

        def jl_init(seed, variables, example):
            init_rng, train_rng = jax.random.split(jax.random.PRNGKey(seed))
            if variables is None:
                variables = checked_setup(module, init_rng, example)
            variables = for_storage(variables, self.step_options.precision)
            if tx is None:
                out = variables
            else:
                accumulate = self.step_options.accumulate_grad_batches
                out = create_train_state(variables, tx, train_rng, accumulate)
            # Partitioning annotations only say where arrays go: the state holds
            # plain arrays, laid out by the strategy.
            return out if boxed else nn.meta.unbox(out)

        args = (self.seed, module.variables, self._example(first))
        if not (plan and self.strategy.shards_state):
            return jax.jit(jl_init), args
        annotated = jax.eval_shape(
            self._init_program(module, tx, first, plan=False, boxed=True)[0], *args
        )
        if tx is None:
            shardings = self.strategy.variables_shardings(annotated)
        else:
            shardings = self.strategy.plan(annotated)
        return jax.jit(jl_init, out_shardings=shardings), args

    def _place_variables(self, module: JaxModule, first: DeviceBatch, variables: Any) -> Any:
        """Host (or other) ``variables`` placed as the evaluation steps expect."""
        if not self.strategy.shards_state:
            return self.strategy.replicate(variables)
        annotated = self._init_state(module, None, first, abstract=True, boxed=True)
        return jax.device_put(variables, self.strategy.variables_shardings(annotated))

    def _first_batch(self, loader: Any) -> DeviceBatch:
        """The first batch of epoch 0, for shapes (a resumed epoch may have none left)."""
        with self._epoch_batches(loader, 0, 0) as batches:
            return batches.first

    def _start_run(
        self,
        module: JaxModule,
        tx: optax.GradientTransformation,
        example: DeviceBatch,
        resume: str | None,
        meta: dict[str, Any] | None,
        threads: contextlib.ExitStack,
    ) -> TrainMetrics:
        """Builds (or restores) the state and compiles the train step; returns the
        empty metric accumulator, replicated.

        Start-up order: XLA compiles the initial state on a worker thread while
        this one traces the train step, which then compiles in turn while this
        one sets up the rest of the run.
        """
        shapes, pending_state = self._start_init_state(module, tx, example)
        threads.callback(join_quietly, pending_state)
        rows = example.host.mask.shape[0] // self.strategy.num_local_shards
        acc0, self._train_options = zero_train_metrics(
            module, shapes, shard_shapes(example.host.data, rows), tx, self.step_options
        )
        if is_manual(module):
            train_step = self.strategy.compile_manual(
                build_train_step(module, tx, self.step_options)
            )
        else:
            parts = build_train_parts(module, tx, self.step_options, self.strategy.reduce_grads())
            train_step = self.strategy.compile_train(parts, gradient_view)
        train_step = self.strategy.precompile(train_step, shapes, acc0, example.data, example.mask)
        if isinstance(train_step, Precompiled):
            threads.callback(train_step.join)
        self._train_step = train_step
        self._flush = None
        if self.step_options.accumulate_grad_batches > 1:
            self._flush = self.strategy.compile_global(build_flush(tx, self.step_options))
        state = pending_state.result()
        acc = acc0
        if resume is not None:
            restored = restore(resume, {"state": state, "acc": acc0})
            state, acc = restored["state"], restored["acc"]
            self._load_states(module, meta or {})
        self._micro = int(getattr(state, "micro", 0))  # micro-batches since the last update
        self._state = self.strategy.place_state(state)
        self._acc = self.strategy.replicate(acc)
        self._eval_fns.clear()
        self._fit_module = module
        self.should_stop = self._time_up = False
        self._stop_signal = 0
        return self.strategy.replicate(acc0)
