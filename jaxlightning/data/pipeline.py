"""The data pipeline: the one part of the Trainer that knows about DataLoaders.

The loops ask it for a pass of device batches (an epoch of training from a
resume position, an evaluation, a prediction) and for batch counts; it owns
everything between a user's loader and a step's arguments:

    loader ─▶ order (seeded epoch, this process's share, resume position)
           ─▶ limit (limit_*_batches; the same count on every process)
           ─▶ convert and pad (fixed shapes, a mask of real rows)
           ─▶ place on the devices (the strategy) ─▶ prefetch (a bounded queue)
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np

from jaxlightning import distributed
from jaxlightning.data.convert import Padder, Rows, loader_batch_size
from jaxlightning.data.prefetch import Batches, DeviceBatch, Prefetcher
from jaxlightning.data.sampling import (
    BatchSlice,
    EpochSampler,
    OwnedOrder,
    common_num_batches,
    epoch_loader,
    in_dataset_order,
    make_fork_safe,
    ownable,
    whole_batches,
)
from jaxlightning.schedule import Schedule
from jaxlightning.strategies import Strategy

_PAD_BATCH = object()


def _exactly(loader: Iterable[Any], total: int) -> Iterator[Any]:
    """``total`` items of ``loader``: cut short, or topped up with `_PAD_BATCH`."""
    n = 0
    for item in itertools.islice(loader, total):
        n += 1
        yield item
    for _ in range(total - n):
        yield _PAD_BATCH


def loader_length(loader: Any) -> int | None:
    """``len(loader)``, or ``None`` for a loader without a length."""
    try:
        return len(loader)
    except TypeError:
        return None


class Pipeline:
    """Passes of device batches from users' loaders.

    Args:
        strategy: places batches on the devices (and says how many ways a host
            batch is split).
        schedule: the ``limit_*_batches`` of each stage.
        seed: seeds the order of shuffled plain DataLoaders, per epoch.
        own_order: the Trainer sets the order of plain DataLoaders
            (``use_distributed_sampler``): seeded per epoch, this process's
            share only, resumable mid-epoch without loading skipped batches.
        shuffle_train: ``False`` keeps training data in dataset order
            (``overfit_batches``); ``None`` follows the loader.

    A rebuilt loader is built once per user loader and re-aimed each epoch, so
    ``persistent_workers=True`` keeps its worker processes; DataLoader workers
    the user gave no start method start from a forkserver (or spawn), never by
    forking this multithreaded process.
    """

    def __init__(
        self,
        strategy: Strategy,
        schedule: Schedule,
        *,
        seed: int,
        own_order: bool,
        shuffle_train: bool | None = None,
    ) -> None:
        self.strategy = strategy
        self.schedule = schedule
        self.seed = seed
        self.own_order = own_order
        self.shuffle_train = shuffle_train
        # user loader -> {role: what the Trainer iterates for it}; weak, so a
        # loader the user drops is not kept alive (with its workers) by the Trainer
        self._wrapped: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()

    # ---------------------------------------------------------------- counts
    def train_batches_per_epoch(self, loader: Any) -> int | None:
        """Training batches per epoch: the loader's (in a multi-process run, the
        count every process runs), cut by ``limit_train_batches``."""
        n = loader_length(loader)
        if jax.process_count() > 1 and self.own_order and n is not None:
            n = common_num_batches(loader, jax.process_count())
        return self.schedule.batches("train", n)

    def eval_batches(self, stage: str, loader: Any, limit: int | None = None) -> int | None:
        """Batches an evaluation of ``stage`` runs on ``loader`` (at most ``limit``)."""
        n = self.schedule.batches(stage, loader_length(loader))
        if limit is not None:
            n = limit if n is None else min(n, limit)
        return n

    # ---------------------------------------------------------------- passes
    def train_epoch(self, loader: Any, epoch: int, skip: int = 0) -> Batches:
        """Epoch ``epoch``'s training batches from batch ``skip`` on (at most the
        limited count per epoch); the first is ready on return."""
        ordered = self._ordered(loader, "train", epoch, skip, self.shuffle_train)
        total = self._common_total(loader, ordered, skip)
        per_epoch = self.train_batches_per_epoch(loader)
        if self.schedule.limit_train_batches is not None and per_epoch is not None:
            remaining = max(per_epoch - skip, 0)
            if total is None:
                ordered = BatchSlice(ordered, 0, remaining)
            else:
                total = min(total, remaining)
        return self._start(ordered, "train_dataloaders", epoch, allow_empty=skip > 0, total=total)

    def example_batch(self, loader: Any) -> DeviceBatch:
        """The first training batch of epoch 0, for shapes (a resumed epoch may
        have none left; ``limit_train_batches=0`` trains on none)."""
        ordered = self._ordered(loader, "train", 0, 0, self.shuffle_train)
        total = self._common_total(loader, ordered)
        with self._start(ordered, "train_dataloaders", 0, total=total) as batches:
            return batches.first

    def eval_pass(
        self, loader: Any, name: str, limit: int | None = None, epoch: int = 0
    ) -> Batches:
        """An evaluation loader's batches (at most ``limit``), during ``epoch``:
        in a multi-process run, this process's share, the same count on every
        process."""
        if jax.process_count() == 1:
            source = self._wrap(loader, "eval", whole_batches)
            if limit is not None:
                source = BatchSlice(source, 0, limit)
            return self._start(source, name, epoch)
        ordered = self._ordered(loader, "eval", 0, 0, None)
        total = self._common_total(loader, ordered)
        if limit is not None:
            total = limit if total is None else min(total, limit)
        return self._start(ordered, name, epoch, total=total)

    def predict_loader(self, loader: Any) -> Any:
        """``loader`` in dataset order (row i of the output is example i)."""
        return self._wrap(loader, "predict", in_dataset_order)

    def predict_shares(self, loader: Any) -> list[np.ndarray]:
        """Which dataset rows each process predicts, in a multi-process run."""
        if not self.own_order:
            raise ValueError(
                "predict in a multi-process run needs use_distributed_sampler=True, so the "
                "Trainer knows which process holds which example"
            )
        processes = jax.process_count()
        sampler = EpochSampler(
            len(loader.dataset), shuffle=False, seed=self.seed, replicas=processes
        )
        return [sampler.share(p) for p in range(processes)]

    # -------------------------------------------------------------- internals
    def _wrap(self, loader: Any, role: str, make: Any) -> Any:
        """``make(loader)``, built once per loader and role (while the user keeps
        the loader)."""
        try:
            roles = self._wrapped.setdefault(loader, {})
        except TypeError:  # not weakly referenceable (a list of batches): nothing to keep
            return make(loader)
        if role not in roles:
            make_fork_safe(loader)
            wrapped = make(loader)
            if wrapped is loader:  # kept by the user already; a self-reference would pin it
                return loader
            roles[role] = wrapped
        return roles[role]

    def _ordered(
        self, loader: Any, role: str, epoch: int, skip: int, shuffle: bool | None
    ) -> Iterable[Any]:
        rank, replicas = jax.process_index(), jax.process_count()
        if self.own_order and ownable(loader):

            def make(ld: Any) -> OwnedOrder:
                return OwnedOrder(ld, seed=self.seed, rank=rank, replicas=replicas, shuffle=shuffle)

            return self._wrap(loader, role, make).epoch(epoch, skip)
        # Used as it is (fetching whole batches where it can), built once.
        return epoch_loader(
            self._wrap(loader, role, whole_batches),
            epoch=epoch,
            seed=self.seed,
            skip_batches=skip,
            own=self.own_order,
            rank=rank,
            replicas=replicas,
        )

    def _common_total(self, loader: Any, ordered: Any, skip: int = 0) -> int | None:
        """The batch count every process runs, in a multi-process run."""
        processes = jax.process_count()
        if processes == 1:
            return None
        if self.own_order:
            return common_num_batches(loader, processes, skip)
        counts = distributed.gather_ints(len(ordered))
        if len(set(counts)) > 1:
            raise ValueError(
                f"with use_distributed_sampler=False every process must yield as many "
                f"batches; the processes' loaders have {counts}"
            )
        return None

    def _start(
        self,
        loader: Iterable[Any],
        name: str,
        epoch: int,
        *,
        allow_empty: bool = False,
        total: int | None = None,
    ) -> Batches:
        """Starts prefetching ``loader``; its first batch is ready on return.

        With ``total``, yields exactly that many batches, adding all-padding
        ones at the end: every process of a multi-process run must run the same
        number of steps. The caller closes the result.
        """
        padder = Padder(self.strategy.num_local_shards, loader_batch_size(loader))
        put = self.strategy.put_batch

        def prepare(raw: Any) -> DeviceBatch:
            host = padder.empty() if raw is _PAD_BATCH else padder(raw)
            data, rows = put((host.data, Rows.of(host.mask, epoch)))
            return DeviceBatch(host, data, rows)

        source = loader if total is None else _exactly(loader, total)
        batches = Batches(Prefetcher(source, prepare, depth=self.strategy.prefetch_depth))
        if batches.first is None and not allow_empty:
            batches.close()
            raise ValueError(
                f"{name} yielded no batches; check the dataset's length and the "
                "DataLoader's drop_last setting"
            )
        return batches
