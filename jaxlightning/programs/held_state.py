"""The train state on the devices, its metric accumulators and the steps in flight.

`HeldState` is the one owner of the placed arrays a fit trains: the compiled
steps read and replace them through `advance`, the loops fetch metrics and
checkpoint trees from it, and the callbacks' edits (`map_state`, optimizer-state
fields, a rollback's snapshot) go through it. It never compiles a training step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxlightning.adapters.lora import adapters_only
from jaxlightning.progress import Progress
from jaxlightning.strategies import Strategy
from jaxlightning.training.losses import NonFiniteLossError
from jaxlightning.training.state import TrainState
from jaxlightning.training.step import TrainMetrics


class HeldState:
    """The placed train state and accumulators, and the bound on steps in flight.

    Args:
        strategy: how the state is laid out (unreplicating, fetching, in-flight bound).
        progress: the run's position (named in non-finite loss errors).
        stop_on_nonfinite_loss: `fetch_metrics` raises `NonFiniteLossError`.
    """

    def __init__(
        self, strategy: Strategy, progress: Progress, *, stop_on_nonfinite_loss: bool = True
    ) -> None:
        self.strategy = strategy
        self.progress = progress
        self.stop_on_nonfinite_loss = stop_on_nonfinite_loss
        self._state: TrainState | None = None
        self._acc: TrainMetrics | None = None
        self._acc0: TrainMetrics | None = None
        self._in_flight: deque[Any] = deque()
        self.mapped = 0  # how many times a whole-state edit replaced the state
        self.adapters_only = False  # checkpoints keep only LoRA adapters of params

    def hold(self, state: TrainState, acc: TrainMetrics, acc0: TrainMetrics) -> None:
        """Places a fit's first (or restored) state and accumulators."""
        self._state = self.strategy.place_state(state)
        self._acc = self.strategy.replicate(acc)
        self._acc0 = self.strategy.replicate(acc0)

    # ------------------------------------------------------------- reading
    @property
    def started(self) -> bool:
        """Whether a fit built (or restored) a train state."""
        return self._state is not None

    def live_state(self) -> TrainState:
        """The placed train state itself: valid until the next train step."""
        if self._state is None:
            raise RuntimeError("fit has not started")
        return self._state

    def state_copy(self) -> TrainState | None:
        """One (unreplicated) copy of the train state that later steps leave
        valid (the steps donate their input buffers); ``None`` before `fit`."""
        if self._state is None:
            return None
        return jax.tree.map(lambda x: x.copy(), self.strategy.unreplicate(self._state))

    def trained_variables(self) -> Any:
        """The state's variables (one copy), to hand back to the module."""
        return self.strategy.unreplicate(self.live_state()).variables

    def fetch(self, tree: Any) -> Any:
        return jax.device_get(self.strategy.unreplicate(tree))

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

    def checkpoint_tree(self) -> dict[str, Any]:
        """What a checkpoint writes: the state's arrays and the metric
        accumulator, after the steps in flight; refuses a non-finite loss, and
        a state ahead of the batch the hooks are at (several per dispatch)."""
        if not self.started:
            raise RuntimeError("nothing to checkpoint: fit has not started")
        if self.progress.steps_ahead:
            raise RuntimeError(
                f"a checkpoint now would hold a train state {self.progress.steps_ahead} "
                "step(s) ahead of this batch (this fit runs trainer.steps_per_dispatch batches "
                "per dispatch); save at the end of a dispatch: in on_train_batch_end when "
                "trainer.steps_ahead == 0, or with ModelCheckpoint(every_n_train_steps=...), "
                "which ends dispatches at its steps"
            )
        self.drain()
        acc = self.fetch_metrics()
        state = self.live_state()
        if self.adapters_only:  # the frozen weights come from the module's `pretrained`
            state = state.replace(params=adapters_only(state.params))
        return {"state": self.strategy.checkpoint_arrays(state), "acc": acc}

    # ------------------------------------------------------------- stepping
    def advance(self, step: Callable[..., tuple[TrainState, TrainMetrics]], *args: Any) -> None:
        """Dispatches ``step(state, acc, *args)``, holds what it returns and
        waits for an older step past the bound."""
        self._state, self._acc = step(self._state, self._acc, *args)
        # A step's outputs are all ready at once: one scalar stands for them
        # (waiting on a whole tree flattens it every step).
        self.throttle(self._acc.first_nonfinite)

    def apply(self, update: Callable[[TrainState], TrainState]) -> None:
        """Replaces the state by ``update(state)`` (an already compiled program
        that is part of training, such as the accumulation flush)."""
        self._state = update(self._state)

    def throttle(self, token: Any) -> None:
        """Bounds the steps in flight by waiting on the oldest one's output."""
        self._in_flight.append(token)
        if len(self._in_flight) > self.strategy.max_in_flight:
            jax.block_until_ready(self._in_flight.popleft())

    def busy(self) -> bool:
        """Whether the newest step in flight is still running."""
        newest = jax.tree.leaves(self._in_flight[-1]) if self._in_flight else ()
        return not all(leaf.is_ready() for leaf in newest)

    def load_more(self, waiting: int) -> bool:
        """Whether to load another batch ahead, ``waiting`` loaded already,
        before a wait for the steps in flight: while they run, up to the
        in-flight bound (the lead the loop had over the device)."""
        return waiting < self.strategy.max_in_flight and self.busy()

    def drain(self) -> None:
        """Waits for every step in flight."""
        while self._in_flight:
            jax.block_until_ready(self._in_flight.popleft())

    def reset_interval(self, acc: TrainMetrics) -> None:
        """Starts the next logging interval (``acc``: the fetched accumulator)."""
        assert self._acc is not None and self._acc0 is not None
        self._acc = self._acc.replace(metrics=self._acc0.metrics)

    def reset_epoch(self) -> None:
        """Starts a new epoch's accumulators (intervals never span two epochs)."""
        self._acc = self._acc0

    # ---------------------------------------------------------------- edits
    def map_state(self, fn: Callable[[TrainState], TrainState]) -> None:
        """Replaces the train state by ``fn(state)``, compiled as one program the
        same on every device (after the steps in flight)."""
        self.drain()
        self._state = self.strategy.compile_global(fn)(self.live_state())
        self.mapped += 1

    def set_optimizer_state(self, kind: type, **values: Any) -> None:
        """Writes host ``values`` into the named fields of every node of type
        ``kind`` (a NamedTuple) in the train state's optimizer state, each leaf
        keeping its shape, dtype and placement: the next step reads them, and
        nothing recompiles."""
        if not values:
            return
        found = []

        def is_node(node: Any) -> bool:
            if isinstance(node, kind):
                found.append(node)
                return True
            return False

        def replace(node: Any) -> Any:
            if not isinstance(node, kind):
                return node
            return node._replace(**{f: put_like(getattr(node, f), v) for f, v in values.items()})

        state = self.live_state()
        opt_state = jax.tree.map(replace, state.opt_state, is_leaf=is_node)
        if not found:
            raise RuntimeError(f"the optimizer state holds no {kind.__name__}")
        self._state = state.replace(opt_state=opt_state)

    def set_batch_stats(self, means: Any) -> None:
        """Replaces the state's ``batch_stats`` by host ``means`` (each placed as
        the leaf it replaces)."""
        state = self.live_state()
        stats = jax.tree.map(put_like, state.model_state["batch_stats"], means)
        self._state = state.replace(model_state={**state.model_state, "batch_stats": stats})
        self.mapped += 1

    def snapshot(self) -> tuple[TrainState, TrainMetrics]:
        """A copy, on the devices, of the train state and the accumulators,
        which later steps leave valid (`restore` puts it back)."""
        return jax.tree.map(lambda x: x.copy(), (self.live_state(), self._acc))

    def restore(self, snapshot: tuple[TrainState, TrainMetrics]) -> None:
        """Puts a `snapshot` back (a copy of it: it stays valid for another)."""
        self.drain()
        self._state, self._acc = jax.tree.map(lambda x: x.copy(), snapshot)


def put_like(leaf: jax.Array, value: Any) -> jax.Array:
    """Host ``value`` (broadcast to ``leaf``'s shape) placed as ``leaf`` is."""
    host = np.broadcast_to(np.asarray(value, leaf.dtype), leaf.shape)
    return jax.make_array_from_callback(leaf.shape, leaf.sharding, lambda i: host[i])
