"""The `Strategy` interface: how state and batches are laid over devices."""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxlightning.training.step import AXIS


class Strategy(abc.ABC):
    """Places data on the local devices and compiles per-device functions.

    A per-device function sees one device's shard of each batch and replicated
    copies of everything else; inside it, collectives use the axis name
    `jaxlightning.training.step.AXIS`. Implementations differ only in how they express this
    SPMD program; they must give the same numbers.

    Contract, in the order the Trainer calls it:
      * `setup(devices)` once per run, before anything is placed.
      * `replicate(tree)` puts a full copy of ``tree`` on every device.
      * `put_batch(tree)` places this process's host batch (numpy, leading
        dimension a multiple of `num_local_devices`) split along its leading
        axis; in a multi-process run the global batch is every process's batch
        together. May run on a background thread.
      * `compile(fn, ...)` wraps a per-device function once; the result takes
        replicated and sharded arguments as returned by the two methods above.
      * `unreplicate(tree)` gives one copy of a replicated output;
        `gather(tree)` gives a sharded output back as host arrays with the global
        leading dimension.

    Laying out the train state (what a state-sharding strategy overrides; the
    defaults replicate it, as data parallelism does):
      * `plan(annotated)` decides the state's layout before it is built, from
        ``annotated()`` (its abstract shapes with the model's partitioning
        annotations, computed only if asked for); `plan_variables` the same
        for flax variables alone (evaluation outside `fit`).
      * `place_state(tree)` / `place_variables(tree, annotated)` put a built
        state or variables where the steps expect them.
      * `compile_train(parts)` compiles the automatic train step from its
        `TrainStepParts` (``reduce_grads`` says how gradients are summed);
        `compile_manual(fn)` a manual-optimization step; `compile_global(fn)`
        a ``state -> state`` function.
      * `checkpoint_arrays(tree)` is what a checkpoint writes of the state.

    Attributes:
        max_in_flight: the most steps the Trainer dispatches before waiting for
            the oldest to finish (default: `default_max_in_flight`, set by
            `setup`). Bounding it caps memory and avoids the XLA CPU
            collectives deadlock of long runs of queued all-reduces.
        prefetch_depth: batches converted, padded and placed ahead of the step
            on a background thread; 0 does it in the loop itself (default 2,
            but 0 for the loading `prefetch_depth_for` names. On 2 CPU cores 2
            measured 23-27% faster than 0 with a loader that waits, and with
            per-example loading through the DataLoader's iterator and 2 steps
            in flight; equal with whole-batch loading).
    """

    name: str = "base"
    axis_name: str = AXIS

    def __init__(
        self, *, max_in_flight: int | None = None, prefetch_depth: int | None = None
    ) -> None:
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        if prefetch_depth is not None and prefetch_depth < 0:
            raise ValueError(f"prefetch_depth must be >= 0, got {prefetch_depth}")
        self._max_in_flight = max_in_flight
        self._prefetch_depth = prefetch_depth
        self.devices: list[jax.Device] = []
        self.max_in_flight = 2 if max_in_flight is None else max_in_flight

    def setup(self, devices: Sequence[jax.Device]) -> None:
        self.devices = list(devices)
        if self._max_in_flight is None:
            self.max_in_flight = self.default_max_in_flight()

    def default_max_in_flight(self) -> int:
        """Steps in flight unless the user says: 32 on one CPU device, else 2.

        Several CPU devices run collectives, and a few hundred of them queued
        hang in XLA's CPU runtime: 2. One CPU device runs none, and there the
        loop's host work shares the cores with the step's XLA threads: a deep
        queue lets the loop run ahead instead of waking for every step. 32 is
        XLA's CPU client's own bound (a dispatch past 32 computations in flight
        waits inside XLA), so the Trainer's wait then finds the oldest step
        done. Arm 1's per-example loader, 2 cores, interleaved in one process:
        8 in flight was 0.3-7% faster than 2 (three runs of 10-12 rounds); no
        bound of the Trainer's 4-8% faster than 8 (two runs of 9 and 15
        rounds), 32 6% faster in one run of 15 rounds and the same in another
        (docs/performance.md). On accelerators 2, 4 and 8 measured the same
        (H200): 2, which holds the fewest batches.
        """
        return 32 if self.on_cpu and self.num_devices == 1 else 2

    @property
    def prefetch_depth(self) -> int:
        """Batches prepared ahead on a background thread (0: none, in the loop)."""
        return 2 if self._prefetch_depth is None else self._prefetch_depth

    def prefetch_depth_for(self, python_loading: bool) -> int:
        """`prefetch_depth` for one pass; unless the user set it, 0 on the CPU
        backend where the loading is Python run in this process (a per-example
        Dataset read by the Trainer itself, `FetchedEpoch`).

        Such loading holds the GIL, so a thread gains no overlap with the loop
        and adds a pass of the GIL each way per batch; the step still overlaps
        it (XLA runs it on its own threads). On 2 cores, 1 device, 8 steps in
        flight, interleaved in one process: arm 1's model 0.89 and 0.98 of the
        bare loop with depth 0 against 0.86 and 0.96 with 2 (two runs); a
        64->10 model, where loading is most of a step, 0.83 against 0.73-0.78.
        """
        if self._prefetch_depth is None and python_loading and self.on_cpu:
            return 0
        return self.prefetch_depth

    @property
    def on_cpu(self) -> bool:
        """Whether the step runs on the CPU backend, on the cores the host uses."""
        return bool(self.devices) and all(d.platform == "cpu" for d in self.devices)

    @property
    def donates_params(self) -> bool:
        """Whether the train step writes the new parameters over the old (as
        the rest of the state): everywhere but on the CPU backend, where
        keeping them apart is faster (see `_compile_step`)."""
        return not self.on_cpu

    @property
    def num_devices(self) -> int:
        """Devices over all processes."""
        return len(self.devices)

    @property
    def num_local_devices(self) -> int:
        """Devices of this process: a host batch is split over these."""
        me = jax.process_index()
        return sum(d.process_index == me for d in self.devices)

    @property
    def batch_placement(self) -> tuple[jax.sharding.Sharding, jax.sharding.Sharding] | None:
        """Where a device-resident dataset goes and where its batches are
        gathered to: (an array every device holds whole, a batch split over the
        data axis); ``None`` where batches are not one global array (``pmap``)
        or come from several processes."""
        return None

    @property
    def num_local_shards(self) -> int:
        """How many ways this process's host batch is split (one shard per
        device along the data axis)."""
        return self.num_local_devices

    def plan(self, annotated: Callable[[], Any]) -> Any:
        """The shardings to build the train state with, decided from
        ``annotated()``; ``None``: built on one device, then `place_state`."""
        return None

    def plan_variables(self, annotated: Callable[[], Any]) -> Any:
        """Like `plan`, for flax variables alone."""
        return None

    def place_state(self, tree: Any) -> Any:
        """Puts the train state where the steps expect it."""
        return self.replicate(tree)

    def place_variables(self, tree: Any, annotated: Callable[[], Any]) -> Any:
        """Puts flax variables where the evaluation steps expect them."""
        return self.replicate(tree)

    def checkpoint_arrays(self, tree: Any) -> Any:
        """What a checkpoint writes of the placed state: host arrays, one copy."""
        return jax.device_get(self.unreplicate(tree))

    def _compile_step(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """A per-device ``(state, acc, batch, rows) -> (state, acc)``, compiled.

        The state is donated: its new values are written over the old. On the
        CPU backend all but the parameters: there XLA copies each parameter
        that the backward pass reads after the update could have written it
        (3 of the 6 arrays of a 3-layer MLP), which costs more than writing
        the new parameters to fresh memory (a step of a 64-256-256-10 MLP at
        batch 128 on 2 cores: ~730 us donating all, ~690 us keeping the
        parameters; the same program otherwise, the same bits). The price: a
        step holds the old and the new parameters at once, one copy more of
        them in host memory."""
        if self.donates_params:
            return self.compile(
                fn,
                sharded_args=(False, False, True, True),
                sharded_out=(False, False),
                donate_argnums=(0,),
            )

        def params_apart(params, rest, acc, batch, rows):
            state, acc = fn(rest.replace(params=params), acc, batch, rows)
            # The parameters last: JAX gives each donated buffer to the first
            # output of its shape, which must be the same array's new value.
            return state.replace(params=None), acc, state.params

        # the program keeps the step's name (compile logs, profiles, XLA dumps)
        params_apart.__name__ = params_apart.__qualname__ = fn.__name__
        compiled = self.compile(
            params_apart,
            sharded_args=(False, False, False, True, True),
            sharded_out=(False, False, False),
            donate_argnums=(1,),
        )
        return ParamsApart(compiled)

    def compile_train(self, parts: Any) -> Callable[..., Any]:
        """Compiles the automatic train step from its `TrainStepParts`."""
        return self._compile_step(parts.per_device())

    def compile_manual(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Compiles a per-device manual-optimization train step
        ``(state, acc, batch, rows) -> (state, acc)``."""
        return self._compile_step(fn)

    def compile_global(self, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """Compiles ``state -> state`` (the same on every device)."""
        return self.compile(fn, sharded_args=(False,), sharded_out=False, donate_argnums=(0,))

    def reduce_grads(self) -> Callable[[Any], Any] | None:
        """How the train step sums per-device gradients (``None``: a ``psum``
        together with the logged values)."""
        return None

    def gathering(self) -> Callable[[Callable[..., Any]], Callable[..., Any]] | None:
        """How the train step's loss of whole parameters becomes a loss of each
        device's shards that gathers them (``None``: the gradient part receives
        the parameters whole)."""
        return None

    @abc.abstractmethod
    def replicate(self, tree: Any) -> Any: ...

    @abc.abstractmethod
    def unreplicate(self, tree: Any) -> Any: ...

    @abc.abstractmethod
    def put_batch(self, tree: Any) -> Any: ...

    @abc.abstractmethod
    def gather(self, tree: Any) -> Any: ...

    @abc.abstractmethod
    def compile(
        self,
        fn: Callable[..., Any],
        *,
        sharded_args: Sequence[bool],
        sharded_out: Any,
        donate_argnums: tuple[int, ...] = (),
    ) -> Callable[..., Any]:
        """Compiles per-device ``fn``.

        Args:
            fn: the per-device function.
            sharded_args: per positional argument, whether it is a batch-sharded
                value (else replicated).
            sharded_out: a pytree prefix of ``fn``'s output of bools, the same.
            donate_argnums: arguments whose buffers the result may reuse.
        """

    def precompile(self, compiled: Callable[..., Any], *example: Any) -> Callable[..., Any]:
        """Starts compiling ``compiled`` (from `compile`) for ``example`` arguments
        ahead of its first call, where the strategy can; returns what to call
        (by default ``compiled`` itself: it compiles at its first call)."""
        return compiled

    def __repr__(self) -> str:
        return f"{type(self).__name__}(devices={self.num_devices})"


class ParamsApart:
    """A train step compiled as ``(params, rest of the state, acc, batch, rows)``
    (so that the parameters can be left out of the donation), called as
    ``(state, acc, batch, rows)`` like every other."""

    def __init__(self, compiled: Callable[..., Any]) -> None:
        self.compiled = compiled

    @staticmethod
    def arrange(state: Any, *args: Any) -> tuple[Any, ...]:
        """The compiled program's arguments for a call's."""
        return (state.params, state.with_params(None), *args)

    def __call__(self, *args: Any) -> Any:
        return self.assemble(self.compiled(*self.arrange(*args)))

    @staticmethod
    def assemble(out: tuple[Any, Any, Any]) -> tuple[Any, Any]:
        """A call's ``(state, acc)`` from the compiled program's outputs."""
        rest, acc, params = out
        return rest.with_params(params), acc

    def calling(self, program: Callable[..., Any]) -> Callable[..., Any]:
        """``program`` (an ahead-of-time compile of ``compiled``) called as this is."""
        return lambda *args: self.assemble(program(*self.arrange(*args)))

    @property
    def trace(self) -> Callable[..., Any]:
        """`jax.jit`'s ``trace`` for a call's arguments (ahead-of-time compiles,
        cost analysis); absent, as the program's, under ``pmap``."""
        trace = self.compiled.trace  # type: ignore[attr-defined]
        return lambda *args: trace(*self.arrange(*args))
