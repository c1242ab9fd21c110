"""Turns SIGTERM and SIGINT (and SLURM's requeue signal) into a request to stop
at the next step boundary."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any


class StopRequest:
    """While active, the first SIGTERM/SIGINT sets `signum` instead of killing.

    A second SIGINT raises `KeyboardInterrupt` at once, for when stopping
    cleanly takes too long. A handler the user had installed for the signal
    (a Python function) is called too, after this one, as Lightning composes
    them. Outside the main thread it does nothing (Python delivers signals to
    the main thread only).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum: int | None = None
        self.signals: tuple[int, ...] = self.SIGNALS
        self.requeue_signal: int | None = None  # SLURM's: stop, save, then requeue
        self.requeue = False
        self.forward_to_sigterm = False  # let JAX's preemption service spread it
        self.received_sigterm = False  # this process got SIGTERM (Lightning's flag)
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if signum == signal.SIGTERM:
            self.received_sigterm = True
        if signum == signal.SIGINT and self.forward_to_sigterm:
            # as SIGTERM: JAX's preemption service stops every process at the same
            # step, the next one (not at the next logging interval)
            self.signum = signum  # a second Ctrl-C still stops at once
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if signum == self.requeue_signal:
            self.requeue = True
            if self.forward_to_sigterm:
                os.kill(os.getpid(), signal.SIGTERM)
                return
        self.signum = signum
        previous = self._previous.get(signum)
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)  # the user's own handler, composed

    def __enter__(self) -> StopRequest:
        self.signum, self.requeue = None, False
        if threading.current_thread() is threading.main_thread():
            watched = self.signals + ((self.requeue_signal,) if self.requeue_signal else ())
            for sig in watched:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            # None: the previous handler was not Python's; the default then.
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""


@contextlib.contextmanager
def sigint_ignored() -> Iterator[None]:
    """Within the block, SIGINT is ignored: the shutdown after a
    `KeyboardInterrupt` is not cut short by another Ctrl-C (Lightning's rule;
    unlike Lightning the previous handler returns afterwards, so a notebook or
    test runner keeps its own). Outside the main thread it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)
