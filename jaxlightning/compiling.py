"""Start-up work on worker threads: XLA compiles while the host traces what is next.

On a fresh start a small model spends most of its first seconds compiling. XLA
compiles without holding Python's GIL, so the initial state's program can
compile on a worker thread while the main thread traces the train step, and
the train step can compile while the main thread sets up logging and the
first batches.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


def in_background(fn: Callable[[], Any]) -> Future[Any]:
    """Runs ``fn`` on a daemon thread; ``result()`` waits for it, re-raising its error."""
    future: Future[Any] = Future()

    def work() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # handed to whoever waits on the result
            future.set_exception(exc)

    threading.Thread(target=work, daemon=True, name="jl-compile").start()
    return future


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
        lowered = jitted.trace(*example).lower()
        self._pending: Future[Any] | None = in_background(lowered.compile)
        self._compiled: Any = None

    def __call__(self, *args: Any) -> Any:
        if self._pending is not None:
            self._compiled = self._pending.result()
            self._pending = None
        if self._compiled is not None:
            try:
                return self._compiled(*args)
            except TypeError:
                # Argument types other than the compiled ones (raised before
                # anything runs or is donated): from now on the jitted function.
                self._compiled = None
        return self._jitted(*args)
