"""Hook dispatch: the callbacks' hook by name, in order, then the module's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxlightning.callbacks import Callback
from jaxlightning.module import JaxModule

# JaxModule hooks the Trainer calls after the callbacks' hooks of the same name.
MODULE_HOOKS = frozenset(
    {
        "on_fit_start",
        "on_fit_end",
        "on_train_start",
        "on_train_end",
        "on_train_epoch_start",
        "on_train_epoch_end",
        "on_validation_epoch_start",
        "on_validation_epoch_end",
        "on_test_epoch_start",
        "on_test_epoch_end",
        "on_save_checkpoint",
        "on_load_checkpoint",
    }
)


class Hooks:
    """Calls hooks on the callbacks (with the Trainer's read-only view) and the module.

    Args:
        callbacks: called in order; each gets ``view`` as its first argument.
        view: what callbacks see of the Trainer (`jaxlightning.callbacks.TrainerView`).
    """

    def __init__(self, callbacks: Sequence[Callback], view: Any) -> None:
        self.callbacks = callbacks
        self.view = view

    def __call__(self, hook: str, module: JaxModule, *args: Any) -> None:
        """The callbacks' ``hook``, in order, then the module's (Lightning's order)."""
        for callback in self.callbacks:
            fn = getattr(callback, hook, None)
            if fn is not None:
                fn(self.view, module, *args)
        if hook in MODULE_HOOKS:
            getattr(module, hook)(*args)

    def of_type(self, kind: type) -> list[Any]:
        """The callbacks that are instances of ``kind``."""
        return [c for c in self.callbacks if isinstance(c, kind)]

    def keyed(self) -> list[tuple[str, Callback]]:
        """Each callback with the key its state is saved under in checkpoints:
        its class name, numbered from the second of a kind on."""
        seen: dict[str, int] = {}
        keys = []
        for cb in self.callbacks:
            name = type(cb).__name__
            seen[name] = seen.get(name, 0) + 1
            keys.append((name if seen[name] == 1 else f"{name}_{seen[name]}", cb))
        return keys
