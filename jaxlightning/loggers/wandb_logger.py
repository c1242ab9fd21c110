"""Weights & Biases, through the real ``wandb`` client (the ``wandb`` extra)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from jaxlightning.cluster import distributed
from jaxlightning.loggers.base import Logger


class WandbLogger(Logger):
    """Logs to a Weights & Biases run (``pip install jaxlightning[wandb]``).

    The run starts when first needed and lasts until `finish` (or the end of
    the process), so `fit`, `validate` and `test` of one Trainer log into one
    run. Only process 0 logs. ``offline=True`` (or ``WANDB_MODE=offline``)
    writes the run to ``{save_dir}/wandb/`` for ``wandb sync`` later.
    `experiment` is the ``wandb`` run, for tables, images and more.

    Args:
        project: the W&B project.
        name: the run's display name.
        save_dir: where wandb writes its files (default: the working directory).
        offline: write locally only.
        **init_kwargs: passed on to ``wandb.init`` (``entity``, ``tags``, ...).
    """

    def __init__(
        self,
        project: str | None = None,
        name: str | None = None,
        save_dir: str | os.PathLike[str] | None = None,
        offline: bool = False,
        **init_kwargs: Any,
    ) -> None:
        self.project, self.name = project, name
        self.save_dir = os.fspath(save_dir or os.getcwd())
        self.offline = offline
        self._init_kwargs = init_kwargs
        self._run: Any = None

    @property
    def experiment(self) -> Any:
        """The ``wandb`` run (started on first use); ``None`` off process 0."""
        if not distributed.is_rank_zero():
            return None
        if self._run is None:
            import wandb

            os.makedirs(self.save_dir, exist_ok=True)
            mode = "offline" if self.offline else self._init_kwargs.pop("mode", None)
            self._run = wandb.init(
                project=self.project,
                name=self.name,
                dir=self.save_dir,
                mode=mode,
                **self._init_kwargs,
            )
        return self._run

    @property
    def log_dir(self) -> str:
        run = self.experiment
        return run.dir if run is not None else self.save_dir

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        if self.experiment is not None:
            self.experiment.config.update(dict(params), allow_val_change=True)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if self.experiment is not None:
            self.experiment.log({**metrics, "trainer/global_step": step})

    def finish(self) -> None:
        """Ends the run (wandb writes its last files)."""
        if self._run is not None:
            self._run.finish()
            self._run = None
