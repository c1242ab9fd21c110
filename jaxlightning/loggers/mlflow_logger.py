"""MLflow tracking, through the real ``mlflow`` client (the ``mlflow`` extra)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from jaxlightning.cluster import distributed
from jaxlightning.loggers.base import Logger


class MLFlowLogger(Logger):
    """Logs to an MLflow run (``pip install jaxlightning[mlflow]``).

    Parameters become the run's params, metrics its metric histories (by
    global step). The run is created when first needed, in ``experiment_name``
    at ``tracking_uri`` (default: a local file store ``./mlruns``). Only
    process 0 logs. `experiment` is the ``mlflow.MlflowClient``; `run_id`
    names the run.

    Args:
        experiment_name: the MLflow experiment (created if missing).
        run_name: the run's name.
        tracking_uri: e.g. ``"file:./mlruns"`` (MLflow 3 needs
            ``MLFLOW_ALLOW_FILE_STORE=true`` for a file store; this logger sets
            it when unset), ``"sqlite:///mlflow.db"`` or a server's address.
    """

    def __init__(
        self,
        experiment_name: str = "lightning_logs",
        run_name: str | None = None,
        tracking_uri: str | None = None,
    ) -> None:
        self.experiment_name, self.run_name = experiment_name, run_name
        self.tracking_uri = tracking_uri or "file:" + os.path.join(os.getcwd(), "mlruns")
        self._client: Any = None
        self.run_id: str | None = None

    @property
    def experiment(self) -> Any:
        """The ``MlflowClient`` (the run created on first use); ``None`` off process 0."""
        if not distributed.is_rank_zero():
            return None
        if self._client is None:
            from mlflow.tracking import MlflowClient

            if self.tracking_uri.startswith("file:"):
                # MLflow 3 refuses its file store unless asked for it; a local
                # folder is what this logger was asked to write to.
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")

            client = MlflowClient(tracking_uri=self.tracking_uri)
            found = client.get_experiment_by_name(self.experiment_name)
            experiment_id = (
                found.experiment_id if found else client.create_experiment(self.experiment_name)
            )
            self.run_id = client.create_run(experiment_id, run_name=self.run_name).info.run_id
            self._client = client
        return self._client

    @property
    def log_dir(self) -> str:
        return os.path.join(self.tracking_uri.removeprefix("file:"), self.experiment_name)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        client = self.experiment
        if client is not None:
            for key, value in params.items():
                client.log_param(self.run_id, key, value)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        client = self.experiment
        if client is not None:
            for key, value in metrics.items():
                client.log_metric(self.run_id, key, value, step=step)

    def finish(self, status: str = "FINISHED") -> None:
        """Marks the run as ended."""
        if self._client is not None:
            self._client.set_terminated(self.run_id, status)
