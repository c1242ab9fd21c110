"""Paths that may be object-storage URLs: ``s3://``, ``gs://`` or any other
fsspec protocol, beside local folders.

Everything that writes or lists run files (checkpoints, loggers, the CLI's
config) goes through these few functions; a local path takes the plain `os`
calls, a URL its fsspec filesystem (``s3fs`` for ``s3://``, ``gcsfs`` for
``gs://``), with directory listings never cached, so a listing always shows
what another writer has just put there. Object stores have no folders: a
"folder" exists while some object's key starts with it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import IO, Any

_EXTRAS = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}


def is_remote(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a URL of a storage protocol (not a local path)."""
    text = os.fspath(path)
    return "://" in text and not text.startswith("file://")


def resolve(path: str | os.PathLike[str]) -> str:
    """An absolute local path, or the URL as it is (without a trailing ``/``):
    `os.path.abspath` would fold ``s3://bucket`` into a local ``s3:/bucket``."""
    text = os.fspath(path)
    if is_remote(text):
        return text.rstrip("/")
    return os.path.abspath(text)


def join(base: str, *names: str) -> str:
    """``base/name/...``: `os.path.join` for a local path, ``/`` for a URL."""
    if not is_remote(base):
        return os.path.join(base, *names)
    return "/".join([base.rstrip("/"), *names])


def split(path: str) -> tuple[str, str]:
    """``(parent, name)`` of the `resolve`d ``path``."""
    path = resolve(path)
    if not is_remote(path):
        return os.path.split(path)
    parent, _, name = path.rpartition("/")
    return parent, name


def _fs(url: str) -> tuple[Any, str]:
    import fsspec

    protocol = url.split("://", 1)[0]
    try:
        return fsspec.core.url_to_fs(url, use_listings_cache=False)
    except ImportError as exc:
        package = _EXTRAS.get(protocol, f"the fsspec package for {protocol}://")
        raise ImportError(
            f"{url}: writing to {protocol}:// needs {package} (pip install {package}); {exc}"
        ) from exc


def exists(path: str) -> bool:
    if not is_remote(path):
        return os.path.exists(path)
    fs, key = _fs(path)
    return bool(fs.exists(key))


def isdir(path: str) -> bool:
    if not is_remote(path):
        return os.path.isdir(path)
    fs, key = _fs(path)
    return bool(fs.isdir(key))


def listdir(path: str) -> list[str]:
    """The names of the entries in the folder ``path`` (``[]`` if it has none)."""
    if not is_remote(path):
        return os.listdir(path) if os.path.isdir(path) else []
    fs, key = _fs(path)
    try:
        entries = fs.ls(key, detail=False)
    except FileNotFoundError:
        return []
    names = (os.path.basename(str(e).rstrip("/")) for e in entries)
    return [n for n in names if n and n != os.path.basename(key.rstrip("/"))]


def glob(pattern: str) -> list[str]:
    """The paths matching ``pattern`` (``*`` within one level), as URLs for a URL."""
    if not is_remote(pattern):
        import glob as _glob

        return _glob.glob(pattern)
    fs, key = _fs(pattern)
    protocol = pattern.split("://", 1)[0]
    return [f"{protocol}://{p}" for p in fs.glob(key)]


def makedirs(path: str) -> None:
    """Creates the folder ``path`` (nothing to do in an object store)."""
    if not is_remote(path):
        os.makedirs(path, exist_ok=True)


@contextlib.contextmanager
def open_file(path: str, mode: str = "r", **kwargs: Any) -> Iterator[IO[Any]]:
    """Opens a file; an object is written whole when the file closes."""
    if not is_remote(path):
        with open(path, mode, **kwargs) as f:
            yield f
        return
    fs, key = _fs(path)
    with fs.open(key, mode, **kwargs) as f:
        yield f


def remove(path: str) -> None:
    """Deletes the file ``path`` (nothing if it is not there)."""
    if not is_remote(path):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        return
    fs, key = _fs(path)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(key)


def remove_tree(path: str) -> None:
    if not is_remote(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    fs, key = _fs(path)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(key, recursive=True)


def move(source: str, dest: str) -> None:
    """Moves a file or folder (in an object store: copies, then deletes)."""
    if not is_remote(source):
        os.rename(source, dest)
        return
    fs, key = _fs(source)
    target = _fs(dest)[1]
    for obj in fs.find(key):  # fsspec's mv of a prefix does not copy what is under it
        fs.copy(obj, target + obj[len(key) :])
    remove_tree(source)


def upload(
    local: str,
    url: str,
    *,
    last: tuple[str, ...] = (),
    skip: tuple[str, ...] = (),
    only: Any = None,
) -> None:
    """Copies the local folder ``local`` to ``url``, the files named in ``last``
    after every other one: a reader that waits for those sees the rest whole.
    Files named in ``skip`` stay behind; with ``only`` (a predicate on the
    relative path, ``/``-separated) just the files it accepts go."""
    fs, key = _fs(url)
    files = sorted(
        os.path.relpath(os.path.join(root, name), local).replace(os.sep, "/")
        for root, _, names in os.walk(local)
        for name in names
    )
    files = [f for f in files if f not in skip and (only is None or only(f))]
    for rel in sorted(files, key=lambda r: r in last):
        fs.put_file(os.path.join(local, *rel.split("/")), f"{key}/{rel}")


@contextlib.contextmanager
def downloaded(url: str, *, skip: tuple[str, ...] = ()) -> Iterator[str]:
    """A local copy of the folder at ``url`` (its entries named in ``skip`` left
    out), in a temporary folder removed when the block ends."""
    fs, key = _fs(url)
    local = tempfile.mkdtemp(prefix="jaxlightning-download-")
    try:
        for remote in fs.find(key):
            rel = remote[len(key.rstrip("/")) + 1 :]
            if rel.split("/", 1)[0] in skip:
                continue
            target = os.path.join(local, *rel.split("/"))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            fs.get_file(remote, target)
        yield local
    finally:
        shutil.rmtree(local, ignore_errors=True)
