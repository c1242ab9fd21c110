"""A Trainer call's frame: ``setup`` and ``teardown`` with its stage, the
datamodule prepared, ``on_exception`` when it fails, Ctrl-C as Lightning has
it, and Python's cycle collector frozen after the call's first full collection
(`frozen_after_full_collection`)."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator
from typing import Any

from jaxlightning.cluster.rank_zero import rank_zero_info
from jaxlightning.data.datamodule import prepare as prepare_datamodule
from jaxlightning.data.prefetch import torch_threads
from jaxlightning.loop import signals
from jaxlightning.loop.hooks import Hooks
from jaxlightning.module import JaxModule
from jaxlightning.reporting.reporter import Reporter
from jaxlightning.strategies import Strategy
from jaxlightning.training import contract


class Stages:
    """Runs `fit`, `validate`, `test` and `predict` calls (`running`).

    Attributes:
        stage: ``"fit"``, ``"validate"``, ``"test"`` or ``"predict"`` while one
            runs, else ``None``.
        interrupted: the last call failed or was interrupted (Lightning's flag).
        datamodule: the datamodule of the last call that had one.
        ckpt_path: the checkpoint folder the running (or last) call loaded,
            ``None`` for none (Lightning's ``trainer.ckpt_path``).
    """

    def __init__(self, view: Any, hooks: Hooks, reporter: Reporter, strategy: Strategy) -> None:
        self.view = view  # what the module sees as self.trainer
        self.hooks = hooks
        self.reporter = reporter
        self.strategy = strategy
        self.stage: str | None = None
        self.interrupted = False
        self.datamodule: Any = None
        self.ckpt_path: str | None = None

    @contextlib.contextmanager
    def running(self, stage: str, module: JaxModule, datamodule: Any) -> Iterator[None]:
        """Runs a Trainer call: ``setup``/``teardown`` (always) with ``stage``, and
        ``on_exception`` when it fails; the datamodule is prepared and set up.
        The module sees the Trainer (``self.trainer``) only while it runs."""
        previous = self.stage
        self.stage, self.ckpt_path = stage, None
        with contract.attached(module, self.view, self.reporter.log_host):
            try:
                if datamodule is not None:
                    self.datamodule = datamodule
                    prepare_datamodule(datamodule, stage)
                self.interrupted = False
                self.hooks.attach_module_callbacks(module)  # before setup, as Lightning
                self.hooks("setup", module, stage)
                self.reporter.reset()  # each call reports its own values (Lightning's reset)
                # One torch thread for in-process loading while XLA computes on the CPU.
                threads = 1 if self.strategy.on_cpu else None
                with (
                    self._failures(module, stage, datamodule),
                    torch_threads(threads),
                    frozen_after_full_collection(),
                ):
                    yield
            finally:
                self.stage = previous

    @contextlib.contextmanager
    def _failures(self, module: JaxModule, stage: str, datamodule: Any) -> Iterator[None]:
        shutdown = contextlib.ExitStack()
        try:
            yield
        except SystemExit:  # a signal's clean stop is not a failure
            raise
        except KeyboardInterrupt as exc:  # Lightning's rule: the hooks, then exit(1)
            rank_zero_info("\nDetected KeyboardInterrupt, attempting graceful shutdown ...")
            shutdown.enter_context(signals.sigint_ignored())
            self.interrupted = True
            self.hooks("on_exception", module, exc)
            raise SystemExit(1) from exc
        except BaseException as exc:
            self.interrupted = True
            self.hooks("on_exception", module, exc)
            raise
        finally:
            with shutdown:
                self.hooks("teardown", module, stage)
                if datamodule is not None and hasattr(datamodule, "teardown"):
                    datamodule.teardown(stage)


# Python's cycle collector during a Trainer call: the heap it found, frozen
# after the call's first full collection.
#
# A full collection visits every object the collector tracks; after importing
# JAX, Flax and torch that is some 400k objects, about 0.2 s on these machines.
# A loop that builds each batch in Python (a per-example ``__getitem__``, the
# default collate) moves objects into the oldest generation at every step, so
# full collections come every few dozen steps: a quarter of a batch-1024 epoch
# went to them in the per-example benchmark. Objects that survived a full
# collection made during the call are the process's own (modules, the model, the
# data), so the first such collection is followed by ``gc.freeze``: later ones
# visit only what the call made since. ``gc.unfreeze`` when the call ends hands
# them back to the collector. Nothing is collected that would not have been; an
# object made before the freeze that becomes cyclic garbage in the call waits for
# its end. A process that manages its collector (it is disabled, or something is
# frozen already) is left as it is.
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
