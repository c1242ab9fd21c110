"""Metrics to a CSV file and hyperparameters to YAML, in Lightning's layout."""

from __future__ import annotations

import csv
import warnings
from collections.abc import Mapping
from typing import Any

from jaxlightning.cluster import distributed
from jaxlightning.io import storage
from jaxlightning.loggers.base import VersionedLogger, scalars, write_hparams_yaml


class CSVLogger(VersionedLogger):
    """Writes ``metrics.csv`` and ``hparams.yaml`` into ``{save_dir}/{name}/version_{N}/``.

    One row per `log_metrics` call: a ``step`` column and one column per metric
    name (empty where a row does not have it), as Lightning's `CSVLogger`
    writes it. Rows are buffered and written every ``flush_logs_every_n_steps``
    rows and at `finalize`; a name seen for the first time rewrites the file
    with the wider header. Only process 0 writes. `experiment` is the logger
    itself.

    Args:
        save_dir: the root folder.
        name: the experiment folder under it (``None`` or ``""``: none, the
            versions go directly under ``save_dir``).
        version: a fixed version instead of the next free one: a number (the
            folder ``version_{N}``) or a name (the folder itself, as Lightning).
        flush_logs_every_n_steps: rows buffered before they are written.
    """

    def __init__(
        self,
        save_dir: str,
        name: str | None = "lightning_logs",
        version: int | str | None = None,
        flush_logs_every_n_steps: int = 100,
    ) -> None:
        super().__init__(save_dir, name, version)
        self.flush_logs_every_n_steps = flush_logs_every_n_steps
        self._rows: list[dict[str, Any]] = []
        self._header: list[str] = []
        self._logged = 0  # rows logged by this logger

    @property
    def metrics_file_path(self) -> str:
        return storage.join(self.log_dir, "metrics.csv")

    @property
    def experiment(self) -> CSVLogger | None:
        return self if distributed.is_rank_zero() else None

    def log_hyperparams(self, params: Mapping[str, Any] | None = None) -> None:
        """Writes ``params`` (none: an empty file, as Lightning) to ``hparams.yaml``."""
        if not distributed.is_rank_zero():
            return
        write_hparams_yaml(self.log_dir, params or {})

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """One row; without ``step``, the row's number in this logger (Lightning's)."""
        if not distributed.is_rank_zero():
            return
        if step is None:
            step = self._logged
        self._logged += 1
        self._rows.append({"step": step, **scalars(metrics)})
        if len(self._rows) >= self.flush_logs_every_n_steps:
            self.save()

    def save(self) -> None:
        """Writes the buffered rows."""
        if not self._rows:
            return
        storage.makedirs(self.log_dir)
        path = self.metrics_file_path
        if not self._header and storage.exists(path):
            if not self.continues:  # another run's file: replaced, as Lightning's
                self._replace_old_run(path)
            else:  # a resumed run: continue the file
                with storage.open_file(path, newline="") as f:
                    self._header = next(csv.reader(f), [])
        new = [k for row in self._rows for k in row if k not in self._header]
        # An object cannot be appended to: it is written whole each time.
        if new or storage.is_remote(path):
            self._header += list(dict.fromkeys(new))
            old = []
            if storage.exists(path):
                with storage.open_file(path, newline="") as f:
                    old = list(csv.DictReader(f))
            with storage.open_file(path, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=self._header)
                writer.writeheader()
                writer.writerows(old + self._rows)
        else:
            with open(path, "a", newline="") as f:
                csv.DictWriter(f, fieldnames=self._header).writerows(self._rows)
        self._rows = []

    def _replace_old_run(self, path: str) -> None:
        warnings.warn(
            f"Experiment logs directory {self.log_dir} exists and is not empty: its "
            "metrics.csv, of an earlier run, is replaced by this run's (resume from a "
            "checkpoint of that run to continue it, or leave version unset for a new "
            "folder)",
            UserWarning,
            stacklevel=4,
        )
        storage.remove(path)

    def finalize(self, status: str = "success") -> None:
        self.save()
