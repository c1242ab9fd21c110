"""The program: a fit's compiled steps applied to its held state.

The loops never touch state arrays: they hand the program device batches and
ask its `HeldState` (``program.held``) for fetched metrics and checkpoint
arrays. Evaluation and prediction programs are `EvalPrograms`' (evaluation.py).

Start-up order of a fit: XLA compiles the initial state on a worker thread
while the main thread traces the train step, which then compiles in turn while
the main thread sets up the rest of the run. Every thread started here is
registered with the caller's ``threads`` stack, which joins it on every way
out (one still running in XLA when the process exits aborts it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np
import optax

from jaxlightning.adapters.lora import adapters_only, with_base
from jaxlightning.data import DeviceBatch
from jaxlightning.data.resident import ResidentBatch
from jaxlightning.io.checkpoint import restore
from jaxlightning.metrics.logged import host_value
from jaxlightning.module import JaxModule
from jaxlightning.programs.compiled import CompiledSteps, batch_shapes, zeros_like_local
from jaxlightning.programs.held_state import HeldState
from jaxlightning.progress import Progress
from jaxlightning.strategies import Strategy
from jaxlightning.training.step import Options, StepOptions, kept_loss
from jaxlightning.xla import memory
from jaxlightning.xla.compiling import Precompiled, join_quietly
from jaxlightning.xla.cost import StepCost, step_cost


class Program:
    """A fit's train step (and its groups, its accumulation flush) over the
    held state; started in three steps: `compile`, `check_memory`, `hold`.

    Args:
        strategy: lays out the state and compiles the per-device functions.
        options: what the train step does besides the update (precision,
            clipping, accumulation).
        seed: seeds initialisation and every per-device, per-step key.
        progress: the run's position (named in non-finite loss errors).
        stop_on_nonfinite_loss: raise `NonFiniteLossError` at the next report.
        device_memory: bytes a device holds (``None``: what it reports, where
            it does); a train step that needs more stops the fit before its
            first step (`memory.MemoryBudgetError`).
    """

    def __init__(
        self,
        strategy: Strategy,
        options: StepOptions,
        *,
        seed: int,
        progress: Progress,
        stop_on_nonfinite_loss: bool = True,
        device_memory: int | None = None,
    ) -> None:
        self.strategy = strategy
        self.options = options
        self.seed = seed
        self.progress = progress
        self.group_size = 1  # batches `train_group` runs in one dispatch (set per fit)
        self.device_memory = device_memory
        self.held = HeldState(strategy, progress, stop_on_nonfinite_loss=stop_on_nonfinite_loss)
        self.steps = CompiledSteps(strategy, options, seed=seed)
        self.train_options: Options = {}
        self.fit_module: JaxModule | None = None  # whose variables the state holds
        self._train_step: Any = None
        self._resident_step: Any = None
        self._flush: Any = None
        self._pending: Any = None  # (state shapes, the state being built) after `compile`
        self._acc0: Any = None

    def compile(
        self,
        module: JaxModule,
        tx: optax.GradientTransformation,
        example: DeviceBatch,
        threads: contextlib.ExitStack,
    ) -> None:
        """Starts building the state and compiling the train step (on worker
        threads, joined when ``threads`` closes); `hold` then waits for the state."""
        shapes, pending_state = self.steps.init_state(module, tx, example)
        threads.callback(join_quietly, pending_state)
        self._pending = (shapes, pending_state)
        acc0, self.train_options = self.steps.zero_train_metrics(module, shapes, example, tx)
        # The step that will run compiles ahead: for a resident dataset's batches
        # the one that gathers them; the plain step too where the memory check
        # reads it (a device whose memory is known: an accelerator), from the
        # batch's shapes (no gather needed to count it).
        self._train_step = self.steps.train_step(module, tx)
        self._resident_step = None
        resident = isinstance(example, ResidentBatch)
        if resident:
            self._resident_step = self.strategy.precompile(
                self.steps.resident_step(), shapes, acc0, *example.gathering
            )
        if not resident or self._memory_limit() is not None:
            batch = batch_shapes(example) if resident else (example.data, example.mask)
            self._train_step = self.strategy.precompile(self._train_step, shapes, acc0, *batch)
        for step in (self._train_step, self._resident_step):
            if isinstance(step, Precompiled):
                threads.callback(step.join)
        self._flush = None
        if self.options.accumulate_grad_batches > 1:
            self._flush = self.steps.flush(tx)
        self._acc0 = acc0

    def hold(self, module: JaxModule, resume: str | None) -> None:
        """Holds the built state (or the one restored from ``resume``) for training."""
        state, acc0 = self._pending[1].result(), self._acc0
        self._pending = self._acc0 = None
        acc = acc0
        lora = module.lora is not None
        if resume is not None:
            saved = state.replace(params=adapters_only(state.params)) if lora else state
            restored = restore(resume, {"state": saved, "acc": acc0})
            built, state, acc = state, restored["state"], restored["acc"]
            if lora:  # the frozen weights as the module's `pretrained` gave them
                state = state.replace(params=with_base(built.params, state.params))
        self.progress.micro = int(getattr(state, "micro", 0))  # since the last update
        self.held.hold(state, acc, acc0)
        self.held.adapters_only = lora
        self.fit_module = module

    def check_memory(
        self, module: JaxModule, tx: optax.GradientTransformation, example: DeviceBatch
    ) -> None:
        """The pre-flight check, between `compile` and `hold`: stops the fit,
        before any step, when the compiled train step needs more memory than a
        device holds (only where that is known: nothing waits otherwise). The
        step is counted as the Tuner counts it, on a batch handed to it, with a
        resident dataset's copy beside it."""
        state = self._pending[0]
        limit = self._memory_limit()
        cost = None if limit is None else _cost_of(self._train_step)
        if cost is None:
            return
        found = self.steps.memory_budget(module, tx, example, cost, state, limit)
        if not found.fits:
            hint = (
                "Pass the first fix's settings"
                if found.fixes
                else "Nothing XLA was asked about fits: shard the model (strategy='fsdp'), "
                "recompute activations (nn.remat), or train in bfloat16 (precision='bf16-mixed')"
            )
            message = (
                f"{type(module).__name__}'s train step needs more memory than a device "
                f"holds; nothing was run.\n{found.table()}\n{hint}"
            )
            if found.peak <= limit:  # it is the dataset's copy that does not fit
                raise memory.DatasetDoesNotFit(message, found)
            raise memory.MemoryBudgetError(message)

    def ready(self) -> None:
        """Waits for the train step's ahead-of-time compile (errors surface at
        the first step)."""
        for step in (self._train_step, self._resident_step):
            if isinstance(step, Precompiled):
                step.join()

    def train_cost(self) -> StepCost | None:
        """XLA's count of the program a train step runs, on one device (waits
        for its compile): with the data on the devices, the one that gathers
        the step's rows, whose inputs include the dataset's copy. ``None``
        before a fit or where the strategy compiles at the first call."""
        if self._resident_step is not None:
            return _cost_of(self._resident_step)
        return _cost_of(self._train_step)

    def interval_loss(self, acc: Any) -> float | None:
        """The mean of what ``loss()`` returned over fetched ``acc``'s logging
        interval, reported or not (``None``: manual optimization, no row)."""
        metric = acc.metrics.get(kept_loss(acc.metrics))
        return None if metric is None else host_value(metric)

    def _memory_limit(self) -> int | None:
        return memory.device_limit(self.strategy.devices, self.device_memory)

    # ------------------------------------------------------------- training
    def train(self, batch: DeviceBatch) -> None:
        """Dispatches one train step (waits for an older one past the bound);
        a resident dataset's batch is gathered in the same dispatch."""
        if isinstance(batch, ResidentBatch):
            step = self._resident_step or self.steps.resident_step()
            self.held.advance(step, *batch.gathering)
        else:
            self.held.advance(self._train_step, batch.data, batch.mask)

    def train_group(self, batches: list[Any]) -> None:
        """Dispatches the train steps of ``batches`` as one program (`multistep`):
        the state ends as ``train`` of each in turn would leave it. A group
        shorter than ``group_size`` (cut by a report, a validation, an
        epoch's end) runs batch by batch instead: one group program to compile,
        not one per length; so does a group of batches of several shapes
        (shape buckets)."""
        if len(batches) < self.group_size or len(batches) == 1 or _mixed(batches):
            for batch in batches:
                self.train(batch)
            return
        resident = getattr(batches[0], "dataset", None)
        if resident is not None and all(getattr(b, "dataset", None) is resident for b in batches):
            indices = np.stack([b.indices for b in batches])
            rows = jax.tree.map(lambda *r: np.stack(r), *(b.rows for b in batches))
            program = self.steps.group(resident=True, state=self.held.live_state())
            self.held.advance(program, resident.data, indices, rows)
        else:
            data, masks = tuple(b.data for b in batches), tuple(b.mask for b in batches)
            program = self.steps.group(resident=False, state=self.held.live_state())
            self.held.advance(program, data, masks)

    def flush(self) -> None:
        """Applies the gradient accumulated so far (an epoch ending between updates)."""
        self.held.apply(self._flush)

    def recompute_batch_statistics(self, module: JaxModule, batches: Iterable[Any]) -> None:
        """Sets the state's ``batch_stats`` to the mean over ``batches`` of each
        batch's statistics under the state's parameters (`build_statistics_step`)."""
        state = self.held.live_state()
        step = self.steps.statistics_step(module)
        zeros = zeros_like_local(self.strategy, state.model_state["batch_stats"])
        acc = self.strategy.replicate((zeros, np.zeros((), np.int32)))
        for batch in batches:
            acc = step(state.variables, acc, batch.data, batch.mask)
            self.held.throttle(acc)
        self.held.drain()
        sums, n = self.held.fetch(acc)
        if int(n) == 0:
            return
        self.held.set_batch_stats(jax.tree.map(lambda total: np.asarray(total) / int(n), sums))

    def forget(self, module: JaxModule) -> None:
        """``module``'s variables were replaced: they no longer are the fit's state."""
        if self.fit_module is module:
            self.fit_module = None


def _cost_of(step: Any) -> StepCost | None:
    """XLA's count of an ahead-of-time compiled ``step`` (`None` otherwise)."""
    if isinstance(step, Precompiled):
        compiled = step.compiled()
        return None if compiled is None else step_cost(compiled)
    return None


def _mixed(batches: list[Any]) -> bool:
    """Whether host batches differ in shape (a resident group's are indices)."""
    if not isinstance(batches[0], DeviceBatch):
        return False
    shapes = [jax.tree.map(np.shape, b.host.data) for b in batches]
    return any(s != shapes[0] for s in shapes[1:])
