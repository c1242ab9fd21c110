"""Numeric precision of the step: Lightning's ``precision`` settings for JAX. Traced code.

``"32-true"``: everything in float32. ``"bf16-mixed"``: float32 master
parameters and optimizer state; the forward and backward passes see bfloat16
copies of the parameters and of the batch's floating inputs, while the loss,
the gradient that reaches the optimizer and every logged value stay float32.
``"16-mixed"``: as ``"bf16-mixed"`` in float16, with dynamic loss scaling
(`jaxlightning.training.loss_scale`): an update whose scaled gradient overflows is
skipped and the scale halved.
``"bf16-true"``: parameters, optimizer state and inputs in bfloat16.
``"64-true"``: float64, which JAX allows only with ``JAX_ENABLE_X64=1``.
No flax module needs its own dtype settings: the casts happen around it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "64-true")
_ALIASES = {
    "32": "32-true",
    32: "32-true",
    "bf16": "bf16-mixed",
    "16": "16-mixed",
    16: "16-mixed",
    "64": "64-true",
    64: "64-true",
}


def resolve(precision: Any) -> str:
    """A ``precision`` setting, checked (Lightning's short names accepted)."""
    value = _ALIASES.get(precision, precision)
    if value == "16-true":
        raise ValueError(
            f"precision={precision!r}: float16 parameters lose small updates; use "
            "'16-mixed' (float32 parameters, float16 compute, dynamic loss scaling) or "
            "'bf16-mixed'"
        )
    if value not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: use one of {PRECISIONS}")
    if value == "64-true" and not jax.config.jax_enable_x64:
        raise ValueError(
            "precision='64-true' needs 64-bit JAX: set JAX_ENABLE_X64=1 in the environment "
            "before jax is imported (or jax.config.update('jax_enable_x64', True) first)"
        )
    return value


def _cast_floats(tree: Any, dtype: Any) -> Any:
    def cast(x: Any) -> Any:
        if isinstance(x, nn.Partitioned):  # a shard its layer gathers, then casts
            return x
        x = jnp.asarray(x)
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(cast, tree, is_leaf=lambda x: isinstance(x, nn.Partitioned))


_COMPUTING: contextvars.ContextVar[Any] = contextvars.ContextVar("jl_compute_dtype", default=None)


@contextlib.contextmanager
def computing(precision: str) -> Iterator[None]:
    """While a step is traced: what `compute_dtype_now` says (for parameters
    that a `jl.fsdp_gathered` layer gathers and casts itself)."""
    token = _COMPUTING.set(compute_dtype(precision))
    try:
        yield
    finally:
        _COMPUTING.reset(token)


def compute_dtype_now() -> Any:
    """The compute dtype of the step being traced (``None``: unchanged)."""
    return _COMPUTING.get()


def compute_dtype(precision: str) -> Any:
    """The dtype of the forward and backward passes (``None``: unchanged)."""
    dtypes = {
        "bf16-mixed": jnp.bfloat16,
        "16-mixed": jnp.float16,
        "bf16-true": jnp.bfloat16,
        "64-true": jnp.float64,
    }
    return dtypes.get(precision)


def for_compute(tree: Any, precision: str) -> Any:
    """Floating leaves of ``tree`` (parameters, a batch) in the compute dtype."""
    dtype = compute_dtype(precision)
    return tree if dtype is None else _cast_floats(tree, dtype)


def for_storage(tree: Any, precision: str) -> Any:
    """Floating leaves of the initial variables in the dtype they are kept in."""
    if precision == "bf16-true":
        return _cast_floats(tree, jnp.bfloat16)
    if precision == "64-true":
        return _cast_floats(tree, jnp.float64)
    return tree
