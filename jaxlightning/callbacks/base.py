"""The `Callback` interface."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from jaxlightning.callbacks.view import TrainerView
    from jaxlightning.module import JaxModule


class Callback:
    """Host-side hooks the Trainer calls by name; override the ones you need.

    Hooks run on the host between dispatched steps, so keep them cheap: reading
    ``trainer.callback_metrics`` is free (values were fetched at the last
    logging interval), while touching ``trainer.state`` forces a device sync.
    For each hook the callbacks run first, in order, then the module's hook of
    the same name where the module has one (`JaxModule` lists them).

    The order is Lightning's (its ``models/test_hooks.py`` call lists, translated
    in ``tests/test_hook_order.py``). Within `fit`: ``setup("fit")``, (resuming:
    the module's ``on_load_checkpoint``, the callbacks' ``on_load_checkpoint``,
    then their `load_state_dict`), ``on_fit_start``, ``on_sanity_check_start``,
    the sanity check's validation with all its hooks (``trainer.sanity_checking``
    is true; its values are discarded), ``on_sanity_check_end``,
    ``on_train_start``; per epoch ``on_train_epoch_start`` (not again when a run
    resumes mid-epoch), per step ``on_train_batch_start`` before it is
    dispatched and ``on_train_batch_end`` after, validations when due,
    ``on_train_epoch_end`` (other callbacks, the module, then the monitoring
    callbacks `ModelCheckpoint` and `EarlyStopping`, so they see what the
    module logged there); then ``on_train_end``, ``on_fit_end`` and
    ``teardown("fit")``. Each evaluation (``validation``, ``test``) calls
    ``on_<stage>_start``, ``on_<stage>_epoch_start``, per batch
    ``on_<stage>_batch_start`` and ``on_<stage>_batch_end``,
    ``on_<stage>_epoch_end`` and ``on_<stage>_end``; its values are in
    ``trainer.callback_metrics`` from ``on_<stage>_epoch_end`` on. `predict`
    calls the same with ``predict``. `validate`, `test` and `predict` are
    wrapped in ``setup``/``teardown`` with their stage (``"validate"``,
    ``"test"``, ``"predict"``); with no batches (``limit_val_batches=0``, say)
    only these two run. A call that fails calls ``on_exception``, then
    ``teardown`` (which always runs). A checkpoint's JSON record passes through
    ``on_save_checkpoint`` (add JSON-serialisable entries to it).

    A stateful callback returns its state from `state_dict`; it is saved in
    checkpoints and handed back to `load_state_dict` when a run resumes.

    Beyond the hooks, a callback may define the optional methods `Extensions`
    lists (the optimizer it transforms, the variables evaluation uses, the
    steps whose state it needs, its save on a stop signal, a `StateGuard`);
    the Trainer collects them once per call and the loop asks no callback by
    name.
    """

    def setup(self, trainer: TrainerView, module: JaxModule, stage: str) -> None: ...
    def teardown(self, trainer: TrainerView, module: JaxModule, stage: str) -> None:
        """Called at the end of every stage, also when it fails; release resources."""

    def on_fit_start(self, trainer: TrainerView, module: JaxModule) -> None: ...
    def on_fit_end(self, trainer: TrainerView, module: JaxModule) -> None: ...
    def on_sanity_check_start(self, trainer: TrainerView, module: JaxModule) -> None: ...
    def on_sanity_check_end(self, trainer: TrainerView, module: JaxModule) -> None: ...
    def on_train_start(self, trainer: TrainerView, module: JaxModule) -> None: ...
    def on_train_end(self, trainer: TrainerView, module: JaxModule) -> None: ...
    def on_train_epoch_start(self, trainer: TrainerView, module: JaxModule) -> None: ...
    def on_train_batch_start(
        self, trainer: TrainerView, module: JaxModule, batch_idx: int
    ) -> None: ...
    def on_train_batch_end(
        self, trainer: TrainerView, module: JaxModule, batch_idx: int
    ) -> None: ...
    def on_train_epoch_end(self, trainer: TrainerView, module: JaxModule) -> None: ...
    def on_validation_start(self, trainer: TrainerView, module: JaxModule) -> None: ...
    def on_validation_epoch_start(self, trainer: TrainerView, module: JaxModule) -> None: ...
    def on_validation_batch_start(
        self, trainer: TrainerView, module: JaxModule, batch_idx: int
    ) -> None: ...
    def on_validation_batch_end(
        self, trainer: TrainerView, module: JaxModule, batch_idx: int
    ) -> None: ...
    def on_validation_epoch_end(self, trainer: TrainerView, module: JaxModule) -> None: ...
    def on_validation_end(self, trainer: TrainerView, module: JaxModule) -> None: ...
    def on_test_start(self, trainer: TrainerView, module: JaxModule) -> None: ...
    def on_test_epoch_start(self, trainer: TrainerView, module: JaxModule) -> None: ...
    def on_test_batch_start(
        self, trainer: TrainerView, module: JaxModule, batch_idx: int
    ) -> None: ...
    def on_test_batch_end(
        self, trainer: TrainerView, module: JaxModule, batch_idx: int
    ) -> None: ...
    def on_test_epoch_end(self, trainer: TrainerView, module: JaxModule) -> None: ...
    def on_test_end(self, trainer: TrainerView, module: JaxModule) -> None: ...
    def on_predict_start(self, trainer: TrainerView, module: JaxModule) -> None: ...
    def on_predict_epoch_start(self, trainer: TrainerView, module: JaxModule) -> None: ...
    def on_predict_batch_start(
        self, trainer: TrainerView, module: JaxModule, batch_idx: int
    ) -> None: ...
    def on_predict_batch_end(
        self, trainer: TrainerView, module: JaxModule, batch_idx: int
    ) -> None: ...
    def on_predict_epoch_end(self, trainer: TrainerView, module: JaxModule) -> None: ...
    def on_predict_end(self, trainer: TrainerView, module: JaxModule) -> None: ...
    def on_exception(
        self, trainer: TrainerView, module: JaxModule, exception: BaseException
    ) -> None:
        """Called when a stage fails, before ``teardown``."""

    def on_save_checkpoint(
        self, trainer: TrainerView, module: JaxModule, checkpoint: dict[str, Any]
    ) -> None:
        """``checkpoint`` is the JSON record being saved; entries added to it are kept."""

    def on_load_checkpoint(
        self, trainer: TrainerView, module: JaxModule, checkpoint: dict[str, Any]
    ) -> None:
        """``checkpoint`` is the JSON record of the checkpoint a run resumes from."""

    def state_dict(self) -> dict[str, Any]:
        """State to store in checkpoints (JSON-serialisable); empty if stateless."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what `state_dict` returned, when a run resumes."""


class StateGuard(Protocol):
    """Watches the train state at each state point of a fit (a report, a
    validation, a checkpoint a callback asked for, a stop signal's save, an
    epoch's end) and may send it back to an earlier point (`jl.Rollback`)."""

    def mark_good(self, reported_loss: float | None = None) -> None:
        """The state now (after a report of ``reported_loss``) is good."""

    def rolled_back(self, acc: Any) -> bool:
        """Whether the fetched accumulators ``acc`` sent the state back."""

    def checked(self) -> bool:
        """Checks the state now (fetching what it needs); whether it went back."""


Pairs = tuple[tuple[Callback, Callable[..., Any]], ...]  # (callback, its bound method)


@dataclasses.dataclass(frozen=True)
class Extensions:
    """The optional methods of a call's callbacks, beyond the hooks, each as
    ``(callback, bound method)`` pairs in callback order.

    Attributes:
        transform_optimizer: ``transform_optimizer(tx) -> tx``, applied to the
            optimizer when `fit` starts (`EMA`, `StochasticWeightAveraging`,
            `Rollback`'s rate scale).
        evaluation_variables: ``evaluation_variables(trainer, state) ->
            variables``, the variables an evaluation during `fit` uses (`EMA`).
        wants_state_at: ``wants_state_at(step) -> bool``, whether the callback
            acts on the state of exactly update ``step``: a dispatch of several
            steps ends there (`ModelCheckpoint`'s ``every_n_train_steps``).
        on_stop_signal: ``on_stop_signal(trainer, module) -> path | None``, a
            resume point saved when SIGTERM/SIGINT stops the fit.
        state_guard: ``state_guard(trainer) -> StateGuard``, built when training
            starts and consulted at each state point (`Rollback`).
        each_step: the callbacks whose train batch hooks need each step's own
            state, batch or time (``needs_each_step()``; by default, any that
            overrides ``on_train_batch_start``/``_end``): with them
            a fit that may choose runs one step per dispatch.
    """

    transform_optimizer: Pairs = ()
    evaluation_variables: Pairs = ()
    wants_state_at: Pairs = ()
    on_stop_signal: Pairs = ()
    state_guard: Pairs = ()
    each_step: tuple[Callback, ...] = ()

    @classmethod
    def of(cls, callbacks: Sequence[Callback]) -> Extensions:
        """The extensions ``callbacks`` offer."""
        found = {
            f.name: tuple((c, m) for c in callbacks if (m := getattr(c, f.name, None)))
            for f in dataclasses.fields(cls)
            if f.name != "each_step"
        }
        return cls(**found, each_step=tuple(c for c in callbacks if needs_each_step(c)))


_TRAIN_BATCH_HOOKS = ("on_train_batch_start", "on_train_batch_end")


def needs_each_step(callback: Any) -> bool:
    """Whether ``callback``'s train batch hooks must run right after their own
    step: its ``needs_each_step()`` where it defines one, else whether it
    overrides a train batch hook of `Callback` (a hook may read the state)."""
    declared = getattr(callback, "needs_each_step", None)
    if declared is not None:
        return bool(declared())
    return any(
        getattr(type(callback), hook, None) is not getattr(Callback, hook)
        for hook in _TRAIN_BATCH_HOOKS
    )
