"""What ``self.log`` records: options per name, and exact reductions on device. Traced code.

A value logged in a traced hook becomes a `clu.metrics` state over the real
(unmasked) rows of one device's shard: `Average` for ``reduce_fx="mean"``,
`Total` for ``"sum"``, `Extreme` for ``"max"``/``"min"``; a metric object
(`F1Score`, `AUROC`, ... from `jaxlightning.metrics.objects`, re-exported here)
gives its own state of sums. States merge across steps on device and reduce
across devices inside the step (``psum``; ``pmax`` or ``pmin`` only for
extremes), so the host fetches exact values only when it reports them. How the
host names and routes them is `LogOptions`' business.
"""

from __future__ import annotations

import builtins
import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from clu import metrics as clu_metrics

from jaxlightning.metrics.objects import (
    MetricObject,
    MetricSpec,
    Rows,
)

REDUCTIONS = ("mean", "sum", "max", "min")


def _reducing_callables() -> dict[Any, str]:
    """The functions Lightning takes as ``reduce_fx`` (Python's, NumPy's, JAX's,
    and torch's where torch is already imported), by the reduction they make."""
    found: dict[Any, str] = {builtins.sum: "sum", builtins.max: "max", builtins.min: "min"}
    for lib in (np, jnp, sys.modules.get("torch")):
        for name in REDUCTIONS:
            if lib is not None and callable(fn := getattr(lib, name, None)):
                found[fn] = name
    found.update({np.amax: "max", np.amin: "min"})
    return found


def reduction(reduce_fx: Any) -> str | None:
    """The reduction ``reduce_fx`` names, as Lightning reads it: a string in any
    case (``"avg"`` is ``"mean"``) or one of the reducing functions (``max``,
    ``torch.max``, ``np.mean``, ...); ``None`` for anything else."""
    if isinstance(reduce_fx, str):
        name = reduce_fx.lower()
        name = "mean" if name == "avg" else name
        return name if name in REDUCTIONS else None
    try:
        return _reducing_callables().get(reduce_fx)
    except TypeError:  # unhashable
        return None


@dataclasses.dataclass(frozen=True)
class LogOptions:
    """How one logged name is reduced and reported (Lightning's ``self.log`` keywords).

    Attributes:
        on_step: report per logging interval (training), per batch (evaluation).
        on_epoch: report the reduction over the whole epoch / evaluation run.
        prog_bar: show it in the progress bar.
        logger: send it to the loggers (``callback_metrics`` always has it).
        reduce_fx: ``"mean"``, ``"sum"``, ``"max"`` or ``"min"`` over real rows.
        add_dataloader_idx: with several evaluation loaders, name it
            ``<name>/dataloader_idx_N``.
        metric: a metric object's class and settings, when the value is one
            (its empty state's shapes depend on them).
        hidden: a value the Trainer keeps for its own checks (the training
            loss without ``log_loss``): accumulated, reported nowhere.
    """

    on_step: bool
    on_epoch: bool
    prog_bar: bool = False
    logger: bool = True
    reduce_fx: str = "mean"
    add_dataloader_idx: bool = True
    metric: MetricSpec | None = None
    hidden: bool = False


Average = clu_metrics.Average


@flax.struct.dataclass
class Total(clu_metrics.Average):
    """A sum over real rows (``reduce_fx="sum"``): an `Average` that reports its total."""

    def compute(self) -> Any:
        return self.total


@flax.struct.dataclass
class ScalarSum(clu_metrics.Metric):
    """One step's scalar logged with ``reduce_fx="sum"``, on its way to a `Total`:
    the device's value times its real rows, and those rows. Summed across the
    devices, `settle` makes the row-weighted mean of the devices' values count
    once for the step (a constant 1 sums to the number of steps, as in Lightning)."""

    weighted: jax.Array
    rows: jax.Array

    def settled(self) -> Total:
        seen = self.rows > 0
        value = jnp.where(seen, self.weighted / jnp.maximum(self.rows, 1), 0.0)
        return Total(total=value.astype(jnp.float32), count=seen.astype(jnp.int32))


@flax.struct.dataclass
class Extreme(clu_metrics.Metric):
    """The largest (``op="max"``) or smallest value over real rows, and their count."""

    value: jax.Array
    count: jax.Array
    op: str = flax.struct.field(pytree_node=False, default="max")

    def merge(self, other: Extreme) -> Extreme:
        pick = jnp.maximum if self.op == "max" else jnp.minimum
        return self.replace(value=pick(self.value, other.value), count=self.count + other.count)

    def compute(self) -> Any:
        return self.value


def _fill(op: str) -> float:
    return -np.inf if op == "max" else np.inf


def zero(options: LogOptions) -> clu_metrics.Metric:
    """The empty state of a name logged with ``options`` (host numpy arrays)."""
    if options.metric is not None:
        return options.metric.empty()
    count = np.zeros((), np.int32)
    if options.reduce_fx in ("max", "min"):
        value = np.asarray(_fill(options.reduce_fx), np.float32)
        return Extreme(value=value, count=count, op=options.reduce_fx)
    cls = Total if options.reduce_fx == "sum" else Average
    return cls(total=np.zeros((), np.float32), count=count)


def from_logged(name: str, value: Any, mask: jax.Array, options: LogOptions) -> Any:
    """One shard's state of a logged scalar, per-example ``value`` or metric object.

    A scalar counts once per real row (so a scalar mean of the shard averages
    exactly across devices), except for ``"sum"``: a `ScalarSum`, to be
    settled after the sum across devices; a per-example vector counts its real
    rows; a `MetricObject` gives its state over the real rows.
    """
    if isinstance(value, MetricObject):
        if value.rows != mask.shape[0]:
            raise ValueError(
                f"self.log({name!r}, {value!r}) got inputs of {value.rows} rows but this "
                f"device's shard has {mask.shape[0]}; give it one row per example of the "
                "batch the hook sees"
            )
        return value.state(mask)
    value = jnp.asarray(value)
    scalar = value.ndim == 0
    if scalar:
        value = jnp.broadcast_to(value, mask.shape)
    elif value.shape != mask.shape:
        raise ValueError(
            f"self.log({name!r}, ...) got an array of shape {value.shape}; log a scalar "
            f"or a per-example vector of shape {mask.shape} (this device's shard)"
        )
    value = value.astype(jnp.float32)
    count = mask.sum(dtype=jnp.int32)
    if options.reduce_fx in ("max", "min"):
        masked = jnp.where(mask, value, _fill(options.reduce_fx))
        pick = jnp.max if options.reduce_fx == "max" else jnp.min
        return Extreme(value=pick(masked), count=count, op=options.reduce_fx)
    if options.reduce_fx == "sum":
        if scalar:
            return ScalarSum(weighted=value[0] * count, rows=count)
        return Total(total=jnp.where(mask, value, 0).sum(), count=count)
    return Average.from_model_output(value, mask=mask)


def across_devices(axis: str, metrics: Mapping[str, Any], tree: Any = None) -> Any:
    """``(tree, metrics)`` summed across the devices of ``axis``, extremes taken
    with ``pmax``/``pmin``, rank metrics' `Rows` gathered: one collective for
    the sums, one per kind of extreme used, one gather. A no-op on one device
    (XLA keeps a one-device all-reduce, which costs a copy of every gradient and
    blocks fusing it into the update)."""
    if jax.lax.axis_size(axis) == 1:
        return tree, dict(metrics)
    sums = {n: m for n, m in metrics.items() if not isinstance(m, (Extreme, Rows))}
    extremes = {n: m for n, m in metrics.items() if isinstance(m, Extreme)}
    rows = {n: m for n, m in metrics.items() if isinstance(m, Rows)}
    counts = {n: m.count for n, m in (extremes | rows).items()}
    tree, sums, counts = jax.lax.psum((tree, sums, counts), axis)
    reduced = dict(sums)
    if rows:  # every device's rows, in device order (a rank metric's state)
        gathered = jax.lax.all_gather(
            {n: (m.preds, m.target, m.mask) for n, m in rows.items()}, axis, tiled=True
        )
        reduced.update(
            {
                n: m.replace(preds=p, target=t, mask=k, count=counts[n])
                for (n, m), (p, t, k) in zip(rows.items(), gathered.values(), strict=True)
            }
        )
    for op, collective in (("max", jax.lax.pmax), ("min", jax.lax.pmin)):
        group = {n: m for n, m in extremes.items() if m.op == op}
        if group:
            values = collective({n: m.value for n, m in group.items()}, axis)
            reduced.update(
                {n: m.replace(value=values[n], count=counts[n]) for n, m in group.items()}
            )
    return tree, {n: reduced[n] for n in metrics}


def settle(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """``metrics`` reduced across devices, with every `ScalarSum` settled into
    the `Total` it accumulates in."""
    return {n: m.settled() if isinstance(m, ScalarSum) else m for n, m in metrics.items()}


def host_value(metric: Any) -> float | np.ndarray | None:
    """A fetched state's value (a number; an array for `ConfusionMatrix`), or
    ``None`` when it saw no real row."""
    if int(metric.count) == 0:
        return None
    value = np.asarray(metric.compute())
    return float(value) if value.ndim == 0 else value


def monitored(value: Any, who: str) -> float:
    """A monitored value as a number; an array (a `ConfusionMatrix`) raises
    naming ``who`` (``"EarlyStopping(monitor='val/cm')"``)."""
    if np.ndim(value) != 0:
        raise ValueError(
            f"{who}: the value has shape {np.shape(value)}; monitor a number (a metric "
            "object whose value is one, such as F1Score or AUROC)"
        )
    return float(value)
