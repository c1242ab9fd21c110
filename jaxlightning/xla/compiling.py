"""Start-up work on worker threads: XLA compiles while the host traces what is next.

On a fresh start a small model spends most of its first seconds compiling. XLA
compiles without holding Python's GIL, so the initial state's program can
compile on a worker thread while the main thread traces the train step, and
the train step can compile while the main thread sets up logging and the
first batches.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

_log = logging.getLogger(__name__)
_REJECTED_OPTION = re.compile(r"No such compile option: '([^']+)'")
# XLA options the backend rejected once in this process: not offered again.
_rejected: set[str] = set()
_rejected_attempts = 0


def rejected_attempts() -> int:
    """How many compiles in this process the backend refused for an unknown
    option (each retried without it); JAX's compile events count them too."""
    return _rejected_attempts


class Background(Future):
    """A function running on a daemon thread: a `Future` of its result that can
    also `join` the thread itself."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__()
        self._thread = threading.Thread(
            target=self._work, args=(fn,), daemon=True, name="jl-compile"
        )
        self._thread.start()

    def _work(self, fn: Callable[[], Any]) -> None:
        try:
            self.set_result(fn())
        except BaseException as exc:  # handed to whoever waits on the result
            self.set_exception(exc)

    def join(self) -> None:
        """Waits until the thread has ended (its error, if any, stays on the future)."""
        self._thread.join()


def in_background(fn: Callable[[], Any]) -> Background:
    """Runs ``fn`` on a daemon thread; ``result()`` waits for it, re-raising its error."""
    return Background(fn)


def join_quietly(task: Background | None) -> None:
    """Waits for ``task``'s thread to end, ignoring its error.

    A compile still running on a worker thread when the process exits aborts it
    (XLA's C++ is torn down under the thread), so every path out of the code
    that started one must wait for it; the error, if any, was or will be
    reported by whoever uses the result.
    """
    if task is not None:
        task.join()


def compile_with_options(lowered: Any, options: Mapping[str, Any]) -> Any:
    """``lowered.compile`` with XLA ``options`` that the backend may not know.

    Most XLA options are private to XLA and come and go between jaxlib
    releases (``xla_cpu_use_fusion_emitters`` is gone in JAX 0.11). An option
    the backend rejects is dropped, logged once at debug level, and never
    offered again in this process; the program then compiles without it.
    """
    global _rejected_attempts
    wanted = {k: v for k, v in options.items() if k not in _rejected}
    while True:
        try:
            return lowered.compile(compiler_options=wanted or None)
        except Exception as exc:
            names = set(_REJECTED_OPTION.findall(str(exc))) & set(wanted)
            if not names:
                raise
            _rejected_attempts += 1
            _rejected.update(names)
            _log.debug("XLA rejected compile option(s) %s; compiling without them", names)
            wanted = {k: v for k, v in wanted.items() if k not in names}


class Precompiled:
    """A jitted function whose program for one set of inputs compiles ahead.

    Traced and lowered on the calling thread (tracing is Python, it holds the GIL
    anyway), compiled on a worker thread. Calls with inputs of the compiled
    types run that program, waiting for the compile if needed; calls with other
    types (a batch of another size, say) go to the jitted function, which
    compiles for them as usual.

    Args:
        jitted: the ``jax.jit`` function.
        *example: its arguments, or `jax.ShapeDtypeStruct` trees of them.
    """

    def __init__(self, jitted: Any, *example: Any) -> None:
        self._jitted = jitted
        # A function whose program takes its arguments rearranged (`ParamsApart`)
        # traces as called and says how to call its program the same way.
        self._calling = getattr(jitted, "calling", lambda program: program)
        lowered = jitted.trace(*example).lower()
        self._task = in_background(lowered.compile)
        self._pending: Background | None = self._task
        self._compiled: Any = None

    def join(self) -> None:
        """Waits for the ahead-of-time compile, if it still runs (errors ignored)."""
        join_quietly(self._task)

    def compiled(self) -> Any:
        """The ``jax.stages.Compiled`` program, once compiled (waits for it);
        ``None`` if compiling failed (the first call raises the error)."""
        try:
            return self._task.result()
        except Exception:
            return None

    def __call__(self, *args: Any) -> Any:
        if self._pending is not None:
            self._compiled = self._calling(self._pending.result())
            self._pending = None
        if self._compiled is not None:
            try:
                return self._compiled(*args)
            except TypeError:
                # Argument types other than the compiled ones (raised before
                # anything runs or is donated): the jitted function compiles
                # (once) for them; the compiled types keep their program, so
                # batches of a few shapes (`BucketCollate`) compile once each.
                pass
        return self._jitted(*args)
