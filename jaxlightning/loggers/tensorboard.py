"""TensorBoard event files through tensorboardX."""

from __future__ import annotations

import functools
import itertools
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from tensorboardX import SummaryWriter
from tensorboardX.summary import hparams as hparams_summary

from jaxlightning.cluster import distributed
from jaxlightning.io import storage
from jaxlightning.loggers.base import VersionedLogger, flat_params, scalars, write_hparams_yaml

# tensorboardX names event files by the second they were opened in; a file
# opened again in the same second (fit, then validate) would overwrite the
# first. This suffix makes every writer's file name unique.
_WRITER_COUNT = itertools.count()


def _hparam_value(v: Any) -> bool | int | float | str:
    return v if isinstance(v, (bool, int, float, str)) else str(v)


class _WriteFailure:
    """Keeps the first error of an event file's writes instead of raising it.

    tensorboardX writes events on a thread of its own, fed by a bounded queue. A
    write that fails there (a full disk) ends that thread, and the next events
    then wait for ever on the full queue: the training hangs. Guarding the
    record writer the thread calls keeps the thread alive; the logger reports
    the error once and drops later events.
    """

    def __init__(self, writer: SummaryWriter) -> None:
        self.error: OSError | None = None
        self.reported = False
        events = getattr(writer.file_writer.event_writer, "_ev_writer", None)
        if events is None:  # another tensorboardX layout: left as it is
            return
        events.write_event = self._guard(events.write_event)
        events.flush = self._guard(events.flush)

    def _guard(self, write: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(write)
        def guarded(*args: Any) -> Any:
            if self.error is not None:
                return None
            try:
                return write(*args)
            except OSError as exc:
                self.error = exc
                return None

        return guarded


class TensorBoardLogger(VersionedLogger):
    """Writes scalars and hparams to ``{save_dir}/{name}/version_{N}/``.

    The version is the next free one, chosen when the writer is first needed,
    so every run gets its own directory. In a multi-process run only process 0
    writes. Open it with ``tensorboard --logdir {save_dir}/{name}``.
    `experiment` is the tensorboardX ``SummaryWriter``, for images, histograms
    and text: ``trainer.logger.experiment.add_histogram(...)``.

    Args:
        save_dir: the root folder.
        name: the experiment folder under it.
        version: a fixed version instead of the next free one: a number (the
            folder ``version_{N}``) or a name (the folder itself, as Lightning).
        **writer_kwargs: passed to tensorboardX's ``SummaryWriter`` (as
            Lightning's logger does), e.g. ``flush_secs=10``, ``max_queue=100``.

    A write that fails (a full disk) warns once, naming the folder and the
    error, and later events are dropped: the training goes on.
    """

    def __init__(
        self,
        save_dir: str,
        name: str | None = "lightning_logs",
        version: int | str | None = None,
        **writer_kwargs: Any,
    ) -> None:
        super().__init__(save_dir, name, version)
        self._writer_kwargs = writer_kwargs
        self._writer: SummaryWriter | None = None
        self._failure: _WriteFailure | None = None
        self._hparams: dict[str, Any] | None = None
        self._summarised: frozenset[str] = frozenset()
        self._metric_names: set[str] = set()

    @property
    def experiment(self) -> SummaryWriter | None:
        return self.writer

    @property
    def writer(self) -> SummaryWriter | None:
        """The event writer; ``None`` on processes other than 0, which write nothing."""
        if not distributed.is_rank_zero():
            return None
        if self._writer is None:
            storage.makedirs(self.log_dir)  # tensorboardX writes s3:// and gs:// itself
            suffix = f".{os.getpid()}.{next(_WRITER_COUNT):05d}"
            self._writer = SummaryWriter(
                logdir=self.log_dir, filename_suffix=suffix, **self._writer_kwargs
            )
            self._failure = _WriteFailure(self._writer)
        return self._writer

    def _failed(self) -> bool:
        """Whether the event file can no longer be written (warned once)."""
        failure = self._failure
        if failure is None or failure.error is None:
            return False
        if not failure.reported:
            failure.reported = True
            warnings.warn(
                f"TensorBoardLogger: writing events to {self.log_dir} failed "
                f"({failure.error}); later events of this run are dropped",
                stacklevel=3,
            )
        return True

    def log_hyperparams(
        self, params: Mapping[Any, Any] | None = None, metrics: Mapping[str, float] | None = None
    ) -> None:
        """Writes ``params`` to the HPARAMS tab and to ``hparams.yaml`` in the
        run directory (Lightning's file); ``metrics`` are logged at step 0."""
        # SummaryWriter.add_hparams would write into a new sub-run; write the
        # hparams summaries into this run instead so TensorBoard shows one run.
        # The experiment summary, which lists the HPARAMS tab's metric columns,
        # is written when the run's metric names are known (`finalize`).
        params = flat_params(params or {})
        self._hparams = {k: _hparam_value(v) for k, v in params.items()}
        self._summarised = frozenset()
        if self.writer is None:
            return
        _, start, end = hparams_summary(self._hparams, {})
        self.writer.file_writer.add_summary(start)
        self.writer.file_writer.add_summary(end)
        write_hparams_yaml(self.log_dir, params)
        if metrics:
            self.log_metrics(metrics, 0)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        writer = self.writer
        if writer is None or self._failed():
            return
        metrics = scalars(metrics)
        self._metric_names.update(metrics)
        for name, value in metrics.items():
            writer.add_scalar(name, value, global_step=step)

    def _write_experiment_with(self, writer: SummaryWriter) -> None:
        """The HPARAMS tab's columns: the hparams and every metric logged so far
        (TensorBoard shows each metric's last value, e.g. the final val/acc)."""
        names = frozenset(self._metric_names - {"epoch"})
        if self._hparams is None or not names or names == self._summarised:
            return
        experiment, _, _ = hparams_summary(self._hparams, dict.fromkeys(sorted(names), 0.0))
        writer.file_writer.add_summary(experiment)
        self._summarised = names

    def finalize(self, status: str = "success") -> None:
        # tensorboardX queues events for a writer thread that flush() does not
        # wait for; close() drains it. A later call opens a new event file (of
        # another name) in the same run directory, which TensorBoard reads as
        # one run.
        if self._writer is not None:
            writer, self._writer = self._writer, None  # a later call opens a new one
            if not self._failed():
                self._write_experiment_with(writer)
            try:
                writer.close()  # its last write may fail here, on this thread
            except OSError as exc:
                assert self._failure is not None  # made with the writer
                self._failure.error = self._failure.error or exc
            self._failed()
