"""Arrays where loaders go: ``trainer.fit(module, (x, y))``, as Keras users expect.

An array, a tuple of arrays or a dict of arrays (numpy, JAX or torch), all with
one leading size, becomes a plain DataLoader over an `ArrayDataset`: batches
of 32 rows (Keras's default), shuffled for training. `jl.arrays` makes one with
another batch size. Being a plain DataLoader, it takes every path a loader
takes: the Trainer's seeded order, exact resume, and residence on the devices.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

DEFAULT_BATCH_SIZE = 32


def _is_array(x: Any) -> bool:
    return isinstance(x, (np.ndarray, jax.Array, torch.Tensor))


def _is_scalar(x: Any) -> bool:
    return isinstance(x, (np.generic, int, float)) and not isinstance(x, bool)


def is_arrays(data: Any) -> bool:
    """Whether ``data`` is an array, or a tuple or dict of arrays (not a list:
    a list is a list of batches). A tuple or dict mixing arrays with scalars
    counts too, so that `ArrayDataset` names the scalar."""
    if _is_array(data):
        return True
    items = tuple(data) if isinstance(data, tuple) else None
    if isinstance(data, dict):
        items = tuple(data.values())
    if not items or not any(_is_array(x) for x in items):
        return False
    return all(_is_array(x) or _is_scalar(x) for x in items)


def _looks_like_arrays_in_a_list(data: Any) -> bool:
    """Whether a list holds arrays of one leading size but unlike rows (``[x,
    y]``): batches of one loader have alike rows, features and labels do not."""
    if not isinstance(data, list) or len(data) < 2 or not all(_is_array(x) for x in data):
        return False
    shapes = [tuple(x.shape) for x in data]
    if any(not s for s in shapes) or len({s[0] for s in shapes}) != 1:
        return False
    return len({(s[1:], str(x.dtype)) for s, x in zip(shapes, data, strict=True)}) > 1


def _as_numpy(x: Any) -> np.ndarray:
    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


class ArrayDataset(Dataset):
    """Equal-length arrays as a map-style dataset: ``dataset[i]`` is row ``i``
    of each, ``dataset[indices]`` the rows ``indices`` of each, in the
    structure given (an array, a list for a tuple, or a dict)."""

    def __init__(self, data: Any) -> None:
        if not is_arrays(data):
            raise TypeError(
                f"expected an array, or a tuple or dict of arrays, got {type(data).__name__}"
            )
        # A tuple is kept as a list: what the DataLoader's default collate and
        # convert make of a tuple, so batches look alike on every path.
        data = list(data) if isinstance(data, tuple) else data
        self.arrays = jax.tree.map(_as_numpy, data)
        sizes = {
            jax.tree_util.keystr(path, simple=True, separator="/") or "array": (
                a.shape[0] if a.ndim else None
            )
            for path, a in jax.tree_util.tree_flatten_with_path(self.arrays)[0]
        }
        if None in sizes.values() or len(set(sizes.values())) != 1:
            got = ", ".join(
                f"{name}: {'a scalar' if n is None else n}" for name, n in sizes.items()
            )
            raise ValueError(
                "arrays passed as data need one leading size (the number of examples, "
                f"not a scalar); got leading sizes {got}"
            )
        self.size = next(iter(sizes.values()))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: Any) -> Any:
        return jax.tree.map(lambda a: a[index], self.arrays)


def arrays(data: Any, *, batch_size: int = DEFAULT_BATCH_SIZE, shuffle: bool = False) -> DataLoader:
    """A DataLoader over arrays: an array, a tuple or a dict of them, with one
    leading size.

    ``trainer.fit(module, (x, y))`` does this itself (batch 32, shuffled for
    training); call it to choose the batch size:
    ``trainer.fit(module, jl.arrays((x, y), batch_size=128, shuffle=True))``.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    return DataLoader(ArrayDataset(data), batch_size=batch_size, shuffle=shuffle)


def as_loader(data: Any, *, shuffle: bool) -> Any:
    """``data`` as a loader: arrays become a DataLoader, anything else is kept."""
    if _looks_like_arrays_in_a_list(data):
        shapes = ", ".join(str(tuple(x.shape)) for x in data)
        raise TypeError(
            f"a list is read as a list of batches, and these {len(data)} arrays ({shapes}) "
            "have one leading size but unlike rows: to pass arrays, make it a tuple, "
            "fit(module, (x, y)), as in Keras"
        )
    if data is None or not is_arrays(data):
        return data
    return arrays(data, shuffle=shuffle)


def as_eval_loaders(data: Any) -> Any:
    """An evaluation's ``dataloaders`` with arrays made loaders (in order): one
    set of arrays, or a list of loaders and sets of arrays."""
    if isinstance(data, list):
        return [as_loader(d, shuffle=False) for d in data]
    return as_loader(data, shuffle=False)
