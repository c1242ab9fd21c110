"""What a compiled step costs, from XLA's own analysis of the program.

``compiled.cost_analysis()`` counts the floating-point operations of the
program one device runs and ``compiled.memory_analysis()`` its buffers: the
train step's inputs (the state, the accumulators, one batch shard), outputs,
temporaries and peak. Both are known once the step is compiled, before it ever
runs, so a model that will not fit is known before training starts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

# Peak dense bfloat16 FLOP/s of one device, by a fragment of `device_kind`
# (vendors' data sheets), for the model FLOPs utilisation. First match wins.
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("V100", 125e12),  # float16 tensor cores
    ("TPU v5p", 459e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5e", 197e12),
    ("TPU v4", 275e12),
    ("TPU v6", 918e12),
)


@dataclasses.dataclass(frozen=True)
class StepCost:
    """One device's share of one compiled step.

    Attributes:
        flops: floating-point operations of the step on one device.
        argument_bytes: its inputs (train state, accumulators, batch shard).
        output_bytes: its outputs (what is donated back is counted in both).
        temp_bytes: temporaries (activations kept for the backward pass...).
        peak_bytes: the most memory the step holds at once: XLA's peak, or
            inputs + outputs that are not donated inputs + temporaries where
            that is more (the CPU backend's peak leaves temporaries out).
    """

    flops: float
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    peak_bytes: int

    def describe(self) -> str:
        """One line, e.g. ``0.15 GFLOP, peak 2.3 MiB (inputs 1.1 MiB, ...)``."""
        return (
            f"{self.flops / 1e9:.3g} GFLOP, peak {_mib(self.peak_bytes)} (inputs "
            f"{_mib(self.argument_bytes)}, temporaries {_mib(self.temp_bytes)}, outputs "
            f"{_mib(self.output_bytes)})"
        )


def _mib(n: int) -> str:
    return f"{n / 2**20:.3g} MiB"


def step_cost(compiled: Any) -> StepCost | None:
    """The `StepCost` of a ``jax.stages.Compiled``; ``None`` where the backend
    does not analyse its programs."""
    try:
        costs = compiled.cost_analysis()
        memory = compiled.memory_analysis()
    except Exception:  # not implemented by this backend or jax version
        return None
    if isinstance(costs, (list, tuple)):  # older jax: one dict per program
        costs = costs[0] if costs else {}
    if not costs or memory is None:
        return None
    arguments = int(memory.argument_size_in_bytes)
    outputs = int(memory.output_size_in_bytes)
    temps = int(memory.temp_size_in_bytes)
    aliased = int(getattr(memory, "alias_size_in_bytes", 0))
    # What the executable holds: its inputs, its outputs that are not donated
    # inputs, and its temporaries' arena (already sized for their lifetimes).
    # The CPU backend's own peak leaves the temporaries out.
    reserved = arguments + outputs - aliased + temps
    peak = max(int(getattr(memory, "peak_memory_in_bytes", 0) or 0), reserved)
    return StepCost(
        flops=float(costs.get("flops", 0.0)),
        argument_bytes=arguments,
        output_bytes=outputs,
        temp_bytes=temps,
        peak_bytes=int(peak),
    )


def cost_of(jitted: Any, *args: Any) -> StepCost | None:
    """The `StepCost` of a jitted function for ``args`` (arrays or
    ``jax.ShapeDtypeStruct`` with their shardings), compiled ahead of time:
    JAX's cache then serves a call with the same shapes, so nothing compiles
    twice. ``None`` for a function with no ahead-of-time path (``pmap``)."""
    if not hasattr(jitted, "trace"):
        return None
    return step_cost(jitted.trace(*args).lower().compile())


def peak_flops(device: jax.Device) -> float | None:
    """Peak dense bfloat16 FLOP/s of ``device`` from `PEAK_FLOPS`, if known."""
    kind = getattr(device, "device_kind", "")
    for fragment, flops in PEAK_FLOPS:
        if fragment.lower() in kind.lower():
            return flops
    return None
