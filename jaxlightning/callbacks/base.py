"""The `Callback` interface."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxlightning.module import JaxModule
    from jaxlightning.trainer import Trainer


class Callback:
    """Host-side hooks the Trainer calls by name; override the ones you need.

    Hooks run on the host between dispatched steps, so keep them cheap: reading
    ``trainer.callback_metrics`` is free (values were fetched at the last
    logging interval), while touching ``trainer.state`` forces a device sync.

    Order within `fit`: ``on_fit_start``; per epoch ``on_train_epoch_start``,
    ``on_train_batch_end`` after each step is dispatched, ``on_train_epoch_end``
    (after that epoch's validation, if any); ``on_fit_end``. Each evaluation
    stage (``validation``, ``test``, ``predict``) calls ``on_<stage>_start``,
    ``on_<stage>_batch_end`` and ``on_<stage>_end``. A ``fit`` that ends by an
    exception or a signal calls ``teardown`` instead of ``on_fit_end``.

    A stateful callback returns its state from `state_dict`; it is saved in
    checkpoints and handed back to `load_state_dict` when a run resumes.
    """

    def on_fit_start(self, trainer: Trainer, module: JaxModule) -> None: ...
    def on_fit_end(self, trainer: Trainer, module: JaxModule) -> None: ...
    def on_train_epoch_start(self, trainer: Trainer, module: JaxModule) -> None: ...
    def on_train_batch_end(self, trainer: Trainer, module: JaxModule, batch_idx: int) -> None: ...
    def on_train_epoch_end(self, trainer: Trainer, module: JaxModule) -> None: ...
    def on_validation_start(self, trainer: Trainer, module: JaxModule) -> None: ...
    def on_validation_batch_end(
        self, trainer: Trainer, module: JaxModule, batch_idx: int
    ) -> None: ...
    def on_validation_end(self, trainer: Trainer, module: JaxModule) -> None: ...
    def on_test_start(self, trainer: Trainer, module: JaxModule) -> None: ...
    def on_test_batch_end(self, trainer: Trainer, module: JaxModule, batch_idx: int) -> None: ...
    def on_test_end(self, trainer: Trainer, module: JaxModule) -> None: ...
    def on_predict_start(self, trainer: Trainer, module: JaxModule) -> None: ...
    def on_predict_batch_end(self, trainer: Trainer, module: JaxModule, batch_idx: int) -> None: ...
    def on_predict_end(self, trainer: Trainer, module: JaxModule) -> None: ...
    def teardown(self, trainer: Trainer, module: JaxModule) -> None:
        """Called when ``fit`` ends by an exception or a signal; release resources."""

    def state_dict(self) -> dict[str, Any]:
        """State to store in checkpoints (JSON-serialisable); empty if stateless."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what `state_dict` returned, when a run resumes."""
