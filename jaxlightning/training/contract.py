"""The module contract: every call the framework makes into a `JaxModule`'s
internals, named in one place.

A `JaxModule` keeps its framework-facing state (the traced step's log sink,
its batch mask and counters, the running Trainer, an NNX model's split graph)
in private attributes, since user subclasses own the public namespace. The
loops, steps, checks and exporters reach that state only through these
functions; this is the one module outside `jaxlightning.module` that reads a
module's private names (tests/test_structure.py checks it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax

from jaxlightning.module import JaxModule
from jaxlightning.training.nnx import NnxGraph


def overrides(module: JaxModule | type[JaxModule], hook: str) -> bool:
    """Whether the module's class defines ``hook`` itself (not `JaxModule`'s)."""
    cls = module if isinstance(module, type) else type(module)
    return cls._overrides(hook)


def stage_setup(module: JaxModule | type[JaxModule]) -> bool:
    """Whether ``setup`` is Lightning's ``setup(self, stage)``."""
    cls = module if isinstance(module, type) else type(module)
    return cls._stage_setup()


def init_hook(module: JaxModule | type[JaxModule]) -> str:
    """The hook that returns the initial variables: ``setup`` or ``configure_model``."""
    cls = module if isinstance(module, type) else type(module)
    return cls._init_hook()


# ------------------------------------------------------------------ NNX models
def nnx_model(module: JaxModule) -> Any:
    """The NNX model the module trains (``module.model``), else ``None``."""
    return module._nnx_model()


def nnx_graph(module: JaxModule) -> Any:
    """The split graph of the NNX model being trained, else ``None``."""
    return module._nnx


def prepare_nnx(module: JaxModule) -> None:
    """Splits the module's NNX model on the host, once, before tracing."""
    model = module._nnx_model()
    if model is not None and module._nnx is None:
        module._nnx = NnxGraph(model)


def hand_back(module: JaxModule, variables: Any) -> None:
    """Gives ``module`` trained ``variables`` (and its NNX model their arrays)."""
    module.variables = variables
    if module._nnx is not None:  # the model object gets its adapters merged in
        merged = variables if module.lora is None else module.lora.merged(variables)
        module._nnx.update(module.model, merged)


# --------------------------------------------------------------- traced hooks
def streams(module: JaxModule) -> tuple[str, ...]:
    """The random streams the module's traced hooks draw from."""
    return module._streams()


def call_loss(module: JaxModule, variables: Any, batch: Any, rngs: dict[str, jax.Array]) -> Any:
    """The module's ``loss`` with what it takes (variables or the merged NNX model)."""
    return module._call_loss(variables, batch, rngs)


def call_eval(
    module: JaxModule, hook: str, variables: Any, batch: Any, dataloader_idx: int | None = None
) -> Any:
    """An evaluation hook (or ``predict_step``) of the module."""
    return module._call_eval(hook, variables, batch, dataloader_idx)


def collect_logs(
    module: JaxModule,
    hook: str,
    mask: jax.Array | None = None,
    step: jax.Array | None = None,
    epoch: jax.Array | None = None,
) -> contextlib.AbstractContextManager[dict[str, jax.Array]]:
    """Within the block, ``self.log`` in the traced ``hook`` records into the
    yielded dict, with ``mask``, ``step`` and ``epoch`` as its batch mask and counters."""
    return module._collect_logs(hook, mask, step, epoch)


def explaining_traced_counters(module: JaxModule, hook: str) -> contextlib.AbstractContextManager:
    """Adds the traced-counter hint to a concretization error raised in ``hook``."""
    return module._explaining_traced_counters(hook)


# ----------------------------------------------------------------- host hooks
def in_hook(module: JaxModule, hook: str) -> contextlib.AbstractContextManager[None]:
    """Marks the host-side ``hook`` as running (``self.log``'s rules depend on it)."""
    return module._in_hook(hook)


@contextlib.contextmanager
def attached(module: JaxModule, trainer: Any, host_log: Any) -> Iterator[None]:
    """The module sees ``trainer`` (``self.trainer``) and logs from host hooks
    into ``host_log`` within the block; what it saw before comes back after.
    (getattr: a module whose __init__ skipped super().__init__() is refused later.)"""
    previous = getattr(module, "_trainer", None), getattr(module, "_host_log", None)
    module._trainer, module._host_log = trainer, host_log
    try:
        yield
    finally:
        module._trainer, module._host_log = previous
