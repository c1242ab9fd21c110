"""Published weights in and out: `load_weights` fills a variables tree from a
safetensors file or folder, a PyTorch or Lightning file, or a checkpoint;
`save_weights` writes one as safetensors that ``transformers`` loads.

Loading is planned from names and shapes alone, then each array is built
where it goes: with a sharding, `jax.make_array_from_callback` asks for each
device's block and only that block's bytes are read, so no process reads, and
no device holds, more of an array than its own shards.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from jaxlightning.cluster.rank_zero import rank_zero_warn
from jaxlightning.io import safetensors_format
from jaxlightning.io.weight_rules import (
    Placement,
    Rules,
    source_to_target,
    target_to_sources,
)
from jaxlightning.io.weight_sources import INDEX, SINGLE, Source, open_source


class WeightsMismatchError(ValueError):
    """The weights do not fit the tree: ``report`` (a `WeightsReport`) names
    every missing, unexpected and mismatched name."""

    def __init__(self, report: WeightsReport) -> None:
        super().__init__(str(report))
        self.report = report


@dataclasses.dataclass
class WeightsReport:
    """What loading found, name by name.

    Attributes:
        loaded: tree paths filled from the source.
        missing: tree paths no source name fills (whole or in part).
        unexpected: source names no rule places in the tree (with the path a
            rule gave, if any).
        mismatched: ``(name, path, why)``: a shape, dtype or overlap that does not fit.
        cast: ``(name, from, to)``: floating-point names converted to the tree's dtype.
        candidates: for a missing path or unexpected name, the closest names on
            the other side.
    """

    source: str
    loaded: list[str] = dataclasses.field(default_factory=list)
    missing: list[str] = dataclasses.field(default_factory=list)
    unexpected: list[str] = dataclasses.field(default_factory=list)
    mismatched: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    cast: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    candidates: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def __str__(self) -> str:
        lines = [f"weights from {self.source}: {len(self.loaded)} arrays load"]

        def near(key: str) -> str:
            found = self.candidates.get(key)
            return f" (closest: {', '.join(found)})" if found else ""

        if self.missing:
            lines.append(f"{len(self.missing)} missing from the source:")
            lines += [f"  {path}{near(path)}" for path in self.missing]
        if self.unexpected:
            lines.append(f"{len(self.unexpected)} unexpected (no place in the tree):")
            lines += [f"  {name}{near(name)}" for name in self.unexpected]
        if self.mismatched:
            lines.append(f"{len(self.mismatched)} mismatched:")
            lines += [f"  {name} -> {path}: {why}" for name, path, why in self.mismatched]
        if not self.ok:
            lines.append(
                "give rename= rules that map the names (docs: Fine-tune a pretrained model), "
                "or strict=False to load what matches"
            )
        return "\n".join(lines)


@dataclasses.dataclass
class _Piece:
    name: str
    region: tuple[slice, ...]  # in the leaf's coordinates
    squeezed: tuple[int, ...]  # leaf axes the piece has no axis for
    perm: tuple[int, ...] | None


@dataclasses.dataclass
class _Leaf:
    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: Any
    pieces: list[_Piece] = dataclasses.field(default_factory=list)


def _path(keys: Any) -> str:
    parts = []
    for key in keys:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
    return "/".join(parts)


def _sharding(leaf: Any) -> Any:
    sharding = getattr(leaf, "sharding", None)
    return sharding if isinstance(sharding, jax.sharding.Sharding) else None


def _region(
    index: tuple[int | slice, ...], shape: tuple[int, ...]
) -> tuple[tuple[slice, ...], tuple[int, ...]]:
    if len(index) > len(shape):
        raise ValueError(f"index of {len(index)} parts for an array of {len(shape)} axes")
    index = index + (slice(None),) * (len(shape) - len(index))
    region, squeezed = [], []
    for dim, (part, size) in enumerate(zip(index, shape, strict=True)):
        if isinstance(part, int):
            if not -size <= part < size:
                raise ValueError(f"index {part} is out of range for axis {dim} of size {size}")
            part %= size
            region.append(slice(part, part + 1))
            squeezed.append(dim)
        else:
            start, stop, _ = part.indices(size)
            region.append(slice(start, stop))
    return tuple(region), tuple(squeezed)


def plan(source: Source, into: Any, rename: Rules = None) -> tuple[list[_Leaf], WeightsReport, Any]:
    """Places every source name in the tree ``into`` by the rules; checks
    shapes, dtypes and that each leaf is filled whole, once."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(nn.meta.unbox(into))
    leaves = {
        _path(keys): _Leaf(_path(keys), tuple(leaf.shape), np.dtype(leaf.dtype), _sharding(leaf))
        for keys, leaf in flat
    }
    report = WeightsReport(source.where)
    place = source_to_target(rename)
    for name, (shape, dtype) in source.names().items():
        where = place(name)
        if where is None:
            continue
        if where is False or where.path not in leaves:
            report.unexpected.append(name)
            target = name.replace(".", "/") if where is False else where.path
            report.candidates[name] = difflib.get_close_matches(target, list(leaves), n=3)
            continue
        problem = _add_piece(leaves[where.path], name, shape, dtype, where, report)
        if problem:
            report.mismatched.append((name, where.path, problem))
    for leaf in leaves.values():
        _check_cover(leaf, report)
    for path in report.missing:
        report.candidates[path] = difflib.get_close_matches(
            path.replace("/", "."), report.unexpected, n=3
        )
    return list(leaves.values()), report, treedef


def _add_piece(
    leaf: _Leaf,
    name: str,
    shape: tuple[int, ...],
    dtype: np.dtype,
    where: Placement,
    report: WeightsReport,
) -> str | None:
    try:
        region, squeezed = _region(where.index, leaf.shape)
        perm = where.permutation(len(shape))
    except ValueError as exc:
        return str(exc)
    moved = shape if perm is None else tuple(shape[p] for p in perm)
    wanted = tuple(r.stop - r.start for d, r in enumerate(region) if d not in squeezed)
    if moved != wanted:
        layout = f" after layout {where.layout!r}" if perm else ""
        return f"shape {shape}{layout} is {moved}, the tree's part needs {wanted}"
    if dtype != leaf.dtype:
        if not (jnp.issubdtype(dtype, jnp.floating) and jnp.issubdtype(leaf.dtype, jnp.floating)):
            return f"dtype {dtype} cannot become the tree's {leaf.dtype}"
        report.cast.append((name, str(dtype), str(leaf.dtype)))
    leaf.pieces.append(_Piece(name, region, squeezed, perm))
    return None


def _size(region: tuple[slice, ...]) -> int:
    return int(np.prod([r.stop - r.start for r in region]))


def _check_cover(leaf: _Leaf, report: WeightsReport) -> None:
    pieces = leaf.pieces
    for i, a in enumerate(pieces):
        for b in pieces[i + 1 :]:
            if all(
                x.start < y.stop and y.start < x.stop
                for x, y in zip(a.region, b.region, strict=True)
            ):
                why = f"overlaps {b.name} in the tree's array"
                report.mismatched.append((a.name, leaf.path, why))
                return
    if sum(_size(p.region) for p in pieces) != int(np.prod(leaf.shape)):
        report.missing.append(leaf.path)
    else:
        report.loaded.append(leaf.path)


def _block(leaf: _Leaf, source: Source, want: tuple[slice, ...]) -> np.ndarray:
    """The leaf's block ``want``, read from the pieces that overlap it."""
    want = tuple(slice(*s.indices(n)[:2]) for s, n in zip(want, leaf.shape, strict=True))
    out = np.empty([s.stop - s.start for s in want], leaf.dtype)
    for piece in leaf.pieces:
        inter = [
            slice(max(r.start, w.start), min(r.stop, w.stop))
            for r, w in zip(piece.region, want, strict=True)
        ]
        if any(s.start >= s.stop for s in inter):
            continue
        inner = [
            slice(s.start - r.start, s.stop - r.start)
            for d, (s, r) in enumerate(zip(inter, piece.region, strict=True))
            if d not in piece.squeezed
        ]
        if piece.perm is None:
            index = tuple(inner)
        else:  # the piece's axis k is the source's axis perm[k]
            index = [slice(None)] * len(inner)
            for k, axis in enumerate(piece.perm):
                index[axis] = inner[k]
            index = tuple(index)
        values = source.read(piece.name, index)
        if piece.perm is not None:
            values = values.transpose(piece.perm)
        target = tuple(
            slice(s.start - w.start, s.stop - w.start) for s, w in zip(inter, want, strict=True)
        )
        out[target] = values.reshape(out[target].shape).astype(leaf.dtype)
    return out


def _build(leaf: _Leaf, source: Source, keep: Any, loaded: set[str]) -> Any:
    if leaf.path not in loaded:
        return keep
    if leaf.sharding is None:
        return _block(leaf, source, (slice(None),) * len(leaf.shape))
    return jax.make_array_from_callback(
        leaf.shape, leaf.sharding, lambda index: _block(leaf, source, index)
    )


def load_weights(
    source: Any,
    into: Any,
    *,
    rename: Rules = None,
    strict: bool = True,
    allow_pickle: bool = False,
) -> Any:
    """``into``'s tree filled from ``source``.

    Args:
        source: a ``.safetensors`` file; a folder ``save_pretrained`` wrote
            (``model.safetensors`` or sharded with ``model.safetensors.index.json``);
            a PyTorch ``state_dict`` file (``.pt``, ``.bin``); a Lightning
            ``.ckpt`` (its ``state_dict``); a checkpoint folder of this project;
            or a mapping of names to arrays.
        into: the variables tree to fill: arrays, or abstract leaves
            (``jax.ShapeDtypeStruct``, e.g. from ``jax.eval_shape(model.init,
            ...)``). A leaf with a ``sharding`` is built with it, each process
            reading only its devices' blocks; the others come back as numpy arrays.
        rename: rules from source names to tree paths (`weight_rules`).
        strict: raise `WeightsMismatchError` naming every missing, unexpected
            and mismatched name; ``False`` loads what fits, keeps ``into``'s
            value for the rest and warns with the same report.
        allow_pickle: let torch unpickle objects besides tensors (trusted files only).

    Returns:
        The tree of ``into``, arrays in its dtypes (floating-point sources cast).
    """
    opened = open_source(source, allow_pickle=allow_pickle)
    leaves, report, treedef = plan(opened, into, rename)
    kept = jax.tree.leaves(nn.meta.unbox(into))
    unfilled = [
        leaf.path
        for leaf, k in zip(leaves, kept, strict=True)
        if isinstance(k, jax.ShapeDtypeStruct) and leaf.path not in report.loaded
    ]
    if strict and not report.ok or unfilled:
        # an abstract leaf has no value to keep: missing even when not strict
        missing = sorted(set(report.missing) | set(unfilled))
        raise WeightsMismatchError(dataclasses.replace(report, missing=missing))
    if not report.ok:
        rank_zero_warn(str(report))
    loaded = set(report.loaded)
    built = [_build(leaf, opened, k, loaded) for leaf, k in zip(leaves, kept, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, built)


def check_weights(
    source: Any, into: Any, *, rename: Rules = None, allow_pickle: bool = False
) -> WeightsReport:
    """What `load_weights` would load, without reading any array."""
    return plan(open_source(source, allow_pickle=allow_pickle), into, rename)[1]


def save_weights(
    variables: Any,
    path: str | os.PathLike[str],
    *,
    rename: Rules = None,
    max_shard_size: int = 5 * 2**30,
    metadata: Mapping[str, str] | None = None,
) -> list[str]:
    """Writes ``variables`` as safetensors, named by the inverse of ``rename``.

    ``path`` ending in ``.safetensors`` is one file; otherwise a folder gets
    ``model.safetensors``, or, past ``max_shard_size`` bytes, shards with the
    ``model.safetensors.index.json`` that ``transformers`` reads. Sharded arrays
    are gathered to the host first; one process writes. Returns the files written.
    """
    named = _named_arrays(variables, rename)
    if jax.process_index() != 0:
        return []
    path = os.fspath(path)
    if path.endswith(".safetensors"):
        safetensors_format.write(path, named, metadata)
        return [path]
    os.makedirs(path, exist_ok=True)
    groups: list[list[str]] = [[]]
    size = 0
    for name in sorted(named):
        nbytes = named[name].nbytes
        if groups[-1] and size + nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    if len(groups) == 1:
        file = os.path.join(path, SINGLE)
        safetensors_format.write(file, named, metadata)
        return [file]
    files = safetensors_format.shard_names(groups)
    for file, group in zip(files, groups, strict=True):
        safetensors_format.write(os.path.join(path, file), {n: named[n] for n in group}, metadata)
    index = {
        "metadata": {"total_size": sum(a.nbytes for a in named.values())},
        "weight_map": {n: file for file, group in zip(files, groups, strict=True) for n in group},
    }
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump(index, f, indent=2)
    return [os.path.join(path, f) for f in files]


def _host(leaf: Any) -> np.ndarray:
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    return np.asarray(jax.device_get(leaf))


def _named_arrays(variables: Any, rename: Rules) -> dict[str, np.ndarray]:
    inverse = target_to_sources(rename)
    named: dict[str, np.ndarray] = {}
    for keys, leaf in jax.tree_util.tree_flatten_with_path(nn.meta.unbox(variables))[0]:
        path, array = _path(keys), _host(leaf)
        pairs = list(inverse(path, array.shape))
        if not pairs:
            raise ValueError(f"no rename rule writes {path}; add a rule whose target matches it")
        for name, where in pairs:
            region, squeezed = _region(where.index, array.shape)
            part = array[region].reshape(
                [r.stop - r.start for d, r in enumerate(region) if d not in squeezed]
            )
            perm = where.permutation(part.ndim)
            if perm is not None:
                part = part.transpose(np.argsort(perm))
            if name in named:
                raise ValueError(f"two tree paths write the name {name!r}; check the rules")
            named[name] = np.ascontiguousarray(part)
    return named
