"""The evaluation and prediction programs, and the variables they run on.

`EvalPrograms` compiles an evaluation hook (``validation_step``,
``test_step``, an ``eval_step``) or ``predict_step`` once per module, hook and
shapes, keeps XLA's count of the last evaluation, and chooses the variables an
evaluation uses: a checkpoint's, the running fit's (or what a callback swaps
in: EMA), or the module's own. The train program (`Program`) knows none of it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

from jaxlightning.data import DeviceBatch
from jaxlightning.data.resident import ResidentBatch
from jaxlightning.io.checkpoint import restore_variables
from jaxlightning.module import JaxModule
from jaxlightning.programs.compiled import batch_args, shard_shapes
from jaxlightning.programs.multistep import resident_eval
from jaxlightning.programs.program import Program
from jaxlightning.training.state import TrainState
from jaxlightning.training.step import (
    Metrics,
    Options,
    build_eval_step,
    build_predict_step,
    zero_eval_metrics,
)
from jaxlightning.xla.cost import StepCost, cost_of


class EvalPrograms:
    """Compiles and caches a Trainer's evaluation and prediction programs.

    Args:
        program: the train program: its compiled steps build a module's
            initial variables, and its held state is what an evaluation of
            the module it fits uses.
    """

    def __init__(self, program: Program) -> None:
        self.program = program
        self.strategy = program.strategy
        self._fns: dict[Any, Any] = {}
        self._calls: dict[Any, str | None] = {}  # the Trainer call each step was traced in
        # The last evaluation's step and the shapes it was called with.
        self._last: tuple[Any, tuple[Any, ...]] | None = None

    def variables(
        self,
        module: JaxModule,
        first: DeviceBatch,
        checkpoint: str | None,
        swaps: list[Callable[[TrainState], Any]],
    ) -> tuple[Any, bool]:
        """The placed variables an evaluation of ``module`` uses, and whether
        they are fresh (neither trained nor loaded).

        A ``checkpoint``'s variables (which the module then keeps); else, while
        ``module`` is the one the train program fits, the state's (or those a
        callback swaps in: EMA); else the module's own, or freshly initialised.
        """
        steps, program = self.program.steps, self.program
        if checkpoint is not None:
            expected = steps.init_variables(module, first, abstract=True)
            module.variables = restore_variables(checkpoint, expected)
            program.forget(module)  # its variables no longer are the fit's state
            layout = steps.variables_layout(module, first)
            return self.strategy.place_variables(module.variables, layout), False
        if program.held.started and program.fit_module is module:
            state = program.held.live_state()
            variables = state.variables
            for swap in swaps:
                variables = swap(state)
            return variables, False
        fresh = module.variables is None
        variables = steps.init_variables(module, first)
        layout = steps.variables_layout(module, first)
        return self.strategy.place_variables(variables, layout), fresh

    def eval_step(
        self,
        module: JaxModule,
        hook: str,
        first: DeviceBatch,
        variables: Any,
        dataloader_idx: int | None = None,
        call: str | None = None,
    ) -> tuple[Callable[..., Any], Metrics, Options]:
        """The compiled evaluation of ``hook``, its empty accumulator and the
        options of what it logs (compiled once per module, hook, shapes and,
        with several loaders, loader index). It takes ``(variables, acc,
        *batch_args(batch))``: a resident dataset's batch is gathered in its
        dispatch (`multistep.resident_eval`).

        A step compiled in another Trainer ``call`` (``"fit"``'s validation,
        then ``"validate"``) is reused only if the hook, traced abstractly now,
        logs the same names (one built from ``self.trainer.stage`` does not)."""
        example = shard_shapes(first.host.data, self.program.steps.shard_rows(first))
        shapes = (jax.tree.structure(example), tuple(jax.tree.leaves(example)))
        resident = isinstance(first, ResidentBatch)
        key = ("eval", hook, module, shapes, dataloader_idx, resident)
        local = functools.partial(jax.eval_shape, self.strategy.unreplicate, variables)
        if key in self._fns and self._calls.get(key) != call:
            _, options = zero_eval_metrics(module, hook, local(), example, dataloader_idx)
            if options != self._fns[key][2]:  # names that depend on the call
                del self._fns[key]
            self._calls[key] = call
        if key not in self._fns:
            precision = self.program.options.precision
            compiled = self.strategy.compile(
                build_eval_step(module, hook, precision, dataloader_idx),
                sharded_args=(False, False, True, True),
                sharded_out=False,
            )
            if resident:
                compiled = resident_eval(compiled, *self.strategy.batch_placement)  # type: ignore[misc]
            zeros, options = zero_eval_metrics(module, hook, local(), example, dataloader_idx)
            self._fns[key] = (compiled, self.strategy.replicate(zeros), options)
            self._calls[key] = call
        step = self._fns[key]
        call = (variables, step[1], *batch_args(first))
        self._last = (step[0], jax.tree.map(_abstract, call))
        return step

    def predict_step(self, module: JaxModule) -> Callable[..., Any]:
        """The compiled ``predict_step`` of ``module`` (compiled once)."""
        key = ("predict", module)
        if key not in self._fns:
            self._fns[key] = self.strategy.compile(
                build_predict_step(module, self.program.options.precision),
                sharded_args=(False, True, True),
                sharded_out=True,
            )
        return self._fns[key]

    def forget(self) -> None:
        """A new fit's state: the cached evaluations compile again."""
        self._fns.clear()
        self._calls.clear()

    def eval_cost(self) -> StepCost | None:
        """XLA's count of the last evaluation's step on one device (the compile
        its calls used: found in JAX's cache, not compiled again); ``None``
        before any evaluation, under pmap and in multi-process runs."""
        if self._last is None or jax.process_count() > 1:
            return None
        compiled, call = self._last
        return cost_of(compiled, *call)


def _abstract(x: Any) -> Any:
    """A placed array's shape, dtype and sharding: what its compile depends on."""
    if not isinstance(x, jax.Array):
        return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=x.weak_type)
