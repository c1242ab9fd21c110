"""`ModelCheckpoint`: when to save, which checkpoints to keep."""

from __future__ import annotations

import os
import time
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxlightning import distributed
from jaxlightning.callbacks.base import Callback
from jaxlightning.checkpoint import CheckpointWriter

if TYPE_CHECKING:
    from jaxlightning.module import JaxModule
    from jaxlightning.trainer import Trainer


class ModelCheckpoint(Callback):
    """Saves orbax checkpoints of the whole run and keeps the best ones.

    With no schedule given it saves at the end of every epoch. Saves are
    asynchronous: training goes on while files are written, and a checkpoint
    folder appears under its final name only once complete. Older checkpoints
    are deleted only after a newer one is complete, so a crash at any moment
    leaves a checkpoint to resume from.

    Args:
        dirpath: where step folders go (default: ``checkpoints/`` in the run's
            log directory, or in ``default_root_dir`` without a logger).
        monitor: a metric name from ``trainer.callback_metrics`` to rank by,
            e.g. ``"val/acc"``; ``None`` ranks by recency.
        mode: ``"min"`` or ``"max"``: which scores are better.
        save_top_k: keep the best k (``-1``: all, ``0``: none but the last).
        save_last: also keep the most recent checkpoint.
        every_n_train_steps: save every this many optimizer steps.
        every_n_epochs: save after every this many epochs (after validation).
        train_time_interval: save when this many seconds have passed since the
            last save (checked after each step).
        async_save: write files on a background thread.

    Attributes:
        best_model_path: the best kept checkpoint's folder ("" before any save).
        best_model_score: its ``monitor`` value (``None`` without ``monitor``).
        last_model_path: the most recent checkpoint's folder.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        *,
        monitor: str | None = None,
        mode: str = "min",
        save_top_k: int = 1,
        save_last: bool = True,
        every_n_train_steps: int | None = None,
        every_n_epochs: int | None = None,
        train_time_interval: float | None = None,
        async_save: bool = True,
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode={mode!r}: use 'min' or 'max'")
        if save_top_k < -1:
            raise ValueError(f"save_top_k={save_top_k}: use -1 (all), 0 or a positive count")
        for name, value in [
            ("every_n_train_steps", every_n_train_steps),
            ("every_n_epochs", every_n_epochs),
        ]:
            if value is not None and value < 1:
                raise ValueError(f"{name}={value}: use a positive count or None")
        if every_n_train_steps is None and every_n_epochs is None and train_time_interval is None:
            every_n_epochs = 1
        self.dirpath = os.fspath(dirpath) if dirpath is not None else None
        self.monitor, self.mode = monitor, mode
        self.save_top_k, self.save_last = save_top_k, save_last
        self.every_n_train_steps = every_n_train_steps
        self.every_n_epochs = every_n_epochs
        self.train_time_interval = train_time_interval
        self.async_save = async_save
        self.best_model_path = ""
        self.best_model_score: float | None = None
        self.last_model_path = ""
        self._records: list[dict[str, Any]] = []  # {"step", "score"} of kept saves
        self._known: set[int] = set()  # steps written by this callback, not yet deleted
        self._writer: CheckpointWriter | None = None
        self._last_save_time = time.monotonic()
        self._warned_missing = False
        self._pending_state: dict[str, Any] | None = None

    # ------------------------------------------------------------ locations
    def resolve_dirpath(self, trainer: Trainer) -> str:
        if self.dirpath is None:
            root = trainer.log_dir or trainer.default_root_dir
            self.dirpath = os.path.join(root, "checkpoints")
        return os.path.abspath(self.dirpath)

    def _path(self, step: int) -> str:
        return os.path.join(os.path.abspath(self.dirpath or ""), str(step))

    # ----------------------------------------------------------------- hooks
    def on_fit_start(self, trainer: Trainer, module: JaxModule) -> None:
        writer = self._open(trainer)
        self._last_save_time = time.monotonic()
        if self._pending_state is not None:
            self._adopt(self._pending_state)
            self._pending_state = None
        if writer.steps() and not self._records:
            warnings.warn(
                f"checkpoint folder {self.dirpath} already holds checkpoints of another run; "
                "those at steps this run saves will be replaced",
                stacklevel=2,
            )

    def on_train_batch_end(self, trainer: Trainer, module: JaxModule, batch_idx: int) -> None:
        n = self.every_n_train_steps
        due = n is not None and trainer.global_step % n == 0
        elapsed = time.monotonic() - self._last_save_time
        timed = self.train_time_interval is not None and elapsed >= self.train_time_interval
        if self.train_time_interval is not None:
            timed = bool(distributed.broadcast(np.bool_(timed)))  # every process saves together
        if due or timed:
            self.save(trainer, module)

    def on_train_epoch_end(self, trainer: Trainer, module: JaxModule) -> None:
        n = self.every_n_epochs
        if n is not None and trainer.epoch_completed and (trainer.current_epoch + 1) % n == 0:
            self.save(trainer, module)

    def on_fit_end(self, trainer: Trainer, module: JaxModule) -> None:
        if self.save_last and self._latest_step() != trainer.global_step:
            self.save(trainer, module)
        self.finish(prune=True)

    def teardown(self, trainer: Trainer, module: JaxModule) -> None:
        self.finish(prune=True)  # after waiting, every kept checkpoint is complete

    # ------------------------------------------------------------- saving
    def _open(self, trainer: Trainer) -> CheckpointWriter:
        if self._writer is None:
            self._writer = CheckpointWriter(
                self.resolve_dirpath(trainer), async_save=self.async_save
            )
        return self._writer

    def _latest_step(self) -> int | None:
        return self._records[-1]["step"] if self._records else None

    def _score(self, trainer: Trainer) -> float | None:
        if self.monitor is None:
            return None
        value = trainer.callback_metrics.get(self.monitor)
        if value is None and not self._warned_missing:
            self._warned_missing = True
            warnings.warn(
                f"ModelCheckpoint(monitor={self.monitor!r}): no such metric at step "
                f"{trainer.global_step} (have {sorted(trainer.callback_metrics)}); the "
                "checkpoint is kept as the last one but not ranked",
                stacklevel=3,
            )
        return value

    def save(self, trainer: Trainer, module: JaxModule) -> str:
        """Saves a checkpoint of the run now (once per step) and returns its folder."""
        step = trainer.global_step
        if self._latest_step() == step:
            return self._path(step)
        writer = self._open(trainer)
        previous = self._latest_step()
        self._records.append({"step": step, "score": self._score(trainer)})
        self._known.add(step)
        self._update_best()
        try:
            tree, meta = trainer.checkpoint_payload(module)
        except BaseException:
            self._records.pop()
            self._update_best()
            raise
        if step in writer.steps():  # left by another run, or a run resumed earlier
            writer.wait()
            writer.delete(step)
        path = writer.save(step, tree, meta)
        self.last_model_path = path
        self._last_save_time = time.monotonic()
        # The writer finished the previous save before starting this one; keep it
        # until this one is complete too.
        self._prune(keep_also={previous} if previous is not None else set())
        return path

    def _ranked(self) -> list[dict[str, Any]]:
        if self.monitor is None:
            return sorted(self._records, key=lambda r: -r["step"])
        scored = [r for r in self._records if r["score"] is not None]
        sign = -1.0 if self.mode == "max" else 1.0
        return sorted(scored, key=lambda r: (sign * r["score"], r["step"]))

    def _top_k(self) -> list[dict[str, Any]]:
        ranked = self._ranked()
        return ranked if self.save_top_k == -1 else ranked[: self.save_top_k]

    def _update_best(self) -> None:
        top = self._top_k()
        self.best_model_path = self._path(top[0]["step"]) if top else ""
        self.best_model_score = top[0]["score"] if top else None

    def _prune(self, keep_also: set[int]) -> None:
        keep = {r["step"] for r in self._top_k()} | keep_also
        if self.save_last and self._records:
            keep.add(self._records[-1]["step"])
        self._records = [r for r in self._records if r["step"] in keep]
        if self._writer is None:
            return
        for step in self._writer.steps():
            # Only folders this callback wrote: a shared folder may hold others.
            if step not in keep and step in self._known:
                self._writer.delete(step)
                self._known.discard(step)

    def finish(self, *, prune: bool) -> None:
        """Waits for pending writes; with ``prune``, keeps only what the policy keeps."""
        if self._writer is None:
            return
        self._writer.wait()
        if prune:
            self._prune(keep_also=set())
        self._writer.close()
        self._writer = None

    # -------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "dirpath": os.path.abspath(self.dirpath) if self.dirpath else None,
            "records": list(self._records),
            "best_model_path": self.best_model_path,
            "best_model_score": self.best_model_score,
            "last_model_path": self.last_model_path,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Applied in on_fit_start, once this run's folder is known: the records
        # carry over only when the resumed run writes to the same folder.
        self._pending_state = dict(state)

    def _adopt(self, state: dict[str, Any]) -> None:
        if state.get("dirpath") != os.path.abspath(self.dirpath or ""):
            return
        self._records = list(state.get("records", []))
        self._known = {r["step"] for r in self._records}
        self.best_model_path = state.get("best_model_path", "")
        self.best_model_score = state.get("best_model_score")
        self.last_model_path = state.get("last_model_path", "")
