"""Scales of every update kept in the optimizer state, written by the host.

A plateau scheduler (`jl.ReduceLROnPlateau`) and a rollback policy
(`jl.Rollback`'s ``lr_factor``) lower the learning rate while a fit runs. The
rate is a traced value of the optimizer state, not a Python number: the
optimizer is followed by `scale_updates`, which multiplies every update by the
``scale`` of its state, and the host writes a new scale into the train state
(``trainer.edit.set_optimizer_state``) — nothing recompiles, and the scale is
checkpointed with the state. For optimizers whose update is proportional to
the learning rate (SGD, Adam, AdamW, ...), scaling the update is lowering the
rate. Each writer has its own state type, so the two never touch each other's.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class PlateauScaleState(NamedTuple):
    """The factor every update is multiplied by (1 until a plateau lowers it)."""

    scale: jax.Array


class RollbackScaleState(NamedTuple):
    """The factor every update is multiplied by (1 until a rollback lowers it)."""

    scale: jax.Array


def scale_updates(kind: type = PlateauScaleState) -> optax.GradientTransformation:
    """Multiplies updates by the scale in its state, a ``kind`` (a NamedTuple
    with one field, ``scale``, from 1: the host writes it)."""

    def init(params: Any) -> Any:
        del params
        return kind(jnp.ones((), jnp.float32))

    def update(updates: Any, state: Any, params: Any = None) -> Any:
        del params
        return jax.tree.map(lambda u: u * state.scale.astype(u.dtype), updates), state

    return optax.GradientTransformation(init, update)
