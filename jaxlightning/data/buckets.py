"""Shape buckets for examples of varying length: one compile per bucket.

Every new batch shape compiles the step again. `BucketCollate` is a
DataLoader ``collate_fn`` that pads each batch's sequences up to the smallest
of a few fixed lengths, so a run compiles the step once per bucket however the
lengths vary, and hands the step each example's true length, from which the
step masks the padding (its metrics then equal the unpadded ones). The Trainer
reads the buckets off the loader: batches that differ from the first only in a
bucketed length are expected, not warned about (`SignatureGuard`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np
import torch


class BucketCollate:
    """Collates examples of varying length, padded to the smallest bucket.

    An example is an array (numpy or torch) or a tuple, list or dict of them.
    Its leaves of one or more dimensions are sequences along their first
    dimension, all of the example's length; its scalar leaves (a class label)
    are stacked as they are. The batch is ``(data, lengths)``: ``data`` the
    examples' structure with each sequence leaf padded with ``pad_value`` to
    ``(batch, bucket, ...)``, where ``bucket`` is the smallest of ``sizes`` that
    holds the batch's longest example, and ``lengths`` each example's length
    (int32). In the step, ``jnp.arange(bucket) < lengths[:, None]`` marks the
    real positions.

    Args:
        sizes: the bucket lengths (a longer example is an error naming it).
        pad_value: what padded positions hold.
    """

    def __init__(self, sizes: Sequence[int], pad_value: Any = 0) -> None:
        if isinstance(sizes, int) or not isinstance(sizes, Iterable):
            raise TypeError(
                f"BucketCollate(sizes={sizes!r}): expected a list of lengths, such as "
                f"sizes=[{sizes!r}] (one bucket) or [32, 64, 128]"
            )
        sizes = tuple(sorted(set(sizes)))
        if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes):
            raise ValueError(f"BucketCollate(sizes={sizes!r}): expected positive ints")
        self.sizes = sizes
        self.pad_value = pad_value

    def __call__(self, examples: list[Any]) -> tuple[Any, np.ndarray]:
        flat = [jax.tree.leaves(_numpy(e)) for e in examples]
        treedef = jax.tree.structure(_numpy(examples[0]))
        lengths = np.array([_length(leaves, i) for i, leaves in enumerate(flat)], np.int32)
        longest = int(lengths.max())
        bucket = next((s for s in self.sizes if s >= longest), None)
        if bucket is None:
            raise ValueError(
                f"an example of length {longest} (batch position {int(lengths.argmax())}) is "
                f"longer than the largest bucket, {self.sizes[-1]}: add a larger size to "
                f"BucketCollate(sizes=...) or truncate the example in the Dataset"
            )
        columns = []
        for j in range(len(flat[0])):
            column = [leaves[j] for leaves in flat]
            if column[0].ndim == 0:
                columns.append(np.stack(column))
                continue
            out = np.full((len(column), bucket, *column[0].shape[1:]), self.pad_value)
            out = out.astype(column[0].dtype)
            for i, leaf in enumerate(column):
                out[i, : len(leaf)] = leaf
            columns.append(out)
        return jax.tree.unflatten(treedef, columns), lengths


def _numpy(example: Any) -> Any:
    def leaf(x: Any) -> np.ndarray:
        return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)

    return jax.tree.map(leaf, example)


def _length(leaves: list[np.ndarray], i: int) -> int:
    lengths = {len(leaf) for leaf in leaves if leaf.ndim > 0}
    if len(lengths) != 1:
        raise ValueError(
            f"example {i} of the batch: its sequence leaves (those of one or more "
            f"dimensions) must share their length, got lengths {sorted(lengths)}"
            if lengths
            else f"example {i} of the batch has no sequence leaf (one of one or more "
            "dimensions) for BucketCollate to pad"
        )
    return lengths.pop()


def bucket_sizes(loader: Any) -> tuple[int, ...] | None:
    """The buckets of a DataLoader whose ``collate_fn`` is a `BucketCollate`."""
    collate = getattr(loader, "collate_fn", None)
    return collate.sizes if isinstance(collate, BucketCollate) else None


def in_buckets(first: Any, now: Any, sizes: tuple[int, ...]) -> bool:
    """Whether signature ``now`` differs from ``first`` only in bucketed
    lengths: the same leaves and dtypes, shapes equal but in the second
    dimension, which is one of ``sizes`` in both."""
    if len(first) != len(now):
        return False
    for (path0, shape0, dtype0), (path, shape, dtype) in zip(first, now, strict=True):
        if (path0, dtype0, len(shape0)) != (path, dtype, len(shape)):
            return False
        if shape0 != shape and (
            shape0[:1] + shape0[2:] != shape[:1] + shape[2:]
            or shape0[1] not in sizes
            or shape[1] not in sizes
        ):
            return False
    return True
