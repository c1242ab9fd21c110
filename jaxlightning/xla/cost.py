"""What a compiled step costs, from XLA's own analysis of the program.

``compiled.cost_analysis()`` counts the floating-point operations of the
program one device runs and ``compiled.memory_analysis()`` its buffers: the
train step's inputs (the state, the accumulators, one batch shard), outputs,
temporaries and peak. Both are known once the step is compiled, before it ever
runs, so a model that will not fit is known before training starts.

What XLA's FLOP count leaves out, `step_cost` adds, reading the compiled
module's HLO text (milliseconds beside the compile):

* Loops. XLA counts the body of a ``while`` loop once, however many times it
  runs, and ``jax.lax.scan`` (so ``nn.scan``'d layers, ``jax.lax.fori_loop``
  with fixed bounds) lowers to one: a GPT whose 4 blocks are scanned read as
  3.5x fewer FLOPs than the same blocks unrolled. For each loop whose trip
  count ``n`` XLA found (the ``known_trip_count`` it records on the loop),
  ``n - 1`` more counts of its body are added, the body's FLOPs being XLA's own
  analysis of that computation alone (parsed back as a module of its own, with
  what it calls): every operation XLA counts is repeated, not only the matrix
  products. Nested loops multiply. The loop's condition (one comparison) stays
  counted once. A loop whose trip count XLA does not know
  (``jax.lax.while_loop`` on a data-dependent condition) stays counted once:
  `StepCost.loops_counted_once` says how many, `StepCost.describe` calls the
  figure a lower bound, and a warning says so.
* Library matrix products. On GPU, XLA hands larger matrix products to cuBLAS
  as custom calls, which its analysis counts as no FLOPs (a 4-block model of
  width 512 read as a third of its FLOPs on an H200, jax 0.11). Each custom
  call carrying a dot's dimension numbers is counted as that product,
  ``2 * |result| * |contracted dimensions|``, as many times as its loops run;
  not twice where XLA's count already holds it (judged by comparing XLA's
  figure with its analysis of the module without them).

The GPU plugin's client analyses no module of its own; bodies are then
analysed by the CPU client: the same analysis, which gave XLA's GPU figures
exactly for the modules checked. Other library calls (cuDNN convolutions and
attention, Pallas kernels) count as XLA counts them, as none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax

from jaxlightning.cluster.rank_zero import rank_zero_warn

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
        flops: floating-point operations of the step on one device: XLA's
            count, with each ``while`` loop's body counted as many times as the
            loop runs (XLA takes it once) and cuBLAS matrix products counted
            (XLA counts them as none); see the module's notes.
        argument_bytes: its inputs (train state, accumulators, batch shard).
        output_bytes: its outputs (what is donated back is counted in both).
        temp_bytes: temporaries (activations kept for the backward pass...).
        peak_bytes: the most memory the step holds at once: XLA's peak, or
            inputs + outputs that are not donated inputs + temporaries where
            that is more (the CPU backend's peak leaves temporaries out).
        alias_bytes: outputs that are donated inputs (written in place).
        loops_counted_once: ``while`` loops whose trip count could not be read
            (XLA did not find one, or the body could not be analysed): each is
            counted once, so ``flops`` is a lower bound when this is not 0.
    """

    flops: float
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    peak_bytes: int
    loops_counted_once: int = 0
    alias_bytes: int = 0

    def describe(self) -> str:
        """One line, e.g. ``0.15 GFLOP, peak 2.3 MiB (inputs 1.1 MiB, ...)``."""
        flops = f"{self.flops / 1e9:.3g} GFLOP"
        if self.loops_counted_once:
            flops = (
                f"at least {flops} ({self.loops_counted_once} loop(s) of unknown "
                "trip count counted once)"
            )
        return (
            f"{flops}, peak {_mib(self.peak_bytes)} (inputs "
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
    flops = float(costs.get("flops", 0.0))
    extra, uncounted = uncounted_flops(compiled, flops)
    if uncounted:
        rank_zero_warn(
            f"The compiled step has {uncounted} while loop(s) whose trip count is unknown "
            "(e.g. jax.lax.while_loop on a data-dependent condition) or whose body could not "
            "be analysed: each is counted once, so its FLOPs (and a ThroughputMonitor's MFU) "
            "are an undercount",
            stacklevel=2,
        )
    return StepCost(
        flops=flops + extra,
        argument_bytes=arguments,
        output_bytes=outputs,
        temp_bytes=temps,
        peak_bytes=int(peak),
        loops_counted_once=uncounted,
        alias_bytes=aliased,
    )


def uncounted_flops(compiled: Any, xla_flops: float) -> tuple[float, int]:
    """What XLA's count ``xla_flops`` of ``compiled`` leaves out: ``(flops to
    add, while loops left counted once)``. Loop bodies counted once, and
    library matrix products it counts as none (see the module's notes)."""
    try:
        executable = compiled.runtime_executable()
        (module, *_) = executable.hlo_modules()
        options = _hlo().HloPrintOptions()
        options.print_metadata = False  # smaller; large constants stay elided ({...})
        text = module.to_string(options)
    except Exception:  # no HLO modules from this jax: the loops are only counted
        try:
            text = compiled.as_text() or ""
        except Exception:
            return 0.0, 0
        return 0.0, sum(1 for line in text.splitlines() if _WHILE.search(line))
    analysis = _Analysis(executable.client)
    extra, uncounted, products_once, products = _Walk(text, analysis).entry()
    if products:  # all of them, as often as they run, less what XLA counted
        counted = analysis.counts_products(text, xla_flops, products_once)
        extra += products - (products_once if counted else 0.0)
    return extra, uncounted


def _private_xla() -> tuple[Any, Any] | None:
    """XLA's HLO parser and its cost analysis of one module: no public JAX API
    has them, so they come from jaxlib's private modules (the one exemption of
    the package's public-API rule, in tests/test_structure.py). Guarded: a jax
    that moves them gives ``None``, and every loop is then counted once, with
    the warning (tested)."""
    try:
        from jax._src.lib import _jax
        from jaxlib import _hlo

        _hlo.hlo_module_from_text, _hlo.HloPrintOptions, _jax.hlo_module_cost_analysis  # noqa: B018
    except Exception:
        return None
    return _hlo, _jax


def _hlo() -> Any:
    found = _private_xla()
    if found is None:
        raise ImportError("XLA's HLO module API is not where this version expected it")
    return found[0]


class _Analysis:
    """XLA's cost analysis of an HLO module given as text: by the executable's
    own client, or, where that client analyses no module of its own (the GPU
    plugin), by the CPU's: the same analysis (XLA's ``HloCostAnalysis``), which
    counts a custom call as no FLOPs."""

    def __init__(self, client: Any) -> None:
        self.clients = [client]
        with contextlib.suppress(Exception):  # no CPU backend (JAX_PLATFORMS without cpu)
            self.clients.append(jax.local_devices(backend="cpu")[0].client)

    def __call__(self, text: str) -> float:
        _hlo, _jax = _private_xla() or (None, None)
        if _hlo is None:
            raise ImportError("XLA's HLO module API is not where this version expected it")
        module = _hlo.hlo_module_from_text(text)
        while True:
            try:
                return float(_jax.hlo_module_cost_analysis(self.clients[0], module)["flops"])
            except Exception:
                if len(self.clients) == 1:
                    raise
                self.clients.pop(0)  # UNIMPLEMENTED by this client: the next one

    def counts_products(self, text: str, xla_flops: float, products: float) -> bool:
        """Whether ``xla_flops``, XLA's count of module ``text``, counts its
        library matrix products (``products`` FLOPs, each once): nearer the
        analysis of the text with them than without (it counts custom calls as
        none)."""
        try:
            without = self(_module_text(text))
        except Exception:  # cannot tell: XLA's count is left as it is
            return True
        return abs(xla_flops - without - products) < abs(xla_flops - without)


# A computation's first line (``%name (params) -> shape {`` or ``ENTRY %name ...``),
# a while loop, its trip count as XLA records it, computations an instruction calls
# (``calls=%f``, ``to_apply=%r``, ``branch_computations={%a, %b}``...), an
# instruction's name and shape, a library matrix product (cuBLAS: a custom call
# with the dimension numbers of a dot), and a constant printed without its value.
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_WHILE = re.compile(r"\swhile\(.*\bbody=%?([\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(-?\d+)"\}')
_CALLED = re.compile(r"=%([\w.\-]+)|=\{(%[^}]*)\}")
_DEFINED = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = \(?[a-z]\w*\[([\d,]*)\]")
_PRODUCT = re.compile(
    r" custom-call\(%([\w.\-]+),.*\"dot_dimension_numbers\":\{\"lhs_contracting_dimensions\":"
    r"\[([^\]]*)\]"
)
_ELIDED = re.compile(
    r"^(\s*)(ROOT )?%([\w.\-]+) = ([a-z]\w*\[[^\]]*\](?:\{[^}]*\})?) constant\(\{\.\.\.\}\)"
)


class _Walk:
    """An HLO module's text, walked from its entry: each while loop with a
    known trip count ``n`` adds ``n - 1`` times XLA's count of its body, plus
    ``n`` times what the body's own loops add; library matrix products are
    counted once each (as a count that took loop bodies once would) and as
    many times as their loops run."""

    def __init__(self, text: str, analysis: Callable[[str], float]) -> None:
        self.analysis = analysis
        self.lines: dict[str, list[str]] = {}  # computation -> its lines, header first
        self.entry_name = ""
        current: list[str] | None = None
        for line in text.splitlines():
            if current is None:
                header = _HEADER.match(line)
                if header:
                    current = self.lines[header.group(1)] = [line]
                    if line.startswith("ENTRY "):
                        self.entry_name = header.group(1)
            elif line.rstrip() == "}":
                current.append(line)
                current = None
            else:
                current.append(line)
        self.order = {name: i for i, name in enumerate(self.lines)}
        self.memo: dict[str, tuple[float, int, float, float]] = {}

    def entry(self) -> tuple[float, int, float, float]:
        """``(loop flops to add, loops counted once, library products' flops
        with loop bodies once, the same with loop bodies as often as they run)``."""
        if self.entry_name not in self.lines:
            return 0.0, 0, 0.0, 0.0
        return self._walk(self.entry_name, ())

    def _called(self, line: str) -> list[str]:
        names = []
        for single, several in _CALLED.findall(line):
            for name in [single] if single else re.findall(r"%([\w.\-]+)", several):
                if name in self.lines:
                    names.append(name)
        return names

    def _walk(self, name: str, path: tuple[str, ...]) -> tuple[float, int, float, float]:
        if name in self.memo:
            return self.memo[name]
        if name in path:  # not in valid HLO; keeps a malformed text from recursing
            return 0.0, 0, 0.0, 0.0
        path = (*path, name)
        extra, uncounted, once, every = 0.0, 0, 0.0, 0.0
        shapes: dict[str, list[int]] = {}
        for line in self.lines[name][1:]:
            defined = _DEFINED.match(line)
            if defined:
                shape = [int(d) for d in defined.group(2).split(",") if d]
                shapes[defined.group(1)] = shape
                product = _PRODUCT.search(line)
                if product and product.group(1) in shapes:
                    flops = _product_flops(shape, shapes[product.group(1)], product.group(2))
                    once, every = once + flops, every + flops
            loop = _WHILE.search(line)
            if loop is None:
                called = [self._walk(c, path) for c in self._called(line)]
                if " conditional(" in line and called:  # one branch runs: XLA takes the max
                    called = [tuple(max(parts) for parts in zip(*called, strict=True))]  # type: ignore[misc]
                for more, unknown, more_once, more_every in called:
                    extra, uncounted = extra + more, uncounted + int(unknown)
                    once, every = once + more_once, every + more_every
                continue
            body = loop.group(1)
            if body not in self.lines:
                uncounted += 1
                continue
            inner, unknown, inner_once, inner_every = self._walk(body, path)
            trips = _TRIPS.search(line)
            counted = None
            if trips is not None:
                try:
                    counted = int(trips.group(1)), self.analysis(_module_text(self, body))
                except Exception:  # a body the parser refuses: counted once
                    counted = None
            once += inner_once
            if counted is None:  # counted once, its own loops' extra counts with it
                extra, uncounted = extra + inner, uncounted + unknown + 1
                every += inner_every
            else:
                n, each = counted
                extra += (n - 1) * each + n * inner
                uncounted += unknown
                every += n * inner_every
        self.memo[name] = (extra, uncounted, once, every)
        return self.memo[name]


def _product_flops(result: list[int], lhs: list[int], contracting: str) -> float:
    """A matrix product's FLOPs: 2 per multiply-add, ``2 * |result| * |contracted|``."""
    flops = 2.0
    for d in result:
        flops *= d
    for i in re.findall(r"\d+", contracting):
        flops *= lhs[int(i)] if int(i) < len(lhs) else 1
    return flops


def _module_text(source: _Walk | str, name: str | None = None) -> str:
    """A module's text ready to parse: the whole of ``source``, or its
    computation ``name`` as the entry of a module of its own with what it
    calls; constants printed without their values get zeros."""
    if isinstance(source, str):
        return "\n".join(_value_free(line) for line in source.splitlines())
    needed, todo = {name}, [name]
    while todo:
        for line in source.lines[todo.pop()][1:]:
            for called in source._called(line):
                if called not in needed:
                    needed.add(called)
                    todo.append(called)
    parts = ["HloModule loop_body", ""]
    for comp in sorted(needed, key=source.order.__getitem__):
        lines = [_value_free(line) for line in source.lines[comp]]
        header = lines[0].removeprefix("ENTRY ")
        lines[0] = f"ENTRY {header}" if comp == name else header
        parts += [*lines, ""]
    return "\n".join(parts)


def _value_free(line: str) -> str:
    """A constant printed without its value (``constant({...})``) as a zero
    broadcast to its shape: the same FLOPs (none), and parseable."""
    match = _ELIDED.match(line)
    if match is None:
        return line
    indent, root, name, shape = match.groups()
    element = shape.split("[", 1)[0]
    return (
        f"{indent}%{name}.zero = {element}[] constant(0)\n"
        f"{indent}{root or ''}%{name} = {shape} broadcast(%{name}.zero), dimensions={{}}"
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
