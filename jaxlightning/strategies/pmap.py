"""Literal `jax.pmap` over a leading device axis: the seeds' recipe."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlightning.strategies.base import Strategy

# The mesh axis name jax.pmap gives its outputs; placing inputs with the same
# sharding keeps the first call and later calls on one compiled program.
_PMAP_AXIS = "_internal_pmap_axis_name"


class PmapStrategy(Strategy):
    """Data parallel with `jax.pmap`, as the hand-written recipe does it.

    Every value carries a leading axis of size `num_devices`: replicated values
    are stacked copies, batches are reshaped ``(B, ...) -> (n, B/n, ...)``.
    """

    name = "pmap"

    def setup(self, devices: Sequence[jax.Device]) -> None:
        if jax.process_count() > 1:
            raise ValueError(
                "strategy='pmap' runs in a single process only; use strategy='shard_map' "
                "(the default) for multi-process runs"
            )
        super().setup(devices)
        mesh = Mesh(np.asarray(self.devices), (_PMAP_AXIS,))
        self._stacked = NamedSharding(mesh, P(_PMAP_AXIS))

    def replicate(self, tree: Any) -> Any:
        n = self.num_devices

        def stack(x: Any) -> jax.Array:
            x = np.asarray(x)
            return jax.device_put(np.broadcast_to(x, (n, *x.shape)), self._stacked)

        return jax.tree.map(stack, tree)

    def unreplicate(self, tree: Any) -> Any:
        return jax.tree.map(lambda x: x[0], tree)

    def put_batch(self, tree: Any) -> Any:
        n = self.num_devices

        def split(x: np.ndarray) -> jax.Array:
            stacked = x.reshape(n, x.shape[0] // n, *x.shape[1:])
            return jax.device_put(stacked, self._stacked, may_alias=True)

        return jax.tree.map(split, tree)

    def gather(self, tree: Any) -> Any:
        return jax.tree.map(lambda x: np.asarray(x).reshape(-1, *x.shape[2:]), tree)

    def compile(
        self,
        fn: Callable[..., Any],
        *,
        sharded_args: Sequence[bool],
        sharded_out: Any,
        donate_argnums: tuple[int, ...] = (),
    ) -> Callable[..., Any]:
        del sharded_args, sharded_out  # every value has the leading device axis
        return jax.pmap(
            fn, axis_name=self.axis_name, devices=self.devices, donate_argnums=donate_argnums
        )
