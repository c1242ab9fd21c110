"""Reported values and their names: pure Python over fetched metric states.

`report` builds, from what was logged with which `LogOptions`, the values for
``callback_metrics``, the loggers and the progress bar, with Lightning's
naming; `full_name` is the name a value is reported under.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxlightning.metrics.logged import LogOptions, host_value

# Words that mark a name as already carrying its stage: `val_loss`, `val/acc`.
_STAGE_WORDS = {"train": ("train",), "val": ("val", "valid", "validation"), "test": ("test",)}


def full_name(prefix: str | None, name: str) -> str:
    """The name a logged value is reported under: as logged (``prefix=None``,
    Lightning's rule, the default), or ``prefix/name`` (``train/acc``) under
    ``Trainer(stage_prefix=True)``, where a name that already carries its stage
    (``val_loss``, ``val/acc``) stays as written."""
    if prefix is None:
        return name
    for word in _STAGE_WORDS.get(prefix, (prefix,)):
        if name.startswith((word + "_", word + "/")):
            return name
    return f"{prefix}/{name}"


@dataclasses.dataclass
class Report:
    """Values to hand out: ``values`` to ``callback_metrics`` (all of them),
    ``logged`` to the loggers, ``bar`` to the progress bar; ``results`` is what
    an evaluation returns (Lightning's rule: the values logged with
    ``logger=True``, under the names the loggers get, matrices included)."""

    values: dict[str, Any] = dataclasses.field(default_factory=dict)
    logged: dict[str, float] = dataclasses.field(default_factory=dict)
    bar: dict[str, float] = dataclasses.field(default_factory=dict)
    results: dict[str, Any] = dataclasses.field(default_factory=dict)

    def update(self, other: Report) -> None:
        self.values.update(other.values)
        self.logged.update(other.logged)
        self.bar.update(other.bar)
        self.results.update(other.results)


def results_table(results: list[dict[str, Any]], title: str) -> str:
    """An evaluation's results as Lightning prints them: a column of metric
    names (``"Test metric"``), one column of values per loader."""
    names = sorted({name for values in results for name in values})
    header = [f"{title} metric", *(f"DataLoader {i}" for i in range(len(results)))]
    rows = [header] + [[name, *(_cell(values.get(name)) for values in results)] for name in names]
    widths = [max(len(row[i]) for row in rows) + 4 for i in range(len(header))]
    rule = "─" * sum(widths)
    lines = ["".join(cell.center(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join([rule, lines[0], rule, *lines[1:], rule])


def _cell(value: Any) -> str:
    if value is None:
        return ""
    return f"{value:.6g}" if isinstance(value, float) else "(an array)"


def report(
    prefix: str | None,
    options: Mapping[str, LogOptions],
    metrics: Mapping[str, Any],
    level: str,
    suffix: str = "",
) -> Report:
    """The ``level`` (``"step"`` or ``"epoch"``) values of fetched ``metrics``.

    A name logged both per step and per epoch is reported as ``<name>_step``
    and ``<name>_epoch``, as in Lightning; ``callback_metrics`` also gets the
    plain name with the latest of the two. Names that saw no real row, and
    the Trainer's hidden ones, are left out.
    """
    out = Report()
    for name, metric in metrics.items():
        opts = options[name]
        if opts.hidden or not (opts.on_step if level == "step" else opts.on_epoch):
            continue
        value = host_value(metric)
        if value is None:
            continue
        name = full_name(prefix, name)
        suffix_here = suffix if opts.add_dataloader_idx else ""
        plain = name + suffix_here
        # Lightning's order: the level, then the loader (`loss_epoch/dataloader_idx_0`)
        key = name + (f"_{level}" if opts.on_step and opts.on_epoch else "") + suffix_here
        out.values[key] = out.values[plain] = value
        if opts.logger:
            out.results[key] = value
        if not isinstance(value, float):
            continue  # a matrix: callback_metrics and results only (loggers take numbers)
        if opts.logger:
            out.logged[key] = value
        if opts.prog_bar:
            out.bar[key] = value
    return out
