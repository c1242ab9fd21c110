"""Batches prepared ahead: a background thread converts, pads and places them.

`Prefetcher` runs a loader on a worker thread, each item through a ``prepare``
function (conversion, padding, device placement), so loading and host-to-device
copies overlap the step; `Batches` is one pass of it with its first batch taken.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import itertools
import os
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from jaxlightning.data.convert import HostBatch


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Runs the block with ``n`` torch intra-op threads (``None``: unchanged).

    On the CPU backend XLA's step and torch's batch assembly (a gather or a
    stack in the loading thread) share the cores; torch's threads then spin
    against XLA's. One thread is what torch itself gives each DataLoader worker.
    """
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class DeviceBatch:
    host: HostBatch
    data: Any
    mask: Any
    # a stateful loader's iterator state after this batch (`stateful.Stamped`)
    state: Any = None


_END = object()


_child_gc_frozen = False


@contextlib.contextmanager
def quiescent_fork() -> Iterator[None]:
    """Makes the forks started in the block (DataLoader workers) safe from JAX.

    A forked child holds a copy of every object and a single thread; locks
    that JAX's threads held at the fork stay held in it for ever. The child
    only runs Python and torch (the dataset, the collate function, the queue
    to the parent), so it meets such a lock only by finalizing a JAX object it
    inherited: a garbage collection in the child that frees a device array
    calls into XLA. Every forked child of this process therefore freezes the
    collector's generations first thing (``gc.freeze``: what it inherited is
    never collected there; the parent's collector is untouched), and JAX's
    warning, which says that fork "will likely lead to a deadlock", is not
    shown for a fork made here.
    """
    global _child_gc_frozen
    if not _child_gc_frozen and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=gc.freeze)
        _child_gc_frozen = True
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"os\.fork\(\) was called", RuntimeWarning)
        yield


def start_on_caller(loader: Iterable[Any]) -> tuple[Iterator[Any], Any]:
    """``loader``'s iterator and its first item (`_END` if it has none), both
    taken in the calling thread.

    A DataLoader starts its worker processes when its iteration starts: taken
    here, the fork happens in the thread that asked for the pass, while it
    waits for that first batch anyway, not on a prefetch thread while the
    calling thread is busy (printing the progress bar, dispatching a step).
    """
    with quiescent_fork():
        items = iter(loader)
        return items, next(items, _END)


class _Failed(NamedTuple):
    """An error preparing an item (on the thread, or ahead in the loop's),
    raised in the consuming thread when the item is asked for."""

    error: BaseException


def _last(item: Any) -> bool:
    """Whether nothing is prepared after ``item``: the end, or an error."""
    return item is _END or isinstance(item, _Failed)


class Prefetcher:
    """Iterates ``loader`` on a background thread, ``depth`` batches ahead.

    ``depth=0`` prepares each batch in the consuming thread instead. The
    iteration starts, and its first item is fetched, in the constructing
    thread (`start_on_caller`).

    Each item goes through ``prepare`` (conversion, padding, device placement)
    on that thread, so loading and host-to-device copies overlap the step.
    Exceptions are re-raised in the consuming thread. Call `close` (or use it as
    a context manager) when stopping early.

    The hand-over is a deque under one condition, and each side wakes the other
    only when it waits: the consumer when an item arrives, the thread when the
    queue is down to half its depth. Each wake-up costs a pass of the GIL
    between the threads; with ``queue.Queue`` (a wake-up per item and per
    slot) a step of a small model over in-memory batches took ~210 us of host
    time on 2 CPU cores, with this ~170 us (depth 2), against ~110 us without
    the thread.
    """

    def __init__(self, loader: Iterable[Any], prepare: Callable[[Any], Any], depth: int = 2):
        self._stop = threading.Event()
        if depth == 0:  # no thread: prepare each item when it is asked for
            self._sync: Iterator[Any] | None = (prepare(item) for item in loader)
            self._ahead: collections.deque[Any] = collections.deque()
            return
        self._sync = None
        items, first = start_on_caller(loader)
        self._depth = depth
        # The thread is woken when the queue is down to `_low` items, then fills
        # it: at depth 4, one wake-up per two batches.
        self._low = depth // 2
        self._ready: collections.deque[Any] = collections.deque()
        self._cond = threading.Condition(threading.Lock())
        self._consumer_waits = self._producer_waits = False
        self._thread = threading.Thread(
            target=self._work, args=(items, first, prepare), daemon=True, name="jl-prefetch"
        )
        self._thread.start()

    def _put(self, item: Any) -> bool:
        with self._cond:
            while len(self._ready) >= self._depth:
                if self._stop.is_set():
                    return False
                self._producer_waits = True
                self._cond.wait(0.1)
                self._producer_waits = False
            if self._stop.is_set():
                return False
            self._ready.append(item)
            if self._consumer_waits:
                self._cond.notify()
        return True

    def _get(self) -> Any:
        with self._cond:
            while not self._ready:
                self._consumer_waits = True
                self._cond.wait()
                self._consumer_waits = False
            item = self._ready.popleft()
            if self._producer_waits and len(self._ready) <= self._low:
                self._cond.notify()
        return item

    def _work(self, items: Iterator[Any], first: Any, prepare: Callable[[Any], Any]) -> None:
        try:
            for item in itertools.chain([first], items) if first is not _END else ():
                if not self._put(prepare(item)):
                    return
        except BaseException as exc:  # forwarded to the consumer
            self._put(_Failed(exc))
            return
        self._put(_END)

    def load_ahead(self, more: Callable[[int], bool] = lambda waiting: False) -> None:
        """Prepares items now, in this thread (``depth=0``; a thread is ahead
        already): one, then more while ``more(number waiting)``. The loop asks
        before it waits for the device (a report fetches the metrics of the
        steps in flight), ``more`` saying whether the device still runs them:
        the batches load while they run instead of after, with the device
        idle, and after the report the loop dispatches them back to back, the
        device's queue refilled at once. An error preparing one is raised
        where that item would have been."""
        if self._sync is None:
            return
        ahead = self._ahead
        while not ahead or (not _last(ahead[-1]) and more(len(ahead))):
            try:
                ahead.append(next(self._sync, _END))
            except Exception as exc:
                ahead.append(_Failed(exc))

    def _next_in_loop(self) -> Any:
        return self._ahead.popleft() if self._ahead else next(self._sync, _END)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        take = self._get if self._sync is None else self._next_in_loop
        while (item := take()) is not _END:
            if isinstance(item, _Failed):
                raise item.error
            yield item

    def close(self) -> None:
        self._stop.set()
        if self._sync is None:
            with self._cond:
                self._cond.notify_all()
            self._thread.join(timeout=10)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Batches:
    """One pass of prepared batches from a `Prefetcher`, its first batch taken.

    ``first`` is the first batch (``None`` when there is none), ready before
    iteration starts: the run sets itself up from its shapes. Iterating yields
    every batch, ``first`` included, once. `close` stops the prefetch thread
    whether or not iteration started (a generator's ``finally`` would not run
    if it never started), and may be called more than once.
    """

    def __init__(self, prefetcher: Prefetcher) -> None:
        self._prefetcher = prefetcher
        self._rest = iter(prefetcher)
        try:
            self.first: Any = next(self._rest, None)
        except BaseException:
            prefetcher.close()
            raise

    def __iter__(self) -> Iterator[Any]:
        if self.first is not None:
            yield self.first
            yield from self._rest

    def load_ahead(self, more: Callable[[int], bool] = lambda waiting: False) -> None:
        """See `Prefetcher.load_ahead`."""
        self._prefetcher.load_ahead(more)

    def close(self) -> None:
        self._prefetcher.close()

    def __enter__(self) -> Batches:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
