"""The `Logger` interface."""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any


class Logger(abc.ABC):
    """Receives host-side metric values; never sees device arrays.

    Contract: `log_hyperparams` is called once at the start of `fit`;
    `log_metrics` at each train logging interval and after each validation,
    with floats and the global step; `resume_in` first when `fit` resumes from a
    checkpoint, with the run directory it recorded; `finalize` once at the end of `fit`,
    `validate` or `test`, after which the logger may be used again.
    """

    @property
    @abc.abstractmethod
    def log_dir(self) -> str: ...

    @abc.abstractmethod
    def log_hyperparams(self, params: Mapping[str, Any]) -> None: ...

    @abc.abstractmethod
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def resume_in(self, log_dir: str) -> None:  # noqa: B027 - optional hook
        """Continues the run that logged into ``log_dir`` (called when `fit` resumes
        from a checkpoint, before anything is logged); by default ignored."""

    def finalize(self) -> None:  # noqa: B027 - optional hook
        """Flushes pending output."""
