"""Hook dispatch: the callbacks' hook by name, in order, then the module's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxlightning.callbacks import Callback, EarlyStopping, ModelCheckpoint, TQDMProgressBar
from jaxlightning.callbacks.base import Extensions
from jaxlightning.cluster.rank_zero import rank_zero_info
from jaxlightning.module import JaxModule
from jaxlightning.training import contract

_STAGES = ("train", "validation", "test", "predict")

# JaxModule hooks the Trainer calls after the callbacks' hooks of the same name
# (Lightning's order, its models/test_hooks.py call lists).
MODULE_HOOKS = frozenset(
    {
        "on_fit_start",
        "on_fit_end",
        "on_train_start",
        "on_train_end",
        *(f"on_{s}_{when}" for s in _STAGES for when in ("start", "end")),
        *(f"on_{s}_epoch_{when}" for s in _STAGES for when in ("start", "end")),
        *(f"on_{s}_batch_{when}" for s in _STAGES for when in ("start", "end")),
        "on_save_checkpoint",
        "on_load_checkpoint",
        "teardown",
    }
)


# Hooks called for every batch whose base implementations (`Callback`'s and
# `JaxModule`'s) do nothing: only those who override them are called.
_BATCH_HOOKS = frozenset(f"on_{s}_batch_{when}" for s in _STAGES for when in ("start", "end"))


def _own(obj: Any, hook: str, base: type) -> Any:
    """``obj``'s ``hook``, or ``None`` where it has none or only ``base``'s."""
    fn = getattr(obj, hook, None)
    return None if getattr(fn, "__func__", None) is getattr(base, hook) else fn


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether ``a`` and ``b`` hold the same objects in the same order."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def _monitors(callback: Callback) -> bool:
    """Whether ``callback`` acts on monitored values (checkpointing, early stopping):
    at a train epoch's end it runs after the module, which may log them there."""
    return isinstance(callback, (ModelCheckpoint, EarlyStopping))


class Hooks:
    """Calls hooks on the callbacks (with the Trainer's read-only view) and the module.

    Args:
        callbacks: called in order; each gets ``view`` as its first argument.
        view: what callbacks see of the Trainer (`jaxlightning.callbacks.TrainerView`).
    """

    def __init__(self, callbacks: Sequence[Callback], view: Any) -> None:
        self.callbacks = callbacks
        self.view = view
        self._extensions: tuple[tuple[Callback, ...], Extensions] | None = None

    @property
    def extensions(self) -> Extensions:
        """The callbacks' optional methods, collected once for a list of
        callbacks (again when it changes: a fit's ``configure_callbacks``, a
        plateau scheduler's stepper)."""
        # Keyed on the callbacks themselves (held, so no freed one's id is reused)
        now = tuple(self.callbacks)
        if self._extensions is None or not _same(self._extensions[0], now):
            self._extensions = (now, Extensions.of(now))
        return self._extensions[1]

    def __call__(self, hook: str, module: JaxModule, *args: Any) -> Any:
        """The callbacks' ``hook``, in order, then the module's (Lightning's order);
        returns what the module's returned (``on_train_batch_start``'s -1).
        Meanwhile the module knows which hook runs (``self.log``'s rules).

        A batch hook runs only where it is overridden: the base ones do
        nothing, and skipping them is ~10 us a step of a fit's host time."""
        if hook in _BATCH_HOOKS:
            fns = [fn for c in self.callbacks if (fn := _own(c, hook, Callback)) is not None]
            own = _own(module, hook, JaxModule)
            if not fns and own is None:
                return None
            with contract.in_hook(module, hook):
                for fn in fns:
                    fn(self.view, module, *args)
                return None if own is None else own(*args)
        with contract.in_hook(module, hook):
            self._callbacks(hook, module, self.callbacks, *args)
            if hook in MODULE_HOOKS or (hook == "setup" and contract.stage_setup(module)):
                return getattr(module, hook)(*args)
        return None

    def train_epoch_end(self, module: JaxModule) -> None:
        """``on_train_epoch_end``: the callbacks, the module, then the monitoring
        callbacks, so that `ModelCheckpoint` and `EarlyStopping` see what the
        module logged in its hook (Lightning's order)."""
        with contract.in_hook(module, "on_train_epoch_end"):
            others = [c for c in self.callbacks if not _monitors(c)]
            self._callbacks("on_train_epoch_end", module, others)
            module.on_train_epoch_end()
            monitoring = [c for c in self.callbacks if _monitors(c)]
            self._callbacks("on_train_epoch_end", module, monitoring)

    def _callbacks(self, hook: str, module: JaxModule, callbacks: Any, *args: Any) -> None:
        for callback in callbacks:
            fn = getattr(callback, hook, None)
            if fn is not None:
                fn(self.view, module, *args)

    def attach_module_callbacks(self, module: JaxModule) -> None:
        """Merges ``module.configure_callbacks()`` into the callbacks (the
        Trainer's list itself), Lightning's rule: a returned callback replaces
        those of its type, and `ModelCheckpoint` s move to the end."""
        if not contract.overrides(module, "configure_callbacks"):
            return
        returned = module.configure_callbacks()
        added = list(returned) if isinstance(returned, (list, tuple)) else [returned]
        if not added:
            return
        types = {type(c) for c in added}
        replaced = [type(c).__name__ for c in self.callbacks if type(c) in types]
        if replaced:
            rank_zero_info(
                "The following callbacks returned in `configure_callbacks` will override "
                f"existing callbacks passed to Trainer: {', '.join(sorted(set(replaced)))}"
            )
        merged = [c for c in self.callbacks if type(c) not in types] + added
        last = [c for c in merged if isinstance(c, ModelCheckpoint)]
        self.callbacks[:] = [c for c in merged if not isinstance(c, ModelCheckpoint)] + last

    def of_type(self, kind: type) -> list[Any]:
        """The callbacks that are instances of ``kind``."""
        return [c for c in self.callbacks if isinstance(c, kind)]

    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        """The first `ModelCheckpoint` among the callbacks."""
        return next(iter(self.of_type(ModelCheckpoint)), None)

    @property
    def checkpoint_callbacks(self) -> list[ModelCheckpoint]:
        """Every `ModelCheckpoint` among the callbacks, in order."""
        return self.of_type(ModelCheckpoint)

    @property
    def progress_bar_callback(self) -> Any:
        """The progress bar among the callbacks (``None`` when it is off)."""
        return next(iter(self.of_type(TQDMProgressBar)), None)

    def keyed(self, legacy: bool = False) -> list[tuple[str, Callback]]:
        """Each callback with the key its state is saved under in checkpoints: its
        ``state_key`` where it defines one (`EarlyStopping`: class, monitor and
        mode, as in Lightning), else its class name; numbered from the second
        of a key on. ``legacy``: class names only (checkpoints written before)."""
        seen: dict[str, int] = {}
        keys = []
        for cb in self.callbacks:
            name = type(cb).__name__
            if not legacy:
                key = getattr(cb, "state_key", None)
                # a type (Lightning's legacy key): its name, which JSON can hold
                name = (key.__qualname__ if isinstance(key, type) else key) or name
            seen[name] = seen.get(name, 0) + 1
            keys.append((name if seen[name] == 1 else f"{name}_{seen[name]}", cb))
        return keys
