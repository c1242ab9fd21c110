"""DataLoader batches to fixed-shape numpy: conversion, checks and padding.

A batch from a `torch.utils.data.DataLoader` (tensors or numpy arrays, in tuples,
lists, dicts, nested) becomes a pytree of numpy arrays without copies where the
memory allows, is checked, and is padded to the fixed global batch size with a
boolean mask of real rows. Fixed shapes mean each step compiles once; the mask
means padded rows never count in losses or metrics.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import ml_dtypes
import numpy as np
import torch


class BatchError(ValueError):
    """A batch that cannot be turned into device arrays."""


# torch dtypes numpy has (bfloat16 is reinterpreted below)
_NUMPY_TENSOR = frozenset(
    {
        torch.float16,
        torch.float32,
        torch.float64,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    }
)


def _is_none(x: Any) -> bool:
    return x is None


def _leaf_to_numpy(x: Any) -> Any:
    if type(x) is torch.Tensor and x.is_cpu and x.dtype in _NUMPY_TENSOR:
        # the common case first: a CPU tensor numpy shares memory with as it is
        return x.detach().numpy() if x.requires_grad else x.numpy()
    if x is None:  # kept as a leaf so that the error names where it is
        return None
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:  # numpy has no bfloat16; reinterpret the bits
            return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return x.numpy()
    if isinstance(x, (str, bytes)):
        return x
    return np.asarray(x)


def _not_numeric(dtype: np.dtype) -> bool:
    # ml_dtypes types (bfloat16, float8...) have kind "V" too, but are not np.void.
    return dtype.kind in "OSU" or dtype.type is np.void


def _where(path: Any) -> str:
    return "batch" + jax.tree_util.keystr(path)


def to_numpy(batch: Any) -> Any:
    """Converts a batch to a pytree of numeric numpy arrays with one leading size.

    Raises:
        BatchError: naming the offending entry, for ``None`` entries, strings or
            object arrays, for arrays without a batch dimension, and for entries
            whose leading dimensions disagree.
    """
    return numpy_rows(batch)[0]


def numpy_rows(batch: Any) -> tuple[Any, int]:
    """`to_numpy`'s result and its number of rows (one flatten for both)."""
    # None is an empty pytree to JAX; here it is a leaf, refused by name below.
    leaves, treedef = jax.tree_util.tree_flatten(batch, is_leaf=_is_none)
    converted = [_leaf_to_numpy(x) for x in leaves]
    rows = _well_formed(converted)
    if rows is None:
        _raise_batch_error(jax.tree_util.tree_unflatten(treedef, converted))
    return jax.tree_util.tree_unflatten(treedef, converted), rows


def _well_formed(leaves: list[Any]) -> int | None:
    """The per-batch check, without building paths (the error path builds
    them): the rows the leaves share, ``None`` if any is not a numeric array
    with them."""
    rows = None
    for leaf in leaves:
        if not isinstance(leaf, np.ndarray) or _not_numeric(leaf.dtype) or leaf.ndim == 0:
            return None
        if rows is None:
            rows = leaf.shape[0]
        elif leaf.shape[0] != rows:
            return None
    return rows


def _raise_batch_error(converted: Any) -> None:
    leaves = jax.tree_util.tree_flatten_with_path(converted, is_leaf=_is_none)[0]
    if not leaves:
        raise BatchError("the batch holds no arrays; a DataLoader batch must hold arrays")
    first_path, first = None, None
    for path, leaf in leaves:
        if leaf is None:
            raise BatchError(
                f"{_where(path)} is None; every entry of a batch must be an array with a "
                "leading batch dimension. Leave the entry out of the batch (in the Dataset "
                "or collate_fn), or fill it with an array (e.g. zeros and a mask of which "
                "rows have it)"
            )
        if isinstance(leaf, (str, bytes)) or _not_numeric(leaf.dtype):
            kind = type(leaf).__name__ if isinstance(leaf, (str, bytes)) else leaf.dtype
            raise BatchError(
                f"{_where(path)} holds {kind} data; only numeric arrays can go to devices. "
                "Drop or encode that field (e.g. in the Dataset or a collate_fn)"
            )
        if leaf.ndim == 0:
            raise BatchError(
                f"{_where(path)} is a scalar; every entry of a batch needs a leading batch "
                "dimension"
            )
        if first is None:
            first_path, first = path, leaf
        elif leaf.shape[0] != first.shape[0]:
            raise BatchError(
                f"{_where(path)} has {leaf.shape[0]} rows but {_where(first_path)} has "
                f"{first.shape[0]}; every array in a batch must share its leading (batch) "
                "dimension"
            )
    raise AssertionError("unreachable: _well_formed rejected a well-formed batch")


class Rows(NamedTuple):
    """What a step gets about the rows of its batch besides their data: which
    are real (``mask``, bool) and the epoch they belong to (``epoch``, int32,
    one value repeated per row, so it splits over the devices as the rows do:
    the step reads ``self.current_epoch`` from it without a recompile)."""

    mask: Any
    epoch: Any

    @classmethod
    def of(cls, mask: np.ndarray, epoch: int) -> Rows:
        return cls(mask, _epoch_rows(mask.shape, epoch))


@functools.lru_cache(maxsize=16)
def _epoch_rows(shape: tuple[int, ...], epoch: int) -> np.ndarray:
    """``epoch`` per row, one read-only array shared by a pass's batches."""
    rows = np.full(shape, epoch, np.int32)
    rows.setflags(write=False)
    return rows


@dataclass(frozen=True)
class HostBatch:
    """A padded host batch: ``data`` with ``size`` rows, of which ``real`` are real."""

    data: Any
    mask: np.ndarray
    real: int


class Padder:
    """Pads batches to one fixed global size, a multiple of ``multiple``.

    The size is set by the DataLoader's ``batch_size`` when it has one, else by
    the first batch. A larger batch grows it (one more compilation, with a warning).
    """

    def __init__(self, multiple: int, batch_size: int | None = None) -> None:
        self.multiple = multiple
        self.size = self._round(batch_size) if batch_size else None
        self._last: HostBatch | None = None
        self._full: np.ndarray | None = None

    def empty(self) -> HostBatch:
        """A batch of padding only (the last batch's rows, all masked out)."""
        if self._last is None:
            raise BatchError(
                "this process has no data at all in a multi-process run; the dataset needs "
                "at least one example per process"
            )
        return HostBatch(self._last.data, np.zeros_like(self._last.mask), 0)

    def _full_mask(self) -> np.ndarray:
        """One read-only all-true mask per size, shared by the full batches."""
        if self._full is None or self._full.shape[0] != self.size:
            self._full = np.ones(self.size, bool)
            self._full.setflags(write=False)
        return self._full

    def _round(self, rows: int) -> int:
        return math.ceil(rows / self.multiple) * self.multiple

    def __call__(self, batch: Any) -> HostBatch:
        batch, rows = numpy_rows(batch)
        if rows == 0:
            raise BatchError("a batch has 0 rows; DataLoader batches must not be empty")
        if self.size is None:
            self.size = self._round(rows)
        elif rows > self.size:
            warnings.warn(
                f"a batch of {rows} rows is larger than the fixed batch size {self.size}; "
                "padding to a larger size recompiles the step",
                stacklevel=2,
            )
            self.size = self._round(rows)
        if rows == self.size:
            self._last = HostBatch(batch, self._full_mask(), rows)
            return self._last
        mask = np.zeros(self.size, bool)
        mask[:rows] = True
        # Pad with copies of the last real row: finite, in-range values that any
        # model can process, and the mask drops them from every average.
        idx = np.concatenate([np.arange(rows), np.full(self.size - rows, rows - 1)])
        batch = jax.tree.map(lambda x: np.take(x, idx, axis=0), batch)
        self._last = HostBatch(batch, mask, rows)
        return self._last


def dataset_length(loader: Iterable[Any]) -> int | None:
    """The number of examples of the DataLoader's map-style dataset, if known."""
    try:
        return len(loader.dataset)  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        return None


def loader_batch_size(loader: Iterable[Any]) -> int | None:
    """The DataLoader's fixed ``batch_size``, if it has one."""
    size = getattr(loader, "batch_size", None)
    if size is None:  # fetching whole batches from a batch sampler (sampling.whole_batches)
        size = getattr(getattr(loader, "sampler", None), "batch_size", None)
    return size if isinstance(size, int) and size > 0 else None
