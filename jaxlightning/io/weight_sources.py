"""Where published weights come from: a safetensors file or sharded folder, a
PyTorch ``state_dict`` file, a Lightning ``.ckpt``, a checkpoint of this
project, or a mapping of arrays. Each is opened as a `Source`: names with
shapes and dtypes first, an array's bytes (or a slice of them) on demand."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np

from jaxlightning.io.checkpoint import restore_variables
from jaxlightning.io.safetensors_format import SafetensorsFile

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class Source:
    """Named arrays to read: ``names()`` (name -> (shape, dtype)) and
    ``read(name, index)`` (the array, or its slice)."""

    def __init__(self, where: str) -> None:
        self.where = where

    def names(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        raise NotImplementedError

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        raise NotImplementedError


class SafetensorsSource(Source):
    """One safetensors file, or a folder of them with Hugging Face's index."""

    def __init__(self, where: str, files: Mapping[str, str]) -> None:
        super().__init__(where)
        opened: dict[str, SafetensorsFile] = {}
        self._files = {}
        for name, file in files.items():
            if file not in opened:
                opened[file] = SafetensorsFile(file)
            self._files[name] = opened[file]
        self._names: dict[str, Any] = {}
        for file in opened.values():
            self._names.update(file.names())
        unlisted = set(self._files) - set(self._names)
        if unlisted:
            raise ValueError(
                f"{where}: the index lists {sorted(unlisted)[:5]} but their files do not "
                "hold them; the folder is incomplete or its index is stale"
            )

    def names(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {name: self._names[name] for name in self._files}

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        return self._files[name].read(name, index)


class ArraysSource(Source):
    """A mapping of names to arrays (numpy, JAX or torch tensors, kept where
    they are until read)."""

    def __init__(self, where: str, arrays: Mapping[str, Any]) -> None:
        super().__init__(where)
        self._arrays = dict(arrays)
        for name, value in self._arrays.items():
            if not hasattr(value, "shape"):
                raise TypeError(
                    f"{where}: {name!r} is a {type(value).__name__}, not an array; pass a "
                    "mapping of names to arrays (a state_dict)"
                )

    def names(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {name: (tuple(a.shape), _numpy_dtype(a)) for name, a in self._arrays.items()}

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        value = self._arrays[name]
        return _to_numpy(value if index is None else value[index])


def _numpy_dtype(value: Any) -> np.dtype:
    dtype = value.dtype
    if type(dtype).__module__ == "torch":
        return _to_numpy(value.reshape(-1)[:0]).dtype
    return np.dtype(dtype)


def _to_numpy(value: Any) -> np.ndarray:
    if type(value).__module__.startswith("torch"):
        import torch  # only a torch tensor gets here: torch is installed

        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:
            return value.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return value.numpy()
    return np.asarray(jax.device_get(value))


def open_source(source: Any, *, allow_pickle: bool = False) -> Source:
    """The `Source` that ``source`` names: a mapping of arrays, or a path."""
    if isinstance(source, Source):
        return source
    if isinstance(source, Mapping):
        return ArraysSource("the mapping given", _flat(source))
    path = os.fspath(source)
    if os.path.isdir(path):
        return _folder(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no weights at {path}: give a file or a folder")
    if path.endswith(".safetensors"):
        return SafetensorsSource(path, {n: path for n in SafetensorsFile(path).names()})
    return _torch_file(path, allow_pickle)


def _folder(path: str) -> Source:
    index = os.path.join(path, INDEX)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = {name: os.path.join(path, file) for name, file in weight_map.items()}
        return SafetensorsSource(path, files)
    single = os.path.join(path, SINGLE)
    if os.path.exists(single):
        return open_source(single)
    if all(os.path.isdir(os.path.join(path, part)) for part in ("state", "meta")):
        return ArraysSource(path, _flat(restore_variables(path), sep="/"))
    raise FileNotFoundError(
        f"{path} is a folder without {INDEX} or {SINGLE}, and not a checkpoint of this "
        "project; give the safetensors file, the folder save_pretrained wrote, or a checkpoint"
    )


def _torch_file(path: str, allow_pickle: bool) -> Source:
    try:
        import torch
    except ImportError as exc:
        raise ImportError(f"reading {path} (a PyTorch file) needs torch installed") from exc
    try:
        loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=not allow_pickle)
    except Exception as exc:
        if allow_pickle or "weights_only" not in str(exc):
            raise ValueError(f"{path} is neither a safetensors nor a PyTorch file: {exc}") from exc
        raise ValueError(
            f"{path} holds Python objects besides tensors, which torch will not unpickle "
            "safely; if you trust the file, pass allow_pickle=True"
        ) from exc
    if isinstance(loaded, Mapping) and isinstance(loaded.get("state_dict"), Mapping):
        loaded = loaded["state_dict"]  # a Lightning checkpoint
    if not isinstance(loaded, Mapping):
        raise ValueError(f"{path} holds a {type(loaded).__name__}, not a state_dict")
    return ArraysSource(path, _flat(loaded))


def _flat(tree: Mapping[str, Any], sep: str = ".") -> dict[str, Any]:
    """Nested mappings as one level of names joined by ``sep``."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update({f"{key}{sep}{k}": v for k, v in _flat(value, sep).items()})
        else:
            out[str(key)] = value
    return out
