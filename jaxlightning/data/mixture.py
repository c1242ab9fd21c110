"""Several grain streams mixed by weights that may change during training.

grain's own ``IterDataset.mix`` keeps its weights for good; a curriculum (more
code later, less web text) needs them to change at given steps, and a resumed
run must draw exactly what the uninterrupted one drew. Here the source of row
``k`` is a pure function of the seed, ``k`` and the weights in force at that
row's batch, so the iterator's state is just ``k`` and each source's own state:
a checkpoint resumes the draw at the exact row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def _checked(
    schedule: Sequence[tuple[int, Sequence[float]]], n: int
) -> list[tuple[int, np.ndarray]]:
    steps = [int(step) for step, _ in schedule]
    if not schedule or steps[0] != 0 or steps != sorted(set(steps)):
        raise ValueError(
            f"mixture schedule {list(schedule)!r}: give (step, weights) pairs with rising "
            "steps, the first at step 0"
        )
    checked = []
    for step, weights in schedule:
        w = np.asarray(weights, np.float64)
        if w.shape != (n,) or (w < 0).any() or w.sum() <= 0:
            raise ValueError(
                f"mixture weights {list(weights)!r} at step {step}: give {n} non-negative "
                "weights (one per source), not all zero"
            )
        checked.append((int(step), w / w.sum()))
    return checked


def scheduled_mixture(
    sources: Sequence[Any],
    schedule: Sequence[tuple[int, Sequence[float]]],
    *,
    rows_per_step: int,
    seed: int = 0,
) -> Any:
    """A grain ``IterDataset`` drawing each row from one of ``sources`` (grain
    ``IterDataset``s, endless: ``.repeat()``) by the weights of ``schedule``.

    Args:
        sources: the streams to mix.
        schedule: ``[(0, weights), (step, weights), ...]``: from each step on
            (a step is ``rows_per_step`` rows: batches of this process), the
            weights in force; ``[(0, [0.7, 0.3])]`` is a fixed mixture.
        rows_per_step: rows in one step's batch on this process.
        seed: the draw's seed.
    """
    import grain  # the mixture is of grain streams: grain is installed

    table = _checked(schedule, len(sources))

    class Iterator(grain.DatasetIterator):
        def __init__(self, parents: list[Any]) -> None:
            super().__init__(parents)
            self._row = 0

        def _source(self, row: int) -> int:
            step = row // rows_per_step
            weights = next(w for start, w in reversed(table) if start <= step)
            draw = np.random.default_rng([seed, row]).random()
            return int(
                np.searchsorted(np.cumsum(weights), draw, side="right").clip(0, len(weights) - 1)
            )

        def __next__(self) -> Any:
            source = self._source(self._row)
            self._row += 1
            return next(self._parents[source])

        def get_state(self) -> dict[str, Any]:
            return {"row": self._row, "sources": [p.get_state() for p in self._parents]}

        def set_state(self, state: dict[str, Any]) -> None:
            self._row = int(state["row"])
            for parent, saved in zip(self._parents, state["sources"], strict=True):
                parent.set_state(saved)

    class Mixture(grain.IterDataset):
        def __iter__(self) -> Any:
            return Iterator([iter(p) for p in self._parents])

        def __str__(self) -> str:
            return f"scheduled_mixture({len(sources)} sources, {len(table)} phases)"

    return Mixture(list(sources))
