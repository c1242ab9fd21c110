"""TensorBoard event files through tensorboardX."""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
from tensorboardX import SummaryWriter
from tensorboardX.summary import hparams as hparams_summary

from jaxlightning import distributed
from jaxlightning.loggers.base import Logger

_VERSION_DIR = re.compile(r"version_(\d+)")
# tensorboardX names event files by the second they were opened in; a file
# opened again in the same second (fit, then validate) would overwrite the
# first. This suffix makes every writer's file name unique.
_WRITER_COUNT = itertools.count()


def _next_version(root: str) -> int:
    if not os.path.isdir(root):
        return 0
    found = [_VERSION_DIR.fullmatch(d) for d in os.listdir(root)]
    return max((int(m.group(1)) + 1 for m in found if m), default=0)


def _hparam_value(v: Any) -> bool | int | float | str:
    return v if isinstance(v, (bool, int, float, str)) else str(v)


class TensorBoardLogger(Logger):
    """Writes scalars and hparams to ``{save_dir}/{name}/version_{N}/``.

    The version is the next free one, chosen when the writer is first needed,
    so every run gets its own directory. In a multi-process run only process 0
    writes. Open it with
    ``tensorboard --logdir {save_dir}/{name}``.

    Args:
        save_dir: the root folder.
        name: the experiment folder under it.
        version: a fixed version number instead of the next free one.
    """

    def __init__(self, save_dir: str, name: str = "lightning_logs", version: int | None = None):
        self.save_dir = save_dir
        self.name = name
        self._version = version
        self._writer: SummaryWriter | None = None

    def resume_in(self, log_dir: str) -> None:
        """Logs into ``log_dir`` when it is one of this logger's version folders and
        no version is fixed yet, so a resumed run stays one run in TensorBoard."""
        if self._version is not None:
            return
        parent, leaf = os.path.split(os.path.abspath(log_dir))
        match = _VERSION_DIR.fullmatch(leaf)
        if match and parent == os.path.abspath(os.path.join(self.save_dir, self.name)):
            self._version = int(match.group(1))

    @property
    def version(self) -> int:
        if self._version is None:
            # Process 0 picks it; in a multi-process run every process must ask at
            # the same point (the Trainer does, at the start of each run).
            version = _next_version(os.path.join(self.save_dir, self.name))
            self._version = int(distributed.broadcast(np.int32(version)))
        return self._version

    @property
    def log_dir(self) -> str:
        return os.path.join(self.save_dir, self.name, f"version_{self.version}")

    @property
    def writer(self) -> SummaryWriter | None:
        """The event writer; ``None`` on processes other than 0, which write nothing."""
        if not distributed.is_rank_zero():
            return None
        if self._writer is None:
            os.makedirs(self.log_dir, exist_ok=True)
            suffix = f".{os.getpid()}.{next(_WRITER_COUNT):05d}"
            self._writer = SummaryWriter(logdir=self.log_dir, filename_suffix=suffix)
        return self._writer

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        # SummaryWriter.add_hparams would write into a new sub-run; write the three
        # hparams summaries into this run instead so TensorBoard shows one run.
        values = {k: _hparam_value(v) for k, v in params.items()}
        if self.writer is None:
            return
        file_writer = self.writer.file_writer
        for summary in hparams_summary(values, {}):
            file_writer.add_summary(summary)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        writer = self.writer
        if writer is None:
            return
        for name, value in metrics.items():
            writer.add_scalar(name, value, global_step=step)

    def finalize(self) -> None:
        # tensorboardX queues events for a writer thread that flush() does not
        # wait for; close() drains it. A later call opens a new event file (of
        # another name) in the same run directory, which TensorBoard reads as
        # one run.
        if self._writer is not None:
            self._writer.close()
            self._writer = None
