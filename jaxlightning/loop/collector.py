"""Python's cycle collector during a Trainer call: the heap it found, frozen
after the call's first full collection.

A full collection visits every object the collector tracks; after importing
JAX, Flax and torch that is some 400k objects, about 0.2 s on these machines.
A loop that builds each batch in Python (a per-example ``__getitem__``, the
default collate) moves objects into the oldest generation at every step, so
full collections come every few dozen steps: a quarter of a batch-1024 epoch
went to them in the per-example benchmark. Objects that survived a full
collection made during the call are the process's own (modules, the model, the
data), so the first such collection is followed by ``gc.freeze``: later ones
visit only what the call made since. ``gc.unfreeze`` when the call ends hands
them back to the collector. Nothing is collected that would not have been; an
object made before the freeze that becomes cyclic garbage in the call waits for
its end. A process that manages its collector (it is disabled, or something is
frozen already) is left as it is.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator
from typing import Any

_installed = False


@contextlib.contextmanager
def frozen_after_full_collection() -> Iterator[None]:
    """Freezes the survivors of the block's first full collection, until it ends."""
    global _installed
    if _installed or not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    # A collection may run on another thread (a prefetch thread) as the block
    # ends: the lock keeps its freeze from outliving the block.
    lock = threading.RLock()
    state = "watching"

    def after(phase: str, info: dict[str, Any]) -> None:
        nonlocal state
        if phase == "stop" and info["generation"] == 2:
            with lock:
                if state == "watching":
                    gc.freeze()
                    state = "frozen"

    _installed = True
    gc.callbacks.append(after)
    try:
        yield
    finally:
        with lock:
            gc.callbacks.remove(after)
            ended, state = state, "ended"
            if ended == "frozen":
                gc.unfreeze()
        _installed = False
