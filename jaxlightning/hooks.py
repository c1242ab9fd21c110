"""Hooks and reporting: how the Trainer calls callbacks and module hooks, and
where reported values go.

Part of the Trainer, kept in its own file so that the training loop reads on
its own.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

from jaxlightning.datamodule import prepare as prepare_datamodule
from jaxlightning.loggers import Logger
from jaxlightning.module import JaxModule
from jaxlightning.reporting import Report

# JaxModule hooks the Trainer calls after the callbacks' hooks of the same name.
_MODULE_HOOKS = frozenset(
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


def as_loggers(logger: Any) -> list[Logger]:
    loggers = list(logger) if isinstance(logger, (list, tuple)) else [logger]
    loggers = [lg for lg in loggers if lg is not None and lg is not False]
    for lg in loggers:
        if not isinstance(lg, Logger):
            raise TypeError(
                f"logger={lg!r}: use True (TensorBoard), False, a jaxlightning Logger "
                "(TensorBoardLogger, CSVLogger, ...) or a list of them"
            )
    return loggers


class HooksMixin:
    """Callback and module hooks, stages, and the publishing of values."""

    def _call(self, hook: str, module: JaxModule, *args: Any) -> None:
        """The callbacks' ``hook``, in order, then the module's (Lightning's order)."""
        for callback in self.callbacks:
            fn = getattr(callback, hook, None)
            if fn is not None:
                fn(self, module, *args)
        if hook in _MODULE_HOOKS:
            getattr(module, hook)(*args)

    @contextlib.contextmanager
    def _stage(self, stage: str, module: JaxModule, datamodule: Any) -> Iterator[None]:
        """Runs a Trainer call: ``setup``/``teardown`` (always) with ``stage``, and
        ``on_exception`` when it fails; the datamodule is prepared and set up."""
        module._trainer = self
        previous, self.stage = self.stage, stage
        if datamodule is not None:
            self.datamodule = datamodule
            prepare_datamodule(datamodule, stage)
        self._call("setup", module, stage)
        try:
            with self._host_threads():
                yield
        except BaseException as exc:
            if not isinstance(exc, SystemExit):  # a signal's clean stop is not a failure
                self._call("on_exception", module, exc)
            raise
        finally:
            self._call("teardown", module, stage)
            self.stage = previous
            if datamodule is not None and hasattr(datamodule, "teardown"):
                datamodule.teardown(stage)

    def _log_host(self, name: str, value: Any, *, prog_bar: bool, logger: bool) -> None:
        """``self.log`` from a module's host-side hook: logged at once, as named."""
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise TypeError(
                f"self.log({name!r}, ...) in a host-side hook got a {type(value).__name__}; "
                "log a number"
            ) from None
        values = Report(values={name: number})
        if logger:
            values.logged[name] = number
        if prog_bar:
            values.bar[name] = number
        self._publish(values)

    def _publish(self, values: Report) -> None:
        """Hands reported values to ``callback_metrics``, the bar and the loggers."""
        self.callback_metrics = {**self.callback_metrics, **values.values}
        self.progress_bar_metrics = {**self.progress_bar_metrics, **values.bar}
        if values.logged:
            self.logged_metrics = {**values.logged, "epoch": float(self.current_epoch)}
            for logger in self.loggers:
                logger.log_metrics(self.logged_metrics, step=self.global_step)

    def _finalize_loggers(self, *, quiet: bool = False) -> None:
        """Finalizes every logger; with ``quiet`` (a run already failing), a
        logger's own failure becomes a warning instead of an exception."""
        for logger in self.loggers:
            try:
                logger.finalize()
            except Exception as exc:
                if not quiet:
                    raise
                warnings.warn(f"{type(logger).__name__}.finalize() failed: {exc}", stacklevel=2)
