"""Host side of ``self.log``: the names values are reported under, and where they go.

Pure Python over fetched metric states, no JAX: given what was logged with
which `LogOptions`, builds the values for ``callback_metrics``, the loggers and
the progress bar, with Lightning's naming.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxlightning.metrics import LogOptions, host_value

# Words that mark a name as already carrying its stage: `val_loss`, `val/acc`.
_STAGE_WORDS = {"train": ("train",), "val": ("val", "valid", "validation"), "test": ("test",)}


def full_name(prefix: str, name: str) -> str:
    """``prefix/name`` (``train/acc``), or ``name`` as written when it already
    carries its stage (``val_loss``, ``val/acc``), as in Lightning scripts."""
    for word in _STAGE_WORDS.get(prefix, (prefix,)):
        if name.startswith((word + "_", word + "/")):
            return name
    return f"{prefix}/{name}"


@dataclasses.dataclass
class Report:
    """Values to hand out: ``values`` to ``callback_metrics`` (all of them),
    ``logged`` to the loggers, ``bar`` to the progress bar."""

    values: dict[str, float] = dataclasses.field(default_factory=dict)
    logged: dict[str, float] = dataclasses.field(default_factory=dict)
    bar: dict[str, float] = dataclasses.field(default_factory=dict)

    def update(self, other: Report) -> None:
        self.values.update(other.values)
        self.logged.update(other.logged)
        self.bar.update(other.bar)


def report(
    prefix: str,
    options: Mapping[str, LogOptions],
    metrics: Mapping[str, Any],
    level: str,
    suffix: str = "",
) -> Report:
    """The ``level`` (``"step"`` or ``"epoch"``) values of fetched ``metrics``.

    A name logged both per step and per epoch is reported as ``<name>_step``
    and ``<name>_epoch``, as in Lightning; ``callback_metrics`` also gets the
    plain name with the latest of the two. Names that saw no real row are
    left out.
    """
    out = Report()
    for name, metric in metrics.items():
        opts = options[name]
        if not (opts.on_step if level == "step" else opts.on_epoch):
            continue
        value = host_value(metric)
        if value is None:
            continue
        plain = full_name(prefix, name) + suffix
        key = plain + (f"_{level}" if opts.on_step and opts.on_epoch else "")
        out.values[key] = out.values[plain] = value
        if opts.logger:
            out.logged[key] = value
        if opts.prog_bar:
            out.bar[key] = value
    return out
