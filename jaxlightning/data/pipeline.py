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

import contextlib
import itertools
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np

from jaxlightning.cluster import distributed
from jaxlightning.data.buckets import bucket_sizes
from jaxlightning.data.convert import Padder, Rows, loader_batch_size
from jaxlightning.data.fetch import FetchedEpoch
from jaxlightning.data.prefetch import Batches, DeviceBatch, Prefetcher
from jaxlightning.data.resident import ResidentDataset, device_budget, residable
from jaxlightning.data.sampling import (
    BatchSlice,
    EpochSampler,
    OwnedOrder,
    common_num_batches,
    epoch_loader,
    in_dataset_order,
    ownable,
    set_worker_start,
    whole_batches,
)
from jaxlightning.data.signature import SignatureGuard
from jaxlightning.data.stateful import Stamped, StatefulPass, iterates_statefully
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
        data_on_device: ``"auto"``: keep a `TensorDataset` behind a plain
            DataLoader on the devices where that is exact and it fits
            (`ResidentDataset`); ``True``: do so or raise saying why not;
            ``False``: always the host path.

    A rebuilt loader is built once per user loader and re-aimed each epoch, so
    ``persistent_workers=True`` keeps its worker processes. DataLoader workers
    the user gave no start method are forked on Linux (`worker_start_method`),
    from the calling thread at a quiescent point (`prefetch.start_on_caller`).
    """

    def __init__(
        self,
        strategy: Strategy,
        schedule: Schedule,
        *,
        seed: int,
        own_order: bool,
        shuffle_train: bool | None = None,
        data_on_device: bool | str = "auto",
        recompile: str = "warn",
    ) -> None:
        if data_on_device not in ("auto", True, False):
            raise ValueError(
                f'data_on_device must be "auto", True or False, got {data_on_device!r}'
            )
        self.data_on_device = data_on_device
        # where the last training pass came from: "device", "host" (None: none yet)
        self.data_path: str | None = None
        self.strategy = strategy
        self.schedule = schedule
        self.seed = seed
        self.own_order = own_order
        self.shuffle_train = shuffle_train
        self._spent: Iterator[Any] | None = None  # one-pass train data, once read
        self.signatures = SignatureGuard(recompile)  # training batches' shapes
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
    def train_path(self, loader: Any) -> ResidentDataset | None:
        """Where a fit's training batches come from, decided once per fit:
        ``loader``'s dataset kept on the devices (``data_on_device`` asks for it,
        and it is exact and fits), or ``None``: the host path."""
        resident = self._resident(loader, "train", self.shuffle_train)
        self.data_path = "host" if resident is None else "device"
        return resident

    def train_epoch(
        self,
        loader: Any,
        epoch: int,
        skip: int = 0,
        resident: ResidentDataset | None = None,
        state: dict[str, Any] | None = None,
    ) -> Batches:
        """Epoch ``epoch``'s training batches from batch ``skip`` on (at most the
        limited count per epoch), from ``resident`` (`train_path`) or the host;
        the first is ready on return. ``state``: a stateful loader's iterator
        state at batch ``skip`` (grain's, from a checkpoint). A one-pass
        iterable (a generator) trains one epoch; a second is a clear error."""
        if isinstance(loader, Iterator):
            if self._spent is loader:
                raise TypeError(
                    f"train_dataloaders is a {type(loader).__name__}, which can be iterated "
                    f"only once: its pass ended with an epoch, and epoch {epoch} (counting "
                    "from 0) needs it again. Stop within its one pass (max_epochs=1, or a "
                    "max_steps it reaches), or pass something that can be iterated again: a "
                    "DataLoader, a list of batches, or an object whose __iter__ starts over"
                )
            self._spent = loader
        if resident is not None:
            indices: Iterable[Any] = resident.epoch(epoch, skip)
            per_epoch = self.train_batches_per_epoch(loader)
            if self.schedule.limit_train_batches is not None and per_epoch is not None:
                indices = BatchSlice(indices, 0, max(per_epoch - skip, 0))
            return self._start(
                indices, "train_dataloaders", epoch, allow_empty=skip > 0, resident=resident
            )
        ordered = self._ordered(loader, "train", epoch, skip, self.shuffle_train, state)
        total = self._common_total(loader, ordered, skip)
        per_epoch = self.train_batches_per_epoch(loader)
        if self.schedule.limit_train_batches is not None and per_epoch is not None:
            remaining = max(per_epoch - skip, 0)
            if total is None:
                ordered = BatchSlice(ordered, 0, remaining)
            else:
                total = min(total, remaining)
        return self._start(
            ordered,
            "train_dataloaders",
            epoch,
            allow_empty=skip > 0,
            total=total,
            skip=skip,
            buckets=bucket_sizes(loader),
        )

    def example_batch(self, loader: Any, resident: ResidentDataset | None = None) -> DeviceBatch:
        """The first training batch of epoch 0, for shapes (a resumed epoch may
        have none left; ``limit_train_batches=0`` trains on none), from
        ``resident`` (`train_path`) or the host."""
        if resident is not None:
            with self._start(resident.epoch(0), "train_dataloaders", 0, resident=resident) as b:
                return b.first
        ordered = self._ordered(loader, "train", 0, 0, self.shuffle_train)
        total = self._common_total(loader, ordered)
        with self._start(
            ordered, "train_dataloaders", 0, total=total, buckets=bucket_sizes(loader)
        ) as batches:
            return batches.first

    def eval_pass(
        self, loader: Any, name: str, limit: int | None = None, epoch: int = 0
    ) -> Batches:
        """An evaluation loader's batches (at most ``limit``), during ``epoch``:
        in a multi-process run, this process's share, the same count on every
        process."""
        resident = self._resident(loader, "eval", False)
        if resident is not None:
            indices: Iterable[Any] = resident.epoch(0)
            if limit is not None:
                indices = BatchSlice(indices, 0, limit)
            return self._start(indices, name, epoch, resident=resident)
        if jax.process_count() == 1:
            source = self._wrap(loader, "eval", whole_batches)
            if limit is not None:
                source = BatchSlice(source, 0, limit)
            return self._start(source, name, epoch, buckets=bucket_sizes(loader))
        ordered = self._ordered(loader, "eval", 0, 0, None)
        total = self._common_total(loader, ordered)
        if limit is not None:
            total = limit if total is None else min(total, limit)
        return self._start(ordered, name, epoch, total=total, buckets=bucket_sizes(loader))

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

    @contextlib.contextmanager
    def from_host(self) -> Iterator[None]:
        """Within the block every pass loads its batches on the host, whatever
        ``data_on_device`` says; the datasets' copies on the devices are let go."""
        for roles in self._wrapped.values():
            for role in [r for r in roles if r.startswith("resident-")]:
                del roles[role]
        asked, self.data_on_device = self.data_on_device, False
        try:
            yield
        finally:
            self.data_on_device = asked

    # -------------------------------------------------------------- internals
    def _resident(self, loader: Any, role: str, shuffle: bool | None) -> ResidentDataset | None:
        """``loader``'s dataset kept on the devices, built once per loader and
        role, where ``data_on_device`` asks for it and it is exact and fits;
        else ``None`` (the host path). ``role`` ``"eval"`` reads in the
        loader's own order, which must then be the dataset's."""
        if self.data_on_device is False:
            return None
        why = self._not_residable(loader, role)
        if why:
            if self.data_on_device is True and role == "train":
                raise ValueError(f"data_on_device=True, but {why}; pass data_on_device='auto'")
            return None
        replicated, batch = self.strategy.batch_placement  # type: ignore[misc]

        def make(ld: Any) -> ResidentDataset:
            return ResidentDataset(
                ld,
                replicated=replicated,
                batch=batch,
                multiple=self.strategy.num_local_shards,
                seed=self.seed,
                shuffle=False if role == "eval" else shuffle,
            )

        return self._wrap(loader, f"resident-{role}", make)

    def _not_residable(self, loader: Any, role: str) -> str:
        """Why ``loader``'s batches cannot be gathered on the devices ("" if they can)."""
        if jax.process_count() > 1:
            return "a multi-process run reads each process's share on the host"
        if self.strategy.batch_placement is None:
            return f"the {self.strategy.name!r} strategy places per-device batches itself"
        if not residable(loader, shuffle_allowed=role != "eval"):
            return (
                "the data is not a plain DataLoader over a TensorDataset (or arrays) with the "
                "default collate_fn, read in the Trainer's order"
                + (" and unshuffled" if role == "eval" else "")
            )
        if role != "eval" and not self.own_order:
            return "use_distributed_sampler=False leaves the order to the DataLoader"
        need = ResidentDataset.nbytes(loader)
        budget = device_budget(self.strategy.devices)
        if need > budget:
            return f"its {need / 2**20:.0f} MiB do not fit the {budget / 2**20:.0f} MiB per device"
        return ""

    def _wrap(self, loader: Any, role: str, make: Any) -> Any:
        """``make(loader)``, built once per loader and role (while the user keeps
        the loader)."""
        try:
            roles = self._wrapped.setdefault(loader, {})
        except TypeError:  # not weakly referenceable (a list of batches): nothing to keep
            return make(loader)
        if role not in roles:
            set_worker_start(loader)
            wrapped = make(loader)
            if wrapped is loader:  # kept by the user already; a self-reference would pin it
                return loader
            roles[role] = wrapped
        return roles[role]

    def _ordered(
        self,
        loader: Any,
        role: str,
        epoch: int,
        skip: int,
        shuffle: bool | None,
        state: dict[str, Any] | None = None,
    ) -> Iterable[Any]:
        rank, replicas = jax.process_index(), jax.process_count()
        stateful = iterates_statefully(loader) and (replicas == 1 or not self.own_order)
        if stateful and (state is not None or not skip):  # else: loaded and dropped, below
            return StatefulPass(loader, state)
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
        if loader_length(ordered) is None:  # a grain loader: its shards' affair
            return None
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
        resident: ResidentDataset | None = None,
        skip: int = 0,
        buckets: tuple[int, ...] | None = None,
    ) -> Batches:
        """Starts prefetching ``loader``; its first batch is ready on return.

        With ``total``, yields exactly that many batches, adding all-padding
        ones at the end: every process of a multi-process run must run the same
        number of steps. With ``resident``, ``loader`` yields dataset indices
        and the batches are gathered on the devices (no thread: there is no
        host work to overlap). The caller closes the result.
        """
        if resident is not None:
            prefetcher = Prefetcher(loader, lambda idx: resident.device_batch(idx, epoch), 0)
        else:
            padder = Padder(self.strategy.num_local_shards, loader_batch_size(loader))
            put = self.strategy.put_batch
            training = name == "train_dataloaders"
            # training: against the fit's first batch; an evaluation: its own first
            guard = self.signatures if training else self.signatures.for_pass(name)
            counter = itertools.count(skip)

            def prepare(raw: Any) -> DeviceBatch:
                state = None
                if isinstance(raw, Stamped):
                    raw, state = raw.batch, raw.state
                host = padder.empty() if raw is _PAD_BATCH else padder(raw)
                if raw is not _PAD_BATCH:  # a new shape compiles the step again: say where
                    guard.check(host.data, epoch, next(counter), buckets)
                data, rows = put((host.data, Rows.of(host.mask, epoch)))
                return DeviceBatch(host, data, rows, state)

            source = loader if total is None else _exactly(loader, total)
            depth = self.strategy.prefetch_depth_for(isinstance(loader, FetchedEpoch))
            prefetcher = Prefetcher(source, prepare, depth=depth)
        batches = Batches(prefetcher)
        if batches.first is None and not allow_empty:
            batches.close()
            raise ValueError(
                f"{name} yielded no batches; check the dataset's length and the "
                "DataLoader's drop_last setting"
            )
        return batches
