"""The reporter: hands reported values (`report.Report`) to
``callback_metrics``, the progress bar and the loggers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from jaxlightning.loggers import Logger
from jaxlightning.loggers.base import VersionedLogger, finalize_all
from jaxlightning.progress import Progress
from jaxlightning.reporting.batch_logs import EVAL_HOOKS, BatchLogs
from jaxlightning.reporting.batch_logs import HOOKS as BATCH_HOOKS
from jaxlightning.reporting.report import Report


def as_loggers(logger: Any) -> list[Logger]:
    """The loggers of ``Trainer(logger=...)``: a `Logger`, a list, or none."""
    loggers = list(logger) if isinstance(logger, (list, tuple)) else [logger]
    loggers = [lg for lg in loggers if lg is not None and lg is not False]
    for lg in loggers:
        if not isinstance(lg, Logger):
            raise TypeError(
                f"logger={lg!r}: use True (TensorBoard), False, a jaxlightning Logger "
                "(TensorBoardLogger, CSVLogger, ...) or a list of them"
            )
    return loggers


class Reporter:
    """Moves reported values to ``callback_metrics``, the progress bar and the loggers.

    Args:
        loggers: every logged value goes to each, at the run's current step.
        progress: the run's position (the step and epoch values are logged at).
        stage_prefix: report names logged in traced hooks as ``train/<name>``,
            ``val/<name>``, ``test/<name>`` (else as logged, Lightning's rule).
    """

    def __init__(
        self, loggers: list[Logger], progress: Progress, stage_prefix: bool = False
    ) -> None:
        self.loggers = loggers
        self.progress = progress
        self.stage_prefix = stage_prefix
        self.callback_metrics: dict[str, float] = {}
        self.logged_metrics: dict[str, float] = {}
        self.progress_bar_metrics: dict[str, float] = {}
        self._discard = False
        self._host_logged: dict[str, float] | None = None
        self._held: dict[str, float] | None = None  # for one logger call (`one_write`)
        self.batch_logs = BatchLogs()  # what the training batch hooks log
        self.eval_batch_logs = BatchLogs(evaluation=True)  # the evaluation's (per loader)
        self.eval_steps: dict[int, int] = {}  # evaluation batches logged, by loader

    def reset(self) -> None:
        """Forgets every reported value (a Trainer call starts, as in Lightning)."""
        self.callback_metrics, self.logged_metrics, self.progress_bar_metrics = {}, {}, {}
        self.batch_logs = BatchLogs()
        self.eval_steps = {}

    def prefix(self, stage: str) -> str | None:
        """The prefix names logged in ``stage`` (``"train"``, ``"val"``,
        ``"test"``) are reported with: ``None`` (as logged) by default."""
        return stage if self.stage_prefix else None

    @property
    def logger(self) -> Logger | None:
        """The first logger (``None`` without one); `loggers` has them all."""
        return self.loggers[0] if self.loggers else None

    @property
    def log_dir(self) -> str | None:
        """The first logger's run directory (checkpoints go there by default)."""
        return self.loggers[0].log_dir if self.loggers else None

    def publish(self, values: Report) -> None:
        """Hands reported values to ``callback_metrics``, the bar and the loggers."""
        if not (values.values or values.logged or values.bar):
            return  # nothing (a report step whose batch hooks logged nothing)
        self.callback_metrics = {**self.callback_metrics, **values.values}
        self.progress_bar_metrics = {**self.progress_bar_metrics, **values.bar}
        if values.logged and not self._discard:
            # Lightning's rule: every value logged in this Trainer call stays in
            # ``logged_metrics``; the loggers also get ``epoch`` unless it was logged.
            self.logged_metrics = {**self.logged_metrics, **values.logged}
            if self._held is not None:
                self._held.update(values.logged)
                return
            self._write(values.logged)

    def _write(self, logged: Mapping[str, float]) -> None:
        sent = {"epoch": float(self.progress.current_epoch), **logged}
        for logger in self.loggers:
            logger.log_metrics(sent, step=self.progress.log_step)

    @contextlib.contextmanager
    def one_write(self) -> Iterator[None]:
        """Within the block (an evaluation's end and its epoch-end hooks), the
        values published reach ``callback_metrics`` at once and the loggers in
        one call when it ends, as Lightning's ``log_eval_end_metrics``."""
        self._held = {}
        try:
            yield
            held = self._held
        finally:
            self._held = None
        if held:
            self._write(held)

    def eval_loader_logs(self, suffix: str) -> BatchLogs:
        """What the evaluation batch hooks log from now on, for one loader
        (``suffix``: its ``/dataloader_idx_N``, or ``""``)."""
        self.eval_batch_logs = BatchLogs(evaluation=True, suffix=suffix)
        return self.eval_batch_logs

    def log_batches(self, reports: list[Report], loader: int = 0) -> None:
        """An evaluation's per-batch values (``on_step=True``) of loader number
        ``loader`` to the loggers, as Lightning logs them: at the count of that
        loader's batches evaluated before in this Trainer call (a fit's
        validations count on from one to the next; the sanity check's do not
        count). The last are in ``logged_metrics`` (not in ``callback_metrics``:
        Lightning keeps evaluation step values out of it)."""
        if self._discard:
            return
        start = self.eval_steps.get(loader, 0)
        self.eval_steps[loader] = start + len(reports)
        for batch_idx, values in enumerate(reports, start):
            if not values.logged:
                continue
            self.logged_metrics = {**self.logged_metrics, **values.logged}
            for logger in self.loggers:
                logger.log_metrics(dict(values.logged), step=batch_idx)

    @contextlib.contextmanager
    def discarding(self) -> Iterator[None]:
        """Within the block (the sanity check), values reach ``callback_metrics``
        and the bar's but no logger; afterwards both are as they were before."""
        before = self.callback_metrics, self.progress_bar_metrics, self._discard
        self._discard = True
        try:
            yield
        finally:
            self.callback_metrics, self.progress_bar_metrics, self._discard = before

    def log_host(
        self,
        name: str,
        value: Any,
        *,
        prog_bar: bool,
        logger: bool,
        hook: str = "",
        on_step: bool | None = None,
        on_epoch: bool | None = None,
    ) -> None:
        """``self.log`` from a module's host-side ``hook``: logged at once, as
        named; in a training batch hook by Lightning's rules for those
        (`BatchLogs`: the step values at the logging interval, the epoch's mean)."""
        try:
            number = float(value)
        except (TypeError, ValueError):  # Lightning's error for a non-scalar tensor too
            shape = getattr(value, "shape", None)
            what = (
                f"an array of shape {tuple(shape)}"
                if shape is not None
                else "a " + type(value).__name__
            )
            raise ValueError(
                f"self.log({name!r}, ...) in a host-side hook got {what}; log a single "
                "number (a scalar or one-element array)"
            ) from None
        if hook in BATCH_HOOKS or hook in EVAL_HOOKS:
            logs = self.batch_logs if hook in BATCH_HOOKS else self.eval_batch_logs
            opts = {"on_step": on_step, "on_epoch": on_epoch, "prog_bar": prog_bar}
            self.publish(logs.add(name, number, **opts, logger=logger))
            return
        values = Report(values={name: number})
        if self._host_logged is not None:
            self._host_logged[name] = number
        if logger:
            values.logged[name] = number
        if prog_bar:
            values.bar[name] = number
        self.publish(values)

    @contextlib.contextmanager
    def collecting_host_logs(self) -> Iterator[dict[str, float]]:
        """Within the block, the values module hooks log on the host are also
        gathered in the yielded dict (an evaluation returns them, as Lightning's
        ``validate``/``test`` return what ``on_validation_epoch_end`` logged)."""
        before, self._host_logged = self._host_logged, {}
        try:
            yield self._host_logged
        finally:
            self._host_logged = before

    def log_hyperparams(self, hparams: Mapping[str, Any]) -> None:
        for logger in self.loggers:
            logger.log_hyperparams(hparams)

    def fix_run_dirs(self) -> None:
        """Chooses every versioned logger's run directory now, before any of them
        writes: loggers sharing a folder (TensorBoard and CSV under
        ``lightning_logs``) then share the run's ``version_N`` too, and every
        process of a multi-process run asks at the same point."""
        for logger in self.loggers:
            if isinstance(logger, VersionedLogger):
                _ = logger.version

    def resume_in(self, log_dir: str | None) -> None:
        """Resumes logging into a checkpoint's run directory (one run in TensorBoard)."""
        if log_dir:
            for logger in self.loggers:
                logger.resume_in(log_dir)

    def finalize(self, *, quiet: bool = False) -> None:
        """Finalizes every logger (each one, whatever another raises); with
        ``quiet`` (a run already failing), their failures become warnings."""
        finalize_all(self.loggers, quiet=quiet)
