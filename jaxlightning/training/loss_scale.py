"""Dynamic loss scaling for ``precision="16-mixed"``. Traced code.

float16 has 5 exponent bits: small gradients of the backward pass underflow to
zero. The step multiplies the loss by a scale before differentiating and
divides the gradient by it after; when the scaled gradient overflows (a NaN or
infinity anywhere) the update is skipped and the scale halved, and after
`GROWTH_INTERVAL` good updates in a row it doubles (torch's ``GradScaler``
policy, with its defaults).

The scale lives in the optimizer state, in front of the user's optimizer, so it
is checkpointed, restored and sharded like any optimizer state and needs no
field of its own in the train state.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class LossScaleState(NamedTuple):
    """The current scale, the good updates since it last changed, and the
    wrapped optimizer's state."""

    scale: jax.Array
    good_steps: jax.Array
    inner: Any


INIT_SCALE = 2.0**16
GROWTH_INTERVAL = 2000


def with_loss_scale(
    tx: optax.GradientTransformation, init_scale: float = INIT_SCALE
) -> optax.GradientTransformationExtraArgs:
    """``tx`` with a loss scale carried in its state (`LossScaleState`); updates
    pass through to ``tx`` unchanged. The step reads the scale and moves it with
    `next_scale`."""
    tx = optax.with_extra_args_support(tx)

    def init(params: Any) -> LossScaleState:
        scale = jnp.asarray(init_scale, jnp.float32)
        return LossScaleState(scale, jnp.zeros((), jnp.int32), tx.init(params))

    def update(updates: Any, state: LossScaleState, params: Any = None, **extra: Any) -> Any:
        updates, inner = tx.update(updates, state.inner, params, **extra)
        return updates, state._replace(inner=inner)

    return optax.GradientTransformationExtraArgs(init, update)


def next_scale(
    state: LossScaleState, finite: jax.Array, growth_interval: int = GROWTH_INTERVAL
) -> LossScaleState:
    """The scale after an update whose gradient was ``finite`` (or not)."""
    good = jnp.where(finite, state.good_steps + 1, 0)
    grow = good >= growth_interval
    scale = jnp.where(finite, jnp.where(grow, state.scale * 2, state.scale), state.scale / 2)
    return state._replace(scale=scale, good_steps=jnp.where(grow, 0, good).astype(jnp.int32))
