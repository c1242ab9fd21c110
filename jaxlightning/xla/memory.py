"""Will the train step fit on a device? The budget from the compiled step.

XLA's memory analysis of the compiled train step (`cost.StepCost`) says what
one device holds while the step runs: its inputs, its outputs that are not
donated inputs, and the arena of its temporaries. `budget` splits the inputs
by what they are, from the sizes of the state's leaves on one device:
parameters, optimizer state, one batch shard's data, and the rest: the other
state (step, random key, model state such as BatchNorm statistics, gradient
sums under accumulation), the metric accumulators and the rows' mask (inputs
the step never reads are dropped by XLA and count in none). The temporaries
are what the step computes: gradients, activations kept for the backward pass,
the optimizer's intermediate values. Nothing runs: the figures come from shapes and XLA.

A fit whose budget exceeds the device's memory (the device's own report, or
``Trainer(device_memory=...)``) stops before its first step with the table and
the fixes XLA was asked about (`MemoryBudgetError`), each compiled from shapes
at its own settings: a smaller batch per step with more accumulation, so an
update still sees as many examples, and, for a data-parallel run on several
devices, FSDP (each device keeps a share of the parameters, gradients and
optimizer state).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax

from jaxlightning.xla.cost import StepCost


class MemoryBudgetError(RuntimeError):
    """The train step needs more memory than a device has (found before it ran)."""


class DatasetDoesNotFit(MemoryBudgetError):
    """The train step fits a device, but not beside the dataset's copy kept
    there (``data_on_device``): under ``"auto"`` the fit takes its batches from
    the host instead."""

    def __init__(self, message: str, found: MemoryBudget) -> None:
        super().__init__(message)
        self.found = found


@dataclasses.dataclass(frozen=True)
class Fix:
    """A change XLA was asked about: ``what`` to pass, and the peak it gives."""

    what: str
    peak_bytes: int

    def saves(self, peak_bytes: int) -> int:
        return peak_bytes - self.peak_bytes


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """One device's memory during one train step, in bytes.

    Attributes:
        params, optimizer: the parameters and the optimizer state on one
            device (their shards under FSDP).
        other_state: the rest of XLA's inputs: the other state (step, random
            key, model state, gradient sums under accumulation), the metric
            accumulators and the rows' mask.
        batch: one batch shard's data.
        temporaries: XLA's temporaries: gradients, activations, intermediates.
        outputs: outputs that are not donated inputs (XLA's outputs less its
            aliased bytes).
        peak: XLA's peak for the step (at least the sum of the above).
        limit: the device's memory (``None``: not known, nothing checked).
        fixes: changes that fit, smallest total first (only when this does not).
        resident: the dataset's copy a device keeps beside the step
            (``data_on_device``; 0 where batches come from the host).
    """

    params: int
    optimizer: int
    other_state: int
    batch: int
    temporaries: int
    outputs: int
    peak: int
    limit: int | None = None
    fixes: tuple[Fix, ...] = ()
    resident: int = 0

    @property
    def total(self) -> int:
        """What a device holds at the step's peak: the step's and the dataset's."""
        return self.peak + self.resident

    @property
    def fits(self) -> bool:
        return self.limit is None or self.total <= self.limit

    def rows(self) -> list[tuple[str, int]]:
        return [
            ("parameters", self.params),
            ("optimizer state", self.optimizer),
            ("other state, accumulators, row mask", self.other_state),
            ("batch shard", self.batch),
            ("temporaries (gradients, activations)", self.temporaries),
            ("outputs not donated", self.outputs),
        ] + ([("dataset kept on the device", self.resident)] if self.resident else [])

    def table(self) -> str:
        """The budget as lines of text, the fixes ranked by bytes saved."""
        lines = ["Train step memory per device (XLA, nothing run):"]
        lines += [f"  {name:<40}{_size(n):>12}" for name, n in self.rows()]
        lines.append(f"  {'peak':<40}{_size(self.peak):>12}")
        if self.resident:
            lines.append(f"  {'peak with the dataset':<40}{_size(self.total):>12}")
        if self.limit is not None:
            verdict = "fits" if self.fits else f"over by {_size(self.total - self.limit)}"
            lines.append(f"  {'device memory':<40}{_size(self.limit):>12}  ({verdict})")
        for i, fix in enumerate(self.fixes, 1):
            lines.append(
                f"  fix {i}: {fix.what}: peak {_size(fix.peak_bytes)} "
                f"(saves {_size(fix.saves(self.total))})"
            )
        return "\n".join(lines)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def device_bytes(tree: Any) -> int:
    """Bytes of one device's part of ``tree`` (arrays or ``ShapeDtypeStruct`` s;
    a leaf with a sharding counts its shard, one without counts whole)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = tuple(leaf.shape)
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None and hasattr(sharding, "shard_shape"):
            shape = tuple(sharding.shard_shape(shape))
        total += math.prod(shape) * jax.numpy.dtype(leaf.dtype).itemsize
    return total


def budget(
    cost: StepCost, state: Any, batch: Any, limit: int | None, resident: int = 0
) -> MemoryBudget:
    """The `MemoryBudget` of a compiled step whose XLA count is ``cost``, called
    with ``state`` (shapes with their shardings) and a batch whose one-device
    share of data is ``batch`` (shapes): XLA's inputs less the parameters, the
    optimizer state and the data are the rest (`MemoryBudget.other_state`).
    ``resident``: the bytes of a dataset kept on the device beside the step."""
    params, optimizer = device_bytes(state.params), device_bytes(state.opt_state)
    batch_bytes = device_bytes(batch)
    other = cost.argument_bytes - params - optimizer - batch_bytes
    outputs = cost.output_bytes - cost.alias_bytes
    return MemoryBudget(
        params=params,
        optimizer=optimizer,
        other_state=other,
        batch=batch_bytes,
        temporaries=cost.temp_bytes,
        outputs=outputs,
        peak=cost.peak_bytes,
        limit=limit,
        resident=resident,
    )


def with_fixes(
    found: MemoryBudget, candidates: list[tuple[str, Callable[[], int | None]]]
) -> MemoryBudget:
    """``found`` with those of ``candidates`` (``(what to pass, what a device
    would hold with it, on demand)``) that fit, most bytes saved first. A
    candidate whose bytes cannot be had (``None``) is left out."""
    fixes = []
    for what, peak_at in candidates:
        peak = peak_at()
        if peak is not None and (found.limit is None or peak <= found.limit):
            fixes.append(Fix(what, peak))
    return dataclasses.replace(found, fixes=tuple(sorted(fixes, key=lambda f: f.peak_bytes)))


def smaller_batch(
    rows: int, shards: int, accumulate: int, peak_at: Callable[[int, int], int | None], limit: int
) -> tuple[str, Callable[[], int | None]] | None:
    """The largest halving of a global batch of ``rows`` (``rows // k`` rows,
    ``accumulate * k`` batches per update, so an update sees as many examples,
    while a device keeps a row) whose peak ``peak_at(rows, accumulate)`` fits
    ``limit``, as a candidate for `with_fixes`; ``None`` when none fits."""
    k = 2
    while rows // k >= shards and rows % k == 0:
        peak = peak_at(rows // k, accumulate * k)
        if peak is not None and peak <= limit:
            what = (
                f"batch_size {rows // k} (global) with accumulate_grad_batches="
                f"{accumulate * k}, as many examples per update"
            )
            return what, lambda peak=peak: peak
        k *= 2
    return None


def device_limit(devices: list[jax.Device], given: int | None = None) -> int | None:
    """``given``, else the least memory any of ``devices`` says it holds
    (``None`` where one says nothing: the CPU)."""
    if given is not None:
        return given
    limits = []
    for device in devices:
        try:
            stats = device.memory_stats() or {}
        except Exception:  # not implemented by this backend
            return None
        if "bytes_limit" not in stats:
            return None
        limits.append(int(stats["bytes_limit"]))
    return min(limits) if limits else None
