"""`ModelCheckpoint`: when to save, which checkpoints to keep."""

from __future__ import annotations

import math
import os
import time
import warnings
from typing import TYPE_CHECKING, Any

from jaxlightning import distributed
from jaxlightning.callbacks.base import Callback
from jaxlightning.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    complete_checkpoints,
    move_aside,
)

if TYPE_CHECKING:
    from jaxlightning.callbacks.view import TrainerView
    from jaxlightning.module import JaxModule


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
        # {"step", "score"} of the complete checkpoints kept, oldest first, and of
        # the one being written: only complete ones are ever pruned.
        self._records: list[dict[str, Any]] = []
        self._pending: dict[str, Any] | None = None
        self._known: set[int] = set()  # steps written by this callback, not yet deleted
        self._writer: CheckpointWriter | None = None
        self._last_save_time = time.monotonic()
        self._warned_missing = False
        self._pending_state: dict[str, Any] | None = None

    # ------------------------------------------------------------ locations
    def resolve_dirpath(self, trainer: TrainerView) -> str:
        if self.dirpath is None:
            root = trainer.log_dir or trainer.default_root_dir
            self.dirpath = os.path.join(root, "checkpoints")
        return os.path.abspath(self.dirpath)

    def _path(self, step: int) -> str:
        return os.path.join(os.path.abspath(self.dirpath or ""), str(step))

    # ----------------------------------------------------------------- hooks
    def on_fit_start(self, trainer: TrainerView, module: JaxModule) -> None:
        dirpath = self.resolve_dirpath(trainer)
        if self._pending_state is not None:
            self._adopt(self._pending_state)
            self._pending_state = None
        self._protect_newer(dirpath, trainer.global_step)
        self._open(trainer)
        self._last_save_time = time.monotonic()

    def on_train_batch_end(self, trainer: TrainerView, module: JaxModule, batch_idx: int) -> None:
        if self._writer is not None and self._pending is not None and not self._writer.saving:
            self._commit()  # a failed save surfaces here, at the next step boundary
        n = self.every_n_train_steps
        due = n is not None and trainer.global_step % n == 0
        elapsed = time.monotonic() - self._last_save_time
        timed = self.train_time_interval is not None and elapsed >= self.train_time_interval
        if self.train_time_interval is not None:
            timed = distributed.agree(timed)  # every process saves together
        if due or timed:
            self.save(trainer, module)

    def on_train_epoch_end(self, trainer: TrainerView, module: JaxModule) -> None:
        # Also at the end of an epoch cut short (max_steps, should_stop), as
        # Lightning does: the checkpoint records the batch to resume from.
        n = self.every_n_epochs
        due = n is not None and (trainer.current_epoch + 1) % n == 0
        if due and self._latest_step() != trainer.global_step:
            self.save(trainer, module)

    def on_fit_end(self, trainer: TrainerView, module: JaxModule) -> None:
        if self.save_last and self._latest_step() != trainer.global_step:
            self.save(trainer, module)
        self.finish(prune=True)

    def teardown(self, trainer: TrainerView, module: JaxModule, stage: str) -> None:
        # After on_fit_end this finds nothing to do. When fit is failing, a failed
        # pending save is reported as a warning (the first error is the one to
        # see), and only complete checkpoints take part in pruning.
        if stage != "fit":
            return
        try:
            self.finish(prune=True)
        except CheckpointError as exc:
            warnings.warn(str(exc), stacklevel=2)

    # ------------------------------------------------------------- saving
    def _open(self, trainer: TrainerView) -> CheckpointWriter:
        if self._writer is None:
            self._writer = CheckpointWriter(
                self.resolve_dirpath(trainer), async_save=self.async_save
            )
        return self._writer

    def _protect_newer(self, dirpath: str, start: int) -> None:
        """Moves checkpoints of steps after ``start`` (this run's first step) out of
        the way: this run would write its own at those steps, and they belong to
        another run or to the future of an older checkpoint we resume from."""
        newer = [int(os.path.basename(p)) for p in complete_checkpoints(dirpath)]
        newer = [s for s in newer if s > start]
        if newer and distributed.is_rank_zero():
            dest = move_aside(dirpath, newer)
            warnings.warn(
                f"ModelCheckpoint: {dirpath} held checkpoints at steps {newer}, after this "
                f"run's start at step {start} (another run's, or later ones of the "
                f"checkpoint resumed from). Moved them to {dest} so that this run cannot "
                "overwrite them; ckpt_path='last' now means this run's newest",
                stacklevel=3,
            )
        if newer:
            distributed.barrier()  # the others wait until they are moved
        self._records = [r for r in self._records if r["step"] <= start]
        self._update_best()

    def _latest_step(self) -> int | None:
        if self._pending is not None:
            return self._pending["step"]
        return self._records[-1]["step"] if self._records else None

    def _score(self, trainer: TrainerView) -> float | None:
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

    def save(self, trainer: TrainerView, module: JaxModule, *, resume_point: bool = False) -> str:
        """Saves a checkpoint of the run now (once per step) and returns its folder.

        Returns ``""`` when the policy would not keep it (not among the top k
        and ``save_last=False``). With ``resume_point`` it is saved and kept
        whatever the policy, until a later checkpoint is complete: the run is
        stopping and will resume from it.
        """
        step = trainer.global_step
        if self._latest_step() == step:
            return self._path(step)
        writer = self._open(trainer)
        self._commit()  # the previous save first: its failure must not go unseen
        record: dict[str, Any] = {"step": step, "score": self._score(trainer)}
        if resume_point:
            record["resume_point"] = True
        elif not self._keeps(record):
            return ""
        self._pending = record  # the checkpoint's own records count it as done
        self._update_best()
        try:
            tree, meta = trainer.checkpoint_payload(module)
            if step in writer.steps():  # a folder left by another run: keep it aside
                move_aside(writer.dirpath, [step])
            path = writer.save(step, tree, meta)
        except CheckpointError as exc:  # a save that failed at once
            self._pending = None
            raise self._failure(exc) from exc
        except BaseException:
            self._pending = None
            self._update_best()
            raise
        self._known.add(step)
        self.last_model_path = path
        self._last_save_time = time.monotonic()
        return path

    def _commit(self) -> None:
        """Waits for the pending save; once it is complete, it joins the kept
        checkpoints and those the policy no longer keeps are deleted. A failed
        save raises `CheckpointError` and deletes nothing."""
        if self._pending is None or self._writer is None:
            return
        record, self._pending = self._pending, None
        try:
            self._writer.wait()
        except CheckpointError as exc:
            raise self._failure(exc) from exc
        self._records.append(record)
        self._prune()

    def _failure(self, exc: CheckpointError) -> CheckpointError:
        """A failed save's error, naming the checkpoint that is still there."""
        self._update_best()
        self.last_model_path = self._path(self._records[-1]["step"]) if self._records else ""
        kept = self.last_model_path or "none"
        return CheckpointError(f"{exc}. The last complete checkpoint is {kept}")

    def _rank_key(self, record: dict[str, Any]) -> tuple[bool, float, int]:
        score = record["score"]
        sign = -1.0 if self.mode == "max" else 1.0
        return (math.isnan(score), sign * score if not math.isnan(score) else 0.0, record["step"])

    def _ranked(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Best first: by score (NaN worst in either mode), else most recent first."""
        if self.monitor is None:
            return sorted(records, key=lambda r: -r["step"])
        scored = [r for r in records if r["score"] is not None]
        return sorted(scored, key=self._rank_key)

    def _top_k(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        ranked = self._ranked(records)
        return ranked if self.save_top_k == -1 else ranked[: self.save_top_k]

    def _keeps(self, record: dict[str, Any]) -> bool:
        """Whether the policy would keep a checkpoint ``record`` saved now."""
        return self.save_last or record in self._top_k([*self._records, record])

    def _update_best(self) -> None:
        records = self._records + ([self._pending] if self._pending else [])
        top = self._top_k(records)
        self.best_model_path = self._path(top[0]["step"]) if top else ""
        self.best_model_score = top[0]["score"] if top else None

    def _prune(self) -> None:
        """Deletes the complete checkpoints the policy no longer keeps (only ones
        this callback wrote: a shared folder may hold others)."""
        keep = {r["step"] for r in self._top_k(self._records)}
        latest = self._records[-1] if self._records else None
        if latest is not None and (self.save_last or latest.get("resume_point")):
            keep.add(latest["step"])
        dropped = [r["step"] for r in self._records if r["step"] not in keep]
        self._records = [r for r in self._records if r["step"] in keep]
        self._update_best()
        if self._writer is None:
            return
        on_disk = set(self._writer.steps())
        for step in dropped:
            if step in on_disk and step in self._known:
                self._writer.delete(step)
                self._known.discard(step)

    def finish(self, *, prune: bool) -> None:
        """Waits for pending writes; with ``prune``, keeps only what the policy keeps.

        Raises `CheckpointError` if the pending save failed (after closing).
        """
        if self._writer is None:
            return
        try:
            self._commit()
            if prune:
                self._prune()
        finally:
            writer, self._writer = self._writer, None
            writer.close()

    # -------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        records = self._records + ([self._pending] if self._pending else [])
        return {
            "dirpath": os.path.abspath(self.dirpath) if self.dirpath else None,
            "records": records,
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
