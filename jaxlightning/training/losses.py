"""What a loss hook returns, checked and reduced exactly over real rows. Traced code.

Shared by the train step (`JaxModule.loss`) and manual optimization
(`Optimizers.step`): a scalar, a per-example vector or ``(loss, updates)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlightning.metrics.objects import TokenMean


class NonFiniteLossError(FloatingPointError, RuntimeError):
    """The training loss became NaN or infinite (a `RuntimeError`, as
    Lightning's error for it, and a `FloatingPointError`)."""


def split_loss_output(out: Any, model_state: Mapping[str, Any]) -> tuple[Any, dict]:
    """``(loss, updates)`` of what a loss hook returned: the loss, Lightning's
    ``{"loss": loss}``, or ``(loss, updates)`` with mutated collections."""
    if isinstance(out, Mapping):
        if set(out) != {"loss"}:
            raise TypeError(
                f"loss() returned a dict with keys {sorted(out)}; Lightning's "
                "{'loss': ...} is accepted, but other entries would be lost here (the step's "
                "outputs are not fetched): log them with self.log, and return mutated "
                "collections as (loss, {'batch_stats': ...})"
            )
        return out["loss"], {}
    if isinstance(out, tuple):
        if len(out) != 2 or not isinstance(out[1], Mapping):
            raise TypeError(
                "loss() returned a tuple; it must be (loss, updates) with updates a dict "
                "of mutated collections such as {'batch_stats': ...}"
            )
        loss, updates = out
        unknown = sorted(set(updates) - set(model_state))
        if unknown:
            raise ValueError(
                f"loss() returned updates for collections {unknown} that setup() did not "
                f"create; setup() created {sorted(model_state)}"
            )
        return loss, dict(updates)
    return out, {}


def masked_loss_sum(loss: Any, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum over real examples, number of real examples) of one shard's loss;
    for a `TokenMean`, over the real examples' counted elements (tokens)."""
    if isinstance(loss, TokenMean):
        counted = loss.state(mask)
        return counted.total, counted.count
    if not isinstance(loss, (jax.Array, np.ndarray, np.number, float, int)) or isinstance(
        loss, bool
    ):
        raise TypeError(
            f"loss() returned a {type(loss).__name__}; return a scalar or a per-example "
            f"vector of shape {mask.shape} (this device's shard), a jl.metrics.TokenMean "
            "(a mean over tokens), or (loss, updates)"
        )
    loss = jnp.asarray(loss)
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(f"loss() returned dtype {loss.dtype}; return a floating-point loss")
    real = mask.sum(dtype=jnp.int32)
    if loss.shape == ():
        # A scalar is taken as the shard's mean; weighting it by the shard's real
        # examples makes the cross-device mean exact whatever the padding.
        return loss.astype(jnp.float32) * real, real
    if loss.shape == mask.shape:
        return jnp.where(mask, loss, 0).astype(jnp.float32).sum(), real
    raise ValueError(
        f"loss() returned shape {loss.shape}; return a scalar or a per-example vector "
        f"of shape {mask.shape} (this device's shard), or (loss, updates)"
    )


def pmean_floats(summed: Any, original: Any, n_devices: int) -> Any:
    def mean(s: jax.Array, o: jax.Array) -> jax.Array:
        return s / n_devices if jnp.issubdtype(o.dtype, jnp.floating) else o

    return jax.tree.map(mean, summed, original)


def like(updates: Mapping[str, Any], model_state: Mapping[str, Any]) -> dict[str, Any]:
    """Mutated collections in the dtypes the state keeps them in (a bfloat16
    forward pass must not change the state's types, or every step recompiles)."""
    return {
        name: jax.tree.map(
            lambda u, old: jnp.asarray(u).astype(old.dtype), value, model_state[name]
        )
        for name, value in updates.items()
    }


def loss_terms(
    out: Any, model_state: Mapping[str, Any], mask: jax.Array
) -> tuple[jax.Array, jax.Array, dict[str, Any]]:
    """What a loss function returned, as the train steps use it: the loss summed
    over the real rows, their count, and the mutated collections (shaped as
    ``model_state``'s). One definition for `JaxModule.loss` and each
    ``optimizers.step`` of manual optimization."""
    loss, updates = split_loss_output(out, model_state)
    total, count = masked_loss_sum(loss, mask)
    return total, count, like(updates, model_state)
