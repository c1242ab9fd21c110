"""Deterministic data order owned by the Trainer: seeded per epoch, resumable.

A `torch.utils.data.DataLoader` with a plain random or sequential sampler is
rebuilt around an `EpochSampler`, so that the order of every epoch follows
from ``(seed, epoch)`` alone. A resumed run can then start an epoch at any
batch without loading the batches before it, and each process of a
multi-process run can take its own share.
"""

from __future__ import annotations

import itertools
import math
import multiprocessing
import sys
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    TensorDataset,
    default_collate,
)

from jaxlightning.data.arrays import ArrayDataset
from jaxlightning.data.convert import loader_batch_size, to_numpy
from jaxlightning.data.fetch import Fetch, FetchedEpoch, fetchable


class EpochSampler(Sampler[int]):
    """This process's indices of one epoch.

    The epoch's order is a permutation seeded by ``(seed, epoch)`` when
    shuffling, else dataset order. Process ``rank`` of ``replicas`` takes every
    ``replicas``-th index from position ``rank``: with a per-process batch size
    ``b``, global batch ``k`` (all processes' batch ``k`` together) then holds
    exactly positions ``[k*b*replicas, (k+1)*b*replicas)`` of the order, the
    same examples a single process with batch size ``b*replicas`` would see.
    Nothing is repeated: shares differ in size by at most one example.

    Args:
        num_samples: the dataset's length.
        shuffle: permute (else dataset order).
        seed: the run's seed.
        epoch: selects the permutation.
        start: leave out this process's first ``start`` indices (a resumed epoch).
        rank: this process's index.
        replicas: the number of processes.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        shuffle: bool,
        seed: int,
        epoch: int = 0,
        start: int = 0,
        rank: int = 0,
        replicas: int = 1,
    ) -> None:
        self.num_samples = num_samples
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = epoch
        self.start = start
        self.rank = rank
        self.replicas = replicas

    def order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.num_samples)

    def share(self, rank: int) -> np.ndarray:
        """The indices of process ``rank``'s share (before ``start``)."""
        return self.order()[rank :: self.replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.share(self.rank)[self.start :].tolist())

    def __len__(self) -> int:
        return max(len(range(self.rank, self.num_samples, self.replicas)) - self.start, 0)


def ownable(loader: Any) -> bool:
    """Whether the Trainer can rebuild ``loader`` around its own sampler."""
    return (
        type(loader) is DataLoader
        and not isinstance(loader.dataset, IterableDataset)
        and type(loader.batch_sampler) is BatchSampler
        and type(loader.sampler) in (RandomSampler, SequentialSampler)
        and loader.batch_size is not None
    )


def worker_start_method(num_workers: int) -> str | None:
    """The start method for DataLoader workers that the user left unset.

    ``"fork"`` on Linux, as Lightning and torch have it there (and Python had
    it before 3.14 made forkserver the default): a forkserver or spawn worker
    imports the user's main script again, with JAX, flax and torch (~20 s per
    start here), and a script without an ``if __name__ == "__main__":`` guard
    dies. The fork is made safe where it happens (`prefetch.start_on_caller`).
    Elsewhere (macOS, Windows) the platform's default stands.
    """
    if num_workers == 0 or not sys.platform.startswith("linux"):
        return None
    return "fork" if "fork" in multiprocessing.get_all_start_methods() else None


def set_worker_start(loader: Any) -> None:
    """Sets `worker_start_method` on a DataLoader with workers and no start
    method chosen (one the Trainer iterates as it is, without rebuilding it)."""
    if isinstance(loader, DataLoader) and loader.multiprocessing_context is None:
        method = worker_start_method(loader.num_workers)
        if method is not None:
            loader.multiprocessing_context = method


def _loader_kwargs(loader: DataLoader) -> dict[str, Any]:
    return {
        "num_workers": loader.num_workers,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": (
            loader.multiprocessing_context or worker_start_method(loader.num_workers)
        ),
        "generator": loader.generator,
        "prefetch_factor": loader.prefetch_factor,
        "persistent_workers": loader.persistent_workers,
    }


def _rebuild(loader: DataLoader, sampler: Sampler[int]) -> DataLoader:
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=sampler,
        drop_last=loader.drop_last,
        collate_fn=loader.collate_fn,
        **_loader_kwargs(loader),
    )


def whole_batches(loader: Any) -> Any:
    """``loader`` fetching each batch in one indexing per tensor, where it can.

    A DataLoader over a `TensorDataset` with the default collate gathers rows:
    ``tensor[indices]`` gives the very tensors that a ``__getitem__`` per
    example followed by ``torch.stack`` gives, in the same order (the same
    batch sampler draws them), for a fraction of the host work: per-example
    fetching costs ~5 ms per 1024-row batch, which on a CPU backend is taken
    from the cores the step runs on. Any other loader is returned as it is.
    """
    if rows_of_arrays(loader) and loader.batch_sampler is not None:
        # batch_size=None hands each list of indices to dataset[...] whole.
        return DataLoader(
            loader.dataset, batch_size=None, sampler=loader.batch_sampler, **_loader_kwargs(loader)
        )
    return loader


def common_num_batches(loader: DataLoader, replicas: int, skip_batches: int = 0) -> int:
    """Batches every process runs per epoch when ``replicas`` share an owned loader.

    Shares differ by one example at most, so their batch counts can differ by
    one; every process runs the largest count (the short ones add batches whose
    rows are all padding), or, with ``drop_last``, the smallest.
    """
    n, b = len(loader.dataset), loader.batch_size
    if loader.drop_last:
        count = (n // replicas) // b
    else:
        count = math.ceil(math.ceil(n / replicas) / b)
    return max(count - skip_batches, 0)


def rows_of_arrays(loader: Any) -> bool:
    """Whether ``loader``'s batches are rows of arrays taken whole: a
    `TensorDataset` (or `ArrayDataset`) with the default collate."""
    return (
        type(loader) is DataLoader
        and type(loader.dataset) in (TensorDataset, ArrayDataset)
        and loader.collate_fn is default_collate
    )


def indexable(loader: DataLoader) -> bool:
    """Whether the Trainer can index ``loader``'s rows itself: `rows_of_arrays`,
    read in the main process."""
    return rows_of_arrays(loader) and loader.num_workers == 0


def dataset_arrays(dataset: Any) -> Any:
    """A `TensorDataset`'s (or `ArrayDataset`'s) arrays as numpy, in the structure
    its DataLoader's batches have (the DataLoader turns ``dataset[indices]``'s
    tuple into a list)."""
    if isinstance(dataset, TensorDataset):
        return to_numpy(list(dataset.tensors))
    return to_numpy(dataset.arrays)


class EpochBatches:
    """The row indices of an epoch's batches: ``order`` cut as a DataLoader's
    `BatchSampler` cuts it (``drop_last`` included)."""

    def __init__(self, order: np.ndarray, batch_size: int, drop_last: bool) -> None:
        self.order, self.batch_size, self.drop_last = order, batch_size, drop_last

    def __len__(self) -> int:
        n, b = len(self.order), self.batch_size
        return n // b if self.drop_last else math.ceil(n / b)

    def __iter__(self) -> Iterator[np.ndarray]:
        b = self.batch_size
        for k in range(len(self)):
            yield self.order[k * b : (k + 1) * b]


class IndexedEpoch:
    """An epoch's batches of ``arrays``' rows, by `EpochBatches`: the batches a
    DataLoader over them gives (converted), without its per-batch machinery."""

    def __init__(self, arrays: Any, batches: EpochBatches) -> None:
        self.arrays, self.batches = arrays, batches
        # the loader's (the batches are padded to it: a resumed epoch may start short)
        self.batch_size = batches.batch_size

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        for rows in self.batches:
            yield jax.tree.map(lambda x, rows=rows: x[rows], self.arrays)


class OwnedOrder:
    """A plain DataLoader's epochs in the Trainer's order, one loader for all of them.

    The loader is rebuilt once around an `EpochSampler`; each epoch only re-aims
    the sampler (its permutation and resume position), so a DataLoader with
    ``persistent_workers=True`` keeps its worker processes from epoch to epoch.
    A loader whose batches are rows of arrays (`indexable`) is not iterated at
    all: its epochs are indexed from the arrays (`IndexedEpoch`), the same
    batches for a fifth of the host work; one read example by example in this
    process is fetched without the DataLoader's iterator (`FetchedEpoch`). One
    pass at a time: the caller finishes (or closes) a pass before the next.

    Args:
        loader: a DataLoader for which `ownable` holds.
        seed, rank, replicas: as for `EpochSampler`.
        shuffle: ``None``: shuffle iff the DataLoader does.
    """

    def __init__(
        self, loader: DataLoader, *, seed: int, rank: int, replicas: int, shuffle: bool | None
    ) -> None:
        if shuffle is None:
            shuffle = isinstance(loader.sampler, RandomSampler)
        self.batch_size: int = loader.batch_size  # type: ignore[assignment]
        self.rank, self.drop_last = rank, loader.drop_last
        self.sampler = EpochSampler(
            len(loader.dataset), shuffle=shuffle, seed=seed, rank=rank, replicas=replicas
        )
        self.arrays = dataset_arrays(loader.dataset) if indexable(loader) else None
        # read in this process, example by example: fetched here (`FetchedEpoch`)
        self.fetched = Fetch.of(loader) if self.arrays is None and fetchable(loader) else None
        self.loader = None
        if self.arrays is None and self.fetched is None:
            self.loader = whole_batches(_rebuild(loader, self.sampler))

    def epoch(self, epoch: int, skip_batches: int = 0) -> Iterable[Any]:
        """The loader, aimed at ``epoch`` from batch ``skip_batches`` on."""
        self.sampler.epoch = epoch
        self.sampler.start = skip_batches * self.batch_size
        if self.loader is not None:
            return self.loader
        order = self.sampler.share(self.rank)[self.sampler.start :]
        batches = EpochBatches(order, self.batch_size, self.drop_last)
        if self.arrays is not None:
            return IndexedEpoch(self.arrays, batches)
        return FetchedEpoch(self.fetched, batches)  # type: ignore[arg-type]


def epoch_loader(
    loader: Iterable[Any],
    *,
    epoch: int,
    seed: int,
    skip_batches: int = 0,
    own: bool = True,
    rank: int = 0,
    replicas: int = 1,
    shuffle: bool | None = None,
) -> Iterable[Any]:
    """The batches of ``epoch``, leaving out its first ``skip_batches``.

    With ``own`` and a plain DataLoader, the order comes from an `EpochSampler`
    (shuffled iff the DataLoader shuffles, this process's share of it) and
    skipped batches are never loaded. Otherwise the loader is used as it is and skipped batches are
    loaded and dropped, which restores the order only if the loader itself is
    deterministic. ``shuffle=False`` keeps dataset order (``overfit_batches``).
    """
    if own and ownable(loader):
        order = OwnedOrder(loader, seed=seed, rank=rank, replicas=replicas, shuffle=shuffle)
        return order.epoch(epoch, skip_batches)
    if replicas > 1 and own:
        raise ValueError(
            f"a multi-process run needs each process to read only its share; the Trainer "
            f"does that for a plain DataLoader over a map-style dataset, but got "
            f"{type(loader).__name__}. Pass one, or shard the data yourself (a grain "
            "loader with shard_options=grain.sharding.ShardByJaxProcess(drop_remainder=True)) "
            "and set Trainer(use_distributed_sampler=False)"
        )
    if skip_batches:
        warnings.warn(
            f"resuming mid-epoch: loading and dropping {skip_batches} batches, since the "
            "Trainer cannot set this loader's order itself (a plain DataLoader lets it); "
            "the order is only restored if the loader is deterministic",
            stacklevel=3,
        )
        return BatchSlice(whole_batches(loader), skip_batches)
    return whole_batches(loader)


def in_dataset_order(loader: Any) -> Any:
    """``loader`` without shuffling, for prediction (rows come back in dataset order).

    A plain DataLoader that shuffles is rebuilt with a sequential sampler, with
    a warning; other loaders are returned as they are.
    """
    if ownable(loader) and isinstance(loader.sampler, RandomSampler):
        warnings.warn(
            "the predict dataloader shuffles; predict reads it in dataset order instead, "
            "so that output row i belongs to dataset example i (pass shuffle=False to "
            "silence this)",
            stacklevel=4,
        )
        return _rebuild(loader, SequentialSampler(loader.dataset))
    return loader


class BatchSlice:
    """Batches ``start`` to ``stop`` of a loader; the pad size stays the loader's."""

    def __init__(self, loader: Iterable[Any], start: int, stop: int | None = None) -> None:
        self.loader, self.start, self.stop = loader, start, stop
        self.batch_size = loader_batch_size(loader)

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.loader), self.start, self.stop)

    def __len__(self) -> int:
        n = len(self.loader)  # type: ignore[arg-type]
        return max(min(n, n if self.stop is None else self.stop) - self.start, 0)
