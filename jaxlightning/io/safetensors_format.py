"""The safetensors file format, read in slices and written, for numpy arrays.

A file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the raw row-major bytes. Read here
(rather than through ``safetensors.numpy``) because numpy has no bfloat16 or
float8 of its own: ``ml_dtypes`` gives them, and a memory map reads only the
bytes a slice touches, so a process loads just the shards its devices hold.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping
from typing import Any

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
CODES = {dtype: code for code, dtype in DTYPES.items()}
_HEADER_LIMIT = 100 * 2**20  # the format's own bound on a header


class SafetensorsFile:
    """One ``.safetensors`` file, opened lazily: names, shapes and dtypes from
    its header; an array's bytes only when `read` asks for them."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError(f"{self.path} is not a safetensors file: it is empty")
            (length,) = struct.unpack("<Q", raw)
            if length > _HEADER_LIMIT:
                raise ValueError(f"{self.path} is not a safetensors file: no valid header")
            try:
                header = json.loads(f.read(length))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ValueError(f"{self.path} is not a safetensors file: {exc}") from exc
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._offset = 8 + length
        self._entries = header
        self._map: np.memmap | None = None

    def names(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Every tensor's shape and dtype, by name."""
        found = {}
        for name, entry in self._entries.items():
            if entry["dtype"] not in DTYPES:
                raise ValueError(
                    f"{self.path}: tensor {name!r} has dtype {entry['dtype']}, which this "
                    f"reader does not know (it reads {', '.join(DTYPES)})"
                )
            found[name] = (tuple(entry["shape"]), DTYPES[entry["dtype"]])
        return found

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """The tensor ``name``, or its ``index`` slice, as a numpy array
        (copied out of the file: pages the slice does not touch stay unread)."""
        entry = self._entries[name]
        shape, dtype = tuple(entry["shape"]), DTYPES[entry["dtype"]]
        start, stop = entry["data_offsets"]
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._map[self._offset + start : self._offset + stop]
        array = raw.view(dtype).reshape(shape)
        return np.array(array if index is None else array[index])


def write(
    path: str | os.PathLike[str],
    arrays: Mapping[str, np.ndarray],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Writes ``arrays`` (name -> numpy array) as one safetensors file, tensors
    in name order, each aligned as the format's writers align them."""
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    ordered = sorted(arrays.items())
    for name, array in ordered:
        if array.dtype not in CODES:
            raise TypeError(
                f"{name!r} has dtype {array.dtype}, which safetensors cannot hold; cast it "
                f"to one of {sorted(str(d) for d in CODES)}"
            )
        header[name] = {
            "dtype": CODES[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for _, array in ordered:
            f.write(np.ascontiguousarray(array).tobytes())


def shard_names(groups: Iterable[Iterable[str]]) -> list[str]:
    """Hugging Face's file names for ``n`` shards: ``model-00001-of-0000n.safetensors``."""
    groups = list(groups)
    return [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
