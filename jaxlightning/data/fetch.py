"""Per-example batches fetched by the Trainer itself, as a DataLoader fetches them.

A DataLoader that reads in its own process (``num_workers=0``) gets each batch
by ``dataset.__getitems__(indices)`` where the dataset has it, else a
``dataset[i]`` per index, then its ``collate_fn``. Around that its iterator
adds a profiler scope, a sampler iterator and bookkeeping per batch (~30 us
on 2 CPU cores), host time that a CPU backend takes from the cores the step
runs on. `FetchedEpoch` fetches the same indices the same way without it, for
a loader whose order the Trainer owns (`sampling.OwnedOrder`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, default_collate


def fetchable(loader: DataLoader) -> bool:
    """Whether the Trainer can fetch ``loader``'s batches itself: it reads in
    the calling process, without pinning, from a dataset that is not a DataPipe
    (whose sharding the DataLoader's iterator applies)."""
    datapipe = getattr(torch.utils.data, "MapDataPipe", ())
    return (
        loader.num_workers == 0
        and not loader.pin_memory
        and loader.timeout == 0
        and not isinstance(loader.dataset, datapipe)
    )


class Fetch(NamedTuple):
    """What fetching a DataLoader's batches takes (not the loader itself: the
    Trainer keeps this while the user keeps the loader, which it must not pin)."""

    dataset: Any
    collate: Callable[[list[Any]], Any]
    generator: torch.Generator | None

    @classmethod
    def of(cls, loader: DataLoader) -> Fetch:
        return cls(loader.dataset, loader.collate_fn, loader.generator)


def _dense(value: Any) -> bool:
    """A plain dense tensor (default_collate refuses sparse and nested ones)."""
    return type(value) is torch.Tensor and value.layout is torch.strided and not value.is_nested


def stacked(samples: list[Any]) -> Any:
    """``default_collate(samples)`` for samples that are tuples of tensors, by
    one ``torch.stack`` per field: what default_collate ends in, without its
    dispatch and per-sample checks (2 cores: ~8 us of ~64 for 128 samples of
    two tensors; for dicts the same shortcut measured no faster). Anything
    else, and any mismatch between the samples, goes to default_collate
    itself, so its results and its errors stay its own."""
    first = samples[0] if samples else None
    try:
        if type(first) is tuple and all(map(_dense, first)):
            # default_collate gives a tuple's fields as a list
            return [torch.stack(field) for field in zip(*samples, strict=True)]
    except (TypeError, ValueError, RuntimeError):
        pass  # a sample unlike the first: default_collate says what is wrong
    return default_collate(samples)


class FetchedEpoch:
    """An epoch's batches of a `fetchable` DataLoader's dataset, one per array
    of row indices of ``batches`` (`sampling.EpochBatches`).

    Each batch is ``collate(dataset.__getitems__(indices))`` (or a
    ``dataset[i]`` per index) with the indices as Python ints, as the
    DataLoader's own fetcher has it.
    Its iteration starts with the draw from torch's random generator (the
    loader's, else the global one) that a DataLoader iteration makes, so a
    Dataset that draws from it sees the numbers it saw under the DataLoader.
    """

    def __init__(self, fetch: Fetch, batches: Iterable[np.ndarray]) -> None:
        self.dataset, self.collate, self.generator = fetch
        if self.collate is default_collate:
            self.collate = stacked
        self.batches = batches
        # the loader's (the batches are padded to it: a resumed epoch may start short)
        self.batch_size: int | None = getattr(batches, "batch_size", None)

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        # the base seed a DataLoader iterator draws when it starts
        torch.empty((), dtype=torch.int64).random_(generator=self.generator)
        dataset, collate = self.dataset, self.collate
        many = getattr(dataset, "__getitems__", None)
        for rows in self.batches:
            indices = rows.tolist()
            yield collate(many(indices) if many else [dataset[i] for i in indices])
