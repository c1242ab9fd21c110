"""Process-0-only helpers, Lightning's ``rank_zero_only``, ``rank_zero_info`` and
``rank_zero_warn``: in a multi-process run, messages and side effects (a file
written, a line printed) happen once, on process 0 (JAX's process index).

Messages go to the ``"jaxlightning"`` logger at INFO (shown by default, as
Lightning shows its own; ``logging.getLogger("jaxlightning").setLevel(...)``
quiets them).
"""

from __future__ import annotations

import functools
import logging
import sys
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import jax

log = logging.getLogger("jaxlightning")
if not log.handlers:  # INFO shown by default, on stderr, as Lightning's messages are
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(_handler)
    log.setLevel(logging.INFO)
    log.propagate = False

F = TypeVar("F", bound=Callable[..., Any])


def rank_zero_only(fn: F) -> F:
    """``fn`` runs on process 0 only; elsewhere the call returns ``None``."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if jax.process_index() == 0:
            return fn(*args, **kwargs)
        return None

    return wrapped  # type: ignore[return-value]


@rank_zero_only
def rank_zero_info(message: str, *args: Any) -> None:
    """Logs ``message`` at INFO on process 0 (to the ``"jaxlightning"`` logger)."""
    log.info(message, *args)


@rank_zero_only
def rank_zero_warn(
    message: str, category: type[Warning] = UserWarning, stacklevel: int = 3
) -> None:
    """Warns on process 0 only (by default pointing at the caller's caller)."""
    warnings.warn(message, category, stacklevel=stacklevel)
