"""The recompile guard: a batch whose shapes or dtypes differ from the batch
the step was compiled for (training: the fit's first; an evaluation or
prediction pass: its own first) compiles it again (a recompile
storm, when they vary every few batches) — or fails inside the model, far
from the cause. `SignatureGuard` compares each training batch's host arrays
with the first one's, leaf by leaf, and names the leaf that changed and the
batch where it did (``Trainer(recompile="warn" | "raise" | "allow")``).
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import jax
import numpy as np

from jaxlightning.data.buckets import in_buckets

RECOMPILE = ("warn", "raise", "allow")

Signature = tuple[tuple[str, tuple[int, ...], str], ...]


class RecompileError(ValueError):
    """A training batch would compile the train step again (``recompile="raise"``)."""


def _on_device(dtype: Any) -> Any:
    """The dtype a host array of ``dtype`` has on the device: JAX's canonical
    one (float64 is float32 without ``jax_enable_x64``: the same program)."""
    try:
        return jax.dtypes.canonicalize_dtype(dtype)
    except TypeError:  # not a numpy dtype
        return dtype


def signature(data: Any) -> Signature:
    """Each leaf of a host batch as ``(path, shape, dtype)``, the dtype as it
    is on the device."""
    return tuple(
        (jax.tree_util.keystr(path), tuple(np.shape(leaf)), str(_on_device(np.asarray(leaf).dtype)))
        for path, leaf in jax.tree_util.tree_flatten_with_path(data)[0]
    )


def _key(data: Any) -> tuple[Any, ...]:
    """A batch's structure and each leaf's shape and device dtype, cheap to
    build and compare (no paths, no strings): `signature` is built only when
    it differs."""
    leaves, treedef = jax.tree_util.tree_flatten(data)
    return (
        treedef,
        *((np.shape(leaf), _on_device(getattr(leaf, "dtype", type(leaf)))) for leaf in leaves),
    )


def _difference(first: Signature, now: Signature) -> str:
    """What changed from ``first`` to ``now``, leaf by leaf, in words."""
    if [p for p, _, _ in first] != [p for p, _, _ in now]:
        return (
            f"its structure changed: leaves {[p for p, _, _ in now]}, were "
            f"{[p for p, _, _ in first]}"
        )
    changes = [
        f"batch{path} has shape {shape} {dtype}, was {shape0} {dtype0}"
        for (path, shape0, dtype0), (_, shape, dtype) in zip(first, now, strict=True)
        if (shape, dtype) != (shape0, dtype0)
    ]
    return "; ".join(changes)


class SignatureGuard:
    """Checks training batches against the first one of the fit (``policy``:
    ``"warn"`` once per new signature, ``"raise"``, or ``"allow"``)."""

    def __init__(self, policy: str = "warn", what: str = "training batch") -> None:
        if policy not in RECOMPILE:
            raise ValueError(f"recompile={policy!r}: use one of {RECOMPILE}")
        self.policy = policy
        self.what = what
        self.first: Signature | None = None
        # keys of the batches already checked (the first, bucketed lengths, warned ones)
        self._known: set[tuple[Any, ...]] = set()
        self._seen: set[Signature] = set()
        self._lock = threading.Lock()  # batches are checked on the prefetch thread

    def for_pass(self, name: str) -> SignatureGuard:
        """A guard for one evaluation pass over ``name`` (its batches against its
        first: each loader compiles the evaluation step for its own shapes)."""
        return SignatureGuard(self.policy, f"batch of {name}")

    @property
    def training(self) -> bool:
        return self.what == "training batch"

    def reset(self) -> None:
        """A new fit: its first batch sets the signature."""
        with self._lock:
            self.first, self._seen = None, set()
            self._known = set()

    def check(
        self, data: Any, epoch: int, batch_idx: int, buckets: tuple[int, ...] | None = None
    ) -> None:
        """Checks one batch (host arrays), the ``batch_idx``-th of ``epoch``; a
        batch that differs only in lengths of the loader's ``buckets``
        (`buckets.BucketCollate`) is expected: one compile per bucket."""
        if self.policy == "allow":
            return
        key = _key(data)
        if key in self._known:  # a shape checked before: no lock, no strings
            return
        now = signature(data)
        with self._lock:
            self._known.add(key)
            if self.first is None:
                self.first = now
                return
            if now == self.first or now in self._seen:
                return
            if buckets and in_buckets(self.first, now, buckets):
                return
            self._seen.add(now)
            first = self.first
        where = f"{self.what} {batch_idx}" + (f" of epoch {epoch}" if self.training else "")
        message = (
            f"{where} differs from the batch the {'train' if self.training else 'evaluation'} "
            f"step was compiled for: {_difference(first, now)}. Each new shape or dtype "
            "compiles the step again (and a model whose parameters follow the input's width "
            "fails). Give every batch the same shapes (pad, or bucket lengths with "
            "jl.BucketCollate), or pass Trainer(recompile='allow')"
        )
        if self.policy == "raise":
            raise RecompileError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
