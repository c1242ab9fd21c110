"""Datasets resident on the devices: batches gathered where the step runs.

A `TensorDataset` behind a plain DataLoader (or arrays handed to the Trainer
directly) is copied to every device once. Each step then needs only the
indices of its rows: the order is the one the Trainer's own sampler gives the
host path (`EpochSampler`: seeded per epoch, resumable), the batch is padded
with copies of its last row and masked exactly as `Padder` pads it, and the
rows are gathered on the devices, already split over the data axis. Batches,
padding, masks and resume positions are the host path's, value for value, so
training is bitwise the same; what goes away is the per-step host work (the
DataLoader's machinery, tensor indexing, numpy conversion, the copy to the
devices), which on a small model is most of a step.

Used where it is exact and fits: a single process, a strategy that places
batches as one global array (not ``pmap``), the loader's default collate,
and a dataset whose copies fit a share of device memory.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

from jaxlightning.data.convert import Rows
from jaxlightning.data.sampling import (
    EpochBatches,
    EpochSampler,
    dataset_arrays,
    ownable,
    rows_of_arrays,
)

# On a CPU backend every "device" is host memory: a budget, not a share of it.
_CPU_BUDGET_BYTES = 2 << 30
_ACCELERATOR_SHARE = 0.25  # of the smallest device's memory


def residable(loader: Any, *, shuffle_allowed: bool) -> bool:
    """Whether ``loader``'s batches can be gathered on the devices exactly: a
    plain DataLoader over a `TensorDataset` with the default collate (and, where
    the host path would draw a torch-random order, ``shuffle_allowed``)."""
    if not ownable(loader) or not rows_of_arrays(loader):
        return False
    return shuffle_allowed or isinstance(loader.sampler, SequentialSampler)


def device_budget(devices: list[jax.Device]) -> int:
    """Bytes of each device the resident copies may take."""
    if all(d.platform == "cpu" for d in devices):
        return _CPU_BUDGET_BYTES // max(len(devices), 1)
    limits = []
    for d in devices:
        stats = d.memory_stats() or {}
        if "bytes_limit" not in stats:
            return 0  # unknown: stay on the host
        limits.append(stats["bytes_limit"])
    return int(min(limits) * _ACCELERATOR_SHARE)


def _gather(data: Any, idx: jax.Array, rows: Rows) -> tuple[Any, Rows]:
    """The batch of rows ``idx``, and ``rows`` placed as the batch is (one
    dispatch for both: on a small model each one per step counts)."""
    return jax.tree.map(lambda x: jnp.take(x, idx, axis=0), data), rows


class ResidentDataset:
    """A `TensorDataset`'s tensors on every device, and its epochs as batches
    gathered there.

    Args:
        loader: a DataLoader for which `residable` holds.
        replicated: the sharding of an array every device holds whole.
        batch: the sharding of a batch (split along its rows over the data axis).
        multiple: the batch size is padded to a multiple of this
            (``Strategy.num_local_shards``, as `Padder` does).
        seed: the run's seed (the order of shuffled epochs).
        shuffle: ``None``: shuffle iff the DataLoader does.
    """

    def __init__(
        self,
        loader: DataLoader,
        *,
        replicated: jax.sharding.Sharding,
        batch: jax.sharding.Sharding,
        multiple: int,
        seed: int,
        shuffle: bool | None = None,
    ) -> None:
        if shuffle is None:
            shuffle = isinstance(loader.sampler, RandomSampler)
        self.batch_size: int = loader.batch_size  # type: ignore[assignment]
        self.drop_last = loader.drop_last
        self.size = math.ceil(self.batch_size / multiple) * multiple
        # The host path's conversion, once, of what its batches are made from.
        self.host = dataset_arrays(loader.dataset)
        self.sampler = EpochSampler(len(loader.dataset), shuffle=shuffle, seed=seed)
        self.data = jax.device_put(self.host, replicated)
        self._gather = jax.jit(
            _gather, in_shardings=(replicated, batch, batch), out_shardings=batch
        )
        self._full = np.ones(self.size, bool)

    @staticmethod
    def nbytes(loader: DataLoader) -> int:
        """Bytes one device's copy of ``loader``'s dataset takes."""
        # numpy views of the tensors: nothing is copied to count them
        return sum(x.nbytes for x in jax.tree.leaves(dataset_arrays(loader.dataset)))

    def epoch(self, epoch: int, skip_batches: int = 0) -> EpochBatches:
        """The row indices of epoch ``epoch``'s batches from batch ``skip_batches``
        on (`device_batch` makes each batch)."""
        self.sampler.epoch = epoch
        order = self.sampler.share(0)[skip_batches * self.batch_size :]
        return EpochBatches(order, self.batch_size, self.drop_last)

    def device_batch(self, indices: np.ndarray, epoch: int) -> ResidentBatch:
        """The batch of dataset rows ``indices``, padded (its rows are gathered
        on the devices when its data are first asked for)."""
        real = len(indices)
        if real == self.size:
            idx, mask = indices, self._full
        else:  # padded with copies of the last real row, masked out (as `Padder`)
            idx = np.concatenate([indices, np.full(self.size - real, indices[-1])])
            mask = np.zeros(self.size, bool)
            mask[:real] = True
        idx = idx.astype(np.int32)
        host = ResidentHostBatch(self, idx, mask, real)
        return ResidentBatch(self, idx, Rows.of(mask, epoch), host)


class ResidentBatch:
    """A batch of a `ResidentDataset`, as a `DeviceBatch` reads: ``data`` and
    ``mask`` (its placed `Rows`) are gathered on the devices when first asked
    for. A program that trains several batches per dispatch gathers them itself,
    from ``dataset``, ``indices`` and ``rows`` (host arrays), in that dispatch.
    """

    state = None  # the Trainer's own order: no iterator state to save

    def __init__(
        self, dataset: ResidentDataset, indices: np.ndarray, rows: Rows, host: ResidentHostBatch
    ) -> None:
        self.dataset, self.indices, self.rows, self.host = dataset, indices, rows, host
        self._placed: tuple[Any, Rows] | None = None

    def _gathered(self) -> tuple[Any, Rows]:
        if self._placed is None:
            self._placed = self.dataset._gather(self.dataset.data, self.indices, self.rows)
        return self._placed

    @property
    def data(self) -> Any:
        return self._gathered()[0]

    @property
    def mask(self) -> Rows:
        return self._gathered()[1]

    @property
    def gathering(self) -> tuple[Any, Rows, Rows]:
        """The batch as a step that gathers its rows takes it: the dataset's
        copy, the row indices and the rows (`multistep._gather`)."""
        return self.dataset.data, self.indices, self.rows


class ResidentHostBatch:
    """A resident batch's host side, as a `HostBatch` reads: its mask and number
    of real rows, and its padded host data (only the first batch's is ever
    asked for, for shapes) computed when asked for."""

    def __init__(
        self, dataset: ResidentDataset, padded: np.ndarray, mask: np.ndarray, real: int
    ) -> None:
        self._dataset, self._padded = dataset, padded
        self.mask, self.real = mask, real

    @property
    def data(self) -> Any:
        return jax.tree.map(lambda x: np.take(x, self._padded, axis=0), self._dataset.host)
