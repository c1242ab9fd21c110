"""The `Logger` interface."""

from __future__ import annotations

import abc
import inspect
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import yaml

from jaxlightning.cluster import distributed
from jaxlightning.io import storage

_VERSION_DIR = re.compile(r"version_(\d+)")


class Logger(abc.ABC):
    """Receives host-side metric values; never sees device arrays.

    Contract: `log_hyperparams` is called once at the start of `fit`;
    `log_metrics` at each train logging interval, at each epoch's end and after
    each validation or test, with floats and the global step; `resume_in` first
    when `fit` resumes from a checkpoint, with the run directory it recorded;
    `finalize` once at the end of `fit`, `validate` or `test`, after which the
    logger may be used again. In a multi-process run every process calls them;
    loggers write on process 0 only.
    """

    @property
    @abc.abstractmethod
    def log_dir(self) -> str: ...

    @abc.abstractmethod
    def log_hyperparams(self, params: Mapping[str, Any]) -> None: ...

    @abc.abstractmethod
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None: ...

    def resume_in(self, log_dir: str) -> None:  # noqa: B027 - optional hook
        """Continues the run that logged into ``log_dir`` (called when `fit` resumes
        from a checkpoint, before anything is logged); by default ignored."""

    def finalize(self, status: str = "success") -> None:  # noqa: B027 - optional hook
        """Flushes pending output when a Trainer call ends: ``status`` is
        ``"success"``, or ``"failed"`` when it ended with an error (Lightning's
        values). A ``finalize(self)`` of a logger written before is called
        without it."""

    @property
    def experiment(self) -> Any:
        """The underlying writer, for what `log_metrics` does not cover (images,
        histograms, text); ``None`` on processes that write nothing."""
        return None


def scalars(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """``metrics`` with one-element tensors and arrays (torch, numpy, JAX) as
    Python numbers, as Lightning's loggers take them."""

    def plain(v: Any) -> Any:
        if isinstance(v, (bool, int, float, str)) or not hasattr(v, "item"):
            return v
        return v.item() if np.asarray(v).size == 1 else v

    return {k: plain(v) for k, v in metrics.items()}


def flat_params(params: Mapping[Any, Any]) -> dict[str, Any]:
    """Hyperparameters with string keys (``{123: 3}`` is logged as ``{"123": 3}``)."""
    return {str(k): v for k, v in params.items()}


def write_hparams_yaml(folder: str, params: Mapping[Any, Any]) -> None:
    """``hparams.yaml`` in ``folder``: plain values as they are, others as their repr."""
    plain = {
        k: v if isinstance(v, (bool, int, float, str)) else repr(v)
        for k, v in flat_params(params).items()
    }
    storage.makedirs(folder)
    with storage.open_file(storage.join(folder, "hparams.yaml"), "w") as f:
        yaml.safe_dump(plain, f)


def finalize_all(loggers: Sequence[Logger], *, quiet: bool = False) -> None:
    """Finalizes every logger, even after one fails, so that each still writes
    its files; then raises the first failure (later ones become warnings).
    With ``quiet`` (a run already failing, whose error is the one to see),
    every failure becomes a warning."""
    failures: list[tuple[Logger, Exception]] = []
    status = "failed" if quiet else "success"
    for logger in loggers:
        try:
            if _takes_status(logger.finalize):
                logger.finalize(status)
            else:
                logger.finalize()
        except Exception as exc:
            failures.append((logger, exc))
    for logger, exc in failures if quiet else failures[1:]:
        warnings.warn(f"{type(logger).__name__}.finalize() failed: {exc}", stacklevel=3)
    if failures and not quiet:
        raise failures[0][1]


def next_version(root: str) -> int:
    """The first ``version_N`` number not taken under ``root``."""
    found = [_VERSION_DIR.fullmatch(d) for d in storage.listdir(root)]
    return max((int(m.group(1)) + 1 for m in found if m), default=0)


class VersionedLogger(Logger):
    """A logger writing into ``{save_dir}/{name}/version_{N}/``, Lightning's layout.

    The version is the next free one, chosen when first needed, so every run
    gets its own folder; process 0 picks it for every process.

    Args:
        save_dir: the root folder.
        name: the experiment folder under it.
        version: a fixed version instead of the next free one: a number (the
            folder ``version_{N}``) or a name (the folder itself, as Lightning).
    """

    def __init__(
        self, save_dir: str, name: str | None = "lightning_logs", version: int | str | None = None
    ) -> None:
        self.save_dir = os.fspath(save_dir)
        self.name = name or ""  # None or "": versions directly under save_dir, as Lightning
        self._version = version
        self.continues = False  # a resumed fit logs on into its run directory

    @property
    def root_dir(self) -> str:
        """The folder holding the versions: ``{save_dir}/{name}`` (``save_dir``
        when the name is empty)."""
        return storage.join(self.save_dir, self.name) if self.name else self.save_dir

    def resume_in(self, log_dir: str) -> None:
        """Logs into ``log_dir`` when it is one of this logger's version folders and
        no version is fixed yet, so a resumed run stays one run (`continues`:
        its files are continued, not replaced)."""
        if self._version is None:
            parent, leaf = storage.split(log_dir)
            match = _VERSION_DIR.fullmatch(leaf)
            if match and parent == storage.resolve(self.root_dir):
                self._version = int(match.group(1))
        self.continues = self.continues or storage.resolve(self.log_dir) == storage.resolve(log_dir)

    @property
    def version(self) -> int | str:
        if self._version is None:
            # Process 0 picks it; in a multi-process run every process must ask at
            # the same point (the Trainer does, at the start of each run).
            version = next_version(self.root_dir)
            self._version = int(distributed.broadcast(np.int32(version)))
        return self._version

    @property
    def log_dir(self) -> str:
        version = self.version
        folder = version if isinstance(version, str) else f"version_{version}"
        return storage.join(self.root_dir, folder)


def _takes_status(finalize: Any) -> bool:
    """Whether a logger's ``finalize`` takes Lightning's ``status``."""
    try:
        params = inspect.signature(finalize).parameters.values()
    except (TypeError, ValueError):
        return True
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return any(p.kind in kinds or p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
