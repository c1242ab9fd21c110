"""Flax NNX models: split into arrays the Trainer trains, merged back in each hook.

A `JaxModule` holding an ``nnx.Module`` (as ``self.model``, or returned by
``setup``) is trained like a linen one: its ``nnx.Param`` variables are the
``params``, its other variables (BatchNorm statistics, ...) the ``"nnx"``
collection, averaged across devices like ``batch_stats``. Inside each traced
hook the model is merged from them and handed to the hook; its RNG streams are
reseeded with keys that differ per device and per step, as linen's ``rngs``.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

COLLECTION = "nnx"


def _set(tree: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def is_nnx(value: Any) -> bool:
    return isinstance(value, nnx.Module)


class NnxGraph:
    """The static part of an NNX model and how its state maps to variables."""

    def __init__(self, model: nnx.Module) -> None:
        self.graphdef, params, rngs, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
        self._params, self._rngs, self._rest = params, rngs, rest
        graph = list(nnx.iter_graph(model))
        self._keys = [(path, v.tag) for path, v in graph if isinstance(v, nnx.RngKey)]
        self._counts = [path for path, v in graph if isinstance(v, nnx.RngCount)]
        self.streams = tuple(sorted({tag for _, tag in self._keys}))

    def variables(self) -> dict[str, Any]:
        """The model's arrays as flax-style variables (RNG state left out: it is
        reseeded in every step). Parameters made with ``nnx.with_partitioning``
        come boxed as linen's ``nn.Partitioned``, so that a sharding strategy
        reads their layout as it reads a linen model's."""
        specs = nnx.to_pure_dict(nnx.get_partition_spec(self._params))

        def boxed(value: Any, spec: Any) -> Any:
            return nn.Partitioned(value, names=tuple(spec)) if tuple(spec) else value

        params = nnx.to_pure_dict(self._params)
        out = {"params": jax.tree.map(boxed, params, specs, is_leaf=_is_spec)}
        rest = nnx.to_pure_dict(self._rest)
        if jax.tree.leaves(rest):
            out[COLLECTION] = rest
        return out

    @staticmethod
    def _filled(template: nnx.State, pure: Any) -> nnx.State:
        state = jax.tree.map(lambda x: x, template)
        nnx.replace_by_pure_dict(state, pure)
        return state

    def merge(
        self, variables: dict[str, Any], keys: dict[str, jax.Array] | None, *, train: bool
    ) -> nnx.Module:
        """The model with ``variables``' arrays, in train or eval mode, its RNG
        streams reseeded with ``keys``."""
        params = self._filled(self._params, variables["params"])
        rest = self._filled(self._rest, variables.get(COLLECTION, {}))
        model = nnx.merge(self.graphdef, params, self._rng_state(keys), rest)
        if train:
            model.train()
        else:
            model.eval()
        return model

    def _rng_state(self, keys: dict[str, jax.Array] | None) -> nnx.State:
        """The RNG streams' state, built in the current trace: each stream's key
        replaced by ``keys[stream]`` (a raw key, per device and step), counts 0."""
        pure = nnx.to_pure_dict(self._rngs)
        if keys:
            for path, tag in self._keys:
                _set(pure, path, jax.random.wrap_key_data(keys[tag]))
            for path in self._counts:
                _set(pure, path, jnp.zeros((), jnp.uint32))
        return self._filled(self._rngs, pure)

    def updates(self, model: nnx.Module) -> dict[str, Any]:
        """The non-parameter variables a hook changed (BatchNorm statistics)."""
        _, _, _, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
        pure = nnx.to_pure_dict(rest)
        return {COLLECTION: pure} if jax.tree.leaves(pure) else {}

    def update(self, model: nnx.Module, variables: dict[str, Any]) -> None:
        """Puts ``variables``' arrays (trained, host or device) into ``model``."""
        params = self._filled(self._params, variables["params"])
        rest = self._filled(self._rest, variables.get(COLLECTION, {}))
        nnx.update(model, params, rest)
