"""`jax.jit` of `jax.shard_map` over a one-axis `Mesh` of global arrays."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlightning.strategies.base import Strategy
from jaxlightning.xla.compiling import Precompiled


def spec(sharded: bool, axis: str) -> P:
    """The `PartitionSpec` of a value split along its leading axis over ``axis``,
    or (``sharded=False``) of one that every device has whole."""
    return P(axis) if sharded else P()


def per_device(
    fn: Callable[..., Any],
    mesh: Mesh,
    in_specs: tuple[P, ...],
    out_specs: Any,
    *,
    manual_axes: frozenset[str] | None = None,
) -> Callable[..., Any]:
    """``fn`` run per device by `jax.shard_map` over ``mesh``: the one place the
    strategies build their SPMD functions.

    Args:
        manual_axes: the mesh axes ``fn`` is written per device over (``None``:
            all); the others stay automatic, partitioned by XLA.
    """
    kwargs = {} if manual_axes is None else {"axis_names": set(manual_axes)}
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        # Off: with it on, grad of replicated params would be psum'd implicitly;
        # the step functions reduce explicitly, as under pmap.
        check_vma=False,
        **kwargs,
    )


class ShardMapStrategy(Strategy):
    """Data parallel with `jax.jit(jax.shard_map(...))`.

    State lives as replicated global arrays, batches as global arrays split along
    their leading axis. Works across processes: the mesh spans every process's
    devices and each process contributes its own rows of each global batch.
    Measured on these machines it dispatches ~3x faster than `jax.pmap`, which
    since JAX 0.8 is itself built on jit and shard_map.
    """

    name = "shard_map"

    def setup(self, devices: Sequence[jax.Device]) -> None:
        super().setup(devices)
        self.mesh = Mesh(np.asarray(self.devices), (self.axis_name,))
        self._replicated = NamedSharding(self.mesh, P())
        self._sharded = NamedSharding(self.mesh, P(self.axis_name))
        self._host_is_device = jax.process_count() == 1 and all(
            d.platform == "cpu" for d in self.devices
        )

    @property
    def batch_placement(self) -> tuple[jax.sharding.Sharding, jax.sharding.Sharding] | None:
        if jax.process_count() > 1:
            return None
        return self._replicated, self._sharded

    @property
    def batch_sharding(self) -> NamedSharding:
        """The sharding of a global batch: rows split over the data axis."""
        return self._sharded

    def replicate(self, tree: Any) -> Any:
        return jax.device_put(tree, self._replicated)

    def unreplicate(self, tree: Any) -> Any:
        return tree

    def put_batch(self, tree: Any) -> Any:
        if self._host_is_device:
            # On the CPU backend device memory is host memory: nothing to copy
            # ahead. The compiled step takes the numpy arrays as they are (its
            # in_shardings place them), which measured cheaper than device_put.
            return tree
        if jax.process_count() == 1:
            # Host batches are fresh arrays nobody writes to again: letting the
            # device alias them saves a copy (half the transfer time on CPU).
            return jax.device_put(tree, self._sharded, may_alias=True)
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(self._sharded, x), tree
        )

    def gather(self, tree: Any) -> Any:
        if jax.process_count() == 1:
            return jax.tree.map(np.asarray, tree)
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(tree, tiled=True)

    def compile(
        self,
        fn: Callable[..., Any],
        *,
        sharded_args: Sequence[bool],
        sharded_out: Any,
        donate_argnums: tuple[int, ...] = (),
    ) -> Callable[..., Any]:
        axis = self.axis_name
        mapped = per_device(
            fn,
            self.mesh,
            tuple(spec(s, axis) for s in sharded_args),
            jax.tree.map(lambda s: spec(s, axis), sharded_out),
        )
        shardings = tuple(self._sharded if s else self._replicated for s in sharded_args)
        return jax.jit(mapped, in_shardings=shardings, donate_argnums=donate_argnums)

    def precompile(self, compiled: Callable[..., Any], *example: Any) -> Callable[..., Any]:
        # One process only: in a multi-process run every process must compile
        # the same program in step, which the plain first call already does.
        if jax.process_count() > 1:
            return compiled
        return Precompiled(compiled, *example)
