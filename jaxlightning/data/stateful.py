"""Loaders that keep their own position: resumed from a saved iterator state.

A grain ``DataLoader`` (or ``IterDataset``, ``MapDataset``) iterates through
an iterator with ``get_state()`` / ``set_state(state)``: its position in the
data (and, for a shuffled sampler, which examples are left) without the data
itself. The Trainer notes that state after each batch it trains on, saves it
with a checkpoint (one per process) and gives it back to a fresh iterator on
resume: the run goes on at the next batch without reading the batches before it.
"""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any


def encode(state: Any) -> dict[str, Any]:
    """An iterator's state as JSON: grain's DataLoader gives bytes (JSON text
    itself), grain's dataset iterators a dict."""
    if isinstance(state, bytes):
        return {"base64": base64.b64encode(state).decode("ascii")}
    try:
        json.dumps(state)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"the data iterator's get_state() gave a {type(state).__name__} that cannot be "
            f"saved with a checkpoint ({exc}); it must be bytes or JSON values"
        ) from exc
    return {"json": state}


def decode(saved: dict[str, Any]) -> Any:
    if "base64" in saved:
        return base64.b64decode(saved["base64"])
    return saved["json"]


@dataclass(frozen=True)
class Stamped:
    """A batch with its iterator's state after it."""

    batch: Any
    state: dict[str, Any]


class StatefulPass:
    """One pass over a stateful loader, from ``state`` (the start when ``None``),
    each batch `Stamped` with the position after it."""

    def __init__(self, loader: Iterable[Any], state: dict[str, Any] | None = None) -> None:
        self.loader, self.state = loader, state

    def __iter__(self) -> Iterator[Stamped]:
        iterator = iter(self.loader)
        if self.state is not None:
            iterator.set_state(decode(self.state))  # type: ignore[attr-defined]
        for batch in iterator:
            yield Stamped(batch, encode(iterator.get_state()))  # type: ignore[attr-defined]


def iterates_statefully(loader: Any) -> bool:
    """Whether ``loader`` is a grain ``DataLoader``, ``IterDataset`` or
    ``MapDataset``, whose iterators have ``get_state``/``set_state`` (told by
    type: building an iterator of a DataLoader with workers would start them)."""
    grain = sys.modules.get("grain")  # not imported: not a grain loader
    if grain is None:
        return False
    return isinstance(loader, (grain.DataLoader, grain.IterDataset, grain.MapDataset))


def grain_data_loader() -> tuple[type, ...]:
    """grain's ``DataLoader`` class (as a tuple for ``isinstance``; empty when grain
    is not imported, so nothing is one)."""
    grain = sys.modules.get("grain")
    return () if grain is None else (grain.DataLoader,)
