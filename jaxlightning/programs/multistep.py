"""Several train steps in one dispatch (a group the fit loop's `Groups` cut).

One program runs the compiled train step over a group of batches with
`jax.lax.scan`, carrying the state and the metric accumulator from batch to
batch exactly as k dispatches would: the same step, the same keys (they are
derived from the state's step counter), the same order of merges, hence the
same bits. What goes away is the host's per-step work: one dispatch per group
instead of per batch, and for a dataset resident on the devices no gather
dispatch at all (the group's rows are gathered inside its program).

Groups shorter than k (ended early at a report, a validation, an epoch's end)
run step by step. One step of a resident dataset's batch (`resident_step`) also
gathers its rows in its own dispatch, and so does an evaluation's
(`resident_eval`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxlightning.data.convert import Rows
from jaxlightning.strategies.base import ParamsApart


def _scan(step: Callable[..., Any], state: Any, acc: Any, xs: Any, batch_of: Any) -> Any:
    def body(carry: Any, x: Any) -> tuple[Any, None]:
        batch, rows = batch_of(x)
        return step(*carry, batch, rows), None

    return jax.lax.scan(body, (state, acc), xs)[0]


def host_steps(
    step: Callable[..., Any], batch: jax.sharding.Sharding, layout: Any
) -> Callable[[Any, Any, tuple[Any, ...], tuple[Rows, ...]], tuple[Any, Any]]:
    """``(state, acc, batches, rows) -> (state, acc)``: ``step`` over a tuple of
    placed (or host) batches and their `Rows`, stacked inside the program.

    Args:
        step: the compiled ``(state, acc, batch, rows) -> (state, acc)``.
        batch: the sharding of one batch (rows split over the data axis).
        layout: the state's shardings, which the state keeps (`_keeping_layout`).
    """

    def jl_train_steps(state, acc, batches, rows):
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *batches)
        stacked_rows = jax.tree.map(lambda *xs: jnp.stack(xs), *rows)
        return _scan(step, state, acc, (stacked, stacked_rows), lambda x: x)

    return _keeping_layout(jl_train_steps, (None, None, batch, batch), layout)


def _keeping_layout(fn: Callable[..., Any], in_shardings: tuple[Any, ...], layout: Any) -> Any:
    """``jax.jit(fn)`` over ``(state, acc, ...)`` whose state comes out with
    the shardings ``layout`` (the held state's), the state donated. Left to
    itself XLA may choose another sharding for the scan's carry (a
    model-parallel bias split over the model axis), which the one-step program,
    compiled for the state's own layout, then refuses."""
    return jax.jit(fn, in_shardings=in_shardings, out_shardings=(layout, None), donate_argnums=(0,))


def _gather(data: Any, indices: Any, rows: Rows, sharding: jax.sharding.Sharding) -> Any:
    """The batches of rows ``indices`` of ``data`` and their ``rows``, past an
    optimization barrier: XLA then cannot fuse the gather into the step's
    arithmetic, so the step computes exactly as it does on a batch handed to
    it (fused, the batches' logged sums once rounded differently on two CPU
    devices, by 1 ulp). The indices are the sampler's, always in range:
    ``mode="clip"`` gathers without the out-of-range rows' NaN fill, whose
    selects also changed how XLA fused one logged sum of a single step under
    accumulation on two devices (1 ulp)."""
    gathered = jax.tree.map(lambda d: jnp.take(d, indices, axis=0, mode="clip"), data)
    gathered = jax.lax.with_sharding_constraint(gathered, sharding)
    return jax.lax.optimization_barrier((gathered, rows))


def resident_steps(
    step: Callable[..., Any],
    replicated: jax.sharding.Sharding,
    batch: jax.sharding.Sharding,
    layout: Any,
) -> Callable[[Any, Any, Any, Any, Rows], tuple[Any, Any]]:
    """``(state, acc, data, indices, rows) -> (state, acc)``: ``step`` over a
    group of batches of a dataset resident on the devices (``data``, whole on
    every device), gathered from their row ``indices`` (``(k, rows)``) in the
    same dispatch (`_gather`), with their `Rows` (each ``(k, rows)``); the
    state keeps the shardings ``layout``."""
    mesh = batch.mesh  # type: ignore[attr-defined]
    spec = batch.spec  # type: ignore[attr-defined]
    stacked = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, *spec))

    def jl_resident_steps(state, acc, data, indices, rows):
        gathered, rows = _gather(data, indices, rows, stacked)
        return _scan(step, state, acc, (gathered, rows), lambda x: x)

    return _keeping_layout(jl_resident_steps, (None, None, replicated, stacked, stacked), layout)


def _gathering(fn: Callable[..., Any], batch: jax.sharding.Sharding, default: str) -> Any:
    """``fn(*carried, batch, rows)`` as ``(*carried, data, indices, rows)``: its
    batch gathered first (`_gather`). Named after ``fn`` (else ``default``),
    ``_gathered`` added (compile logs, profiles)."""

    def gathered(*args):
        *carried, data, indices, rows = args
        return fn(*carried, *_gather(data, indices, rows, batch))

    gathered.__name__ = gathered.__qualname__ = getattr(fn, "__name__", default) + "_gathered"
    return gathered


def resident_step(
    step: Callable[..., Any], replicated: jax.sharding.Sharding, batch: jax.sharding.Sharding
) -> Callable[[Any, Any, Any, Any, Rows], tuple[Any, Any]]:
    """``(state, acc, data, indices, rows) -> (state, acc)``: ``step`` on one
    batch of a dataset resident on the devices, its rows gathered (`_gather`)
    in the step's own dispatch rather than in one of their own (a dispatch
    less per step: 5-8% of an epoch of a small MLP on 2 CPU cores).

    The state is donated as ``step`` donates it: where it keeps the parameters
    apart (`ParamsApart`, on the CPU backend) so does this program, whose
    arguments are then ``(params, rest, acc, data, indices, rows)``."""
    apart = isinstance(step, ParamsApart)
    inner = step.compiled if apart else step
    carried = (None, None, None) if apart else (None, None)
    program = jax.jit(
        _gathering(inner, batch, "jl_train_step"),
        in_shardings=(*carried, replicated, batch, batch),
        donate_argnums=(1,) if apart else (0,),
    )
    return ParamsApart(program) if apart else program


def resident_eval(
    step: Callable[..., Any], replicated: jax.sharding.Sharding, batch: jax.sharding.Sharding
) -> Callable[[Any, Any, Any, Any, Rows], Any]:
    """``(variables, acc, data, indices, rows) -> metrics``: the compiled
    evaluation ``step`` on one batch of a dataset resident on the devices, its
    rows gathered (`_gather`) in the same dispatch, as `resident_step` trains
    one: no gather program of its own to compile, nor to dispatch per batch."""
    gathered = _gathering(step, batch, "jl_eval_step")
    return jax.jit(gathered, in_shardings=(None, None, replicated, batch, batch))
