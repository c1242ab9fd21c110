"""`ModelCheckpoint`: when to save, which checkpoints to keep."""

from __future__ import annotations

import datetime
import math
import os
import time
import warnings
from typing import TYPE_CHECKING, Any, ClassVar

from jaxlightning.callbacks.base import Callback
from jaxlightning.cluster import distributed
from jaxlightning.io import storage
from jaxlightning.io.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    complete_checkpoints,
    move_aside,
    weights_only,
)
from jaxlightning.metrics.logged import monitored

if TYPE_CHECKING:
    from jaxlightning.callbacks.view import TrainerView
    from jaxlightning.module import JaxModule


class ModelCheckpoint(Callback):
    """Saves orbax checkpoints of the whole run and keeps the best ones.

    When it checks, as Lightning's does: with no trigger given, once per epoch
    (``every_n_epochs=1``): at the training epoch's end, or after each validation
    when validation runs several times an epoch (``val_check_interval`` other than
    ``1.0``) or not every epoch (``check_val_every_n_epoch`` other than 1); see
    ``save_on_train_epoch_end``. A check saves a checkpoint when it enters the top
    ``save_top_k`` by ``monitor`` (by recency without one); a check of
    ``every_n_train_steps`` or ``train_time_interval`` also saves it with
    ``save_last``, as the most recent one. A fit that saved nothing saves one at
    its end with ``save_last`` (Lightning saves its ``last.ckpt`` at every
    epoch's end whatever the triggers). Under ``Trainer(fast_dev_run=...)``
    nothing is saved.

    A checkpoint is the folder ``{dirpath}/{global_step}``; the most recent one is
    ``last_model_path`` (Lightning's ``last.ckpt``: here no separate copy). Saves
    are asynchronous: training goes on while files are written, and a checkpoint
    folder appears under its final name only once complete. Older checkpoints
    are deleted only after a newer one is complete, so a crash at any moment
    leaves a checkpoint to resume from.

    Args:
        dirpath: where step folders go (default: ``checkpoints/`` in the first
            logger's run directory, e.g. ``lightning_logs/version_0/checkpoints``,
            or in ``default_root_dir`` without a logger).
        monitor: a metric name from ``trainer.callback_metrics`` to rank by,
            e.g. ``"val_acc"``; ``"epoch"`` and ``"step"`` are always there.
            ``None`` ranks by recency. A NaN value counts as the worst (``inf``
            with ``mode="min"``, ``-inf`` with ``"max"``).
        mode: ``"min"`` or ``"max"``: which scores are better.
        save_top_k: keep the best k (``-1``: all, ``0``: none); without
            ``monitor`` only -1, 0 or 1.
        save_last: also keep the most recent checkpoint (saved at every step or
            time trigger, and at the end of a fit that saved nothing); off by
            default (``None``), as Lightning's.
        every_n_train_steps: check every this many optimizer steps (0: never).
        every_n_epochs: check after every this many epochs (0: never).
        train_time_interval: check when this much time (seconds or a
            ``timedelta``) has passed since the last time it did so.
            The three triggers are mutually exclusive.
        save_on_train_epoch_end: check at the training epoch's end (``True``) or
            after validation (``False``); ``None`` chooses as described above.
        save_weights_only: write the model's variables but not the optimizer
            state: for inference and ``load_from_checkpoint``; training cannot
            resume from such a checkpoint.
        verbose: print what each check of a monitored value decided.
        async_save: write files on a background thread.

    Attributes:
        best_model_path: the best kept checkpoint's folder ("" before any save).
        best_model_score: its ``monitor`` value (``None`` without ``monitor``).
        best_k_models: ``{folder: score}`` of the kept top k (empty without ``monitor``).
        kth_best_model_path: the worst of those once k are kept ("" before).
        current_score: the score of the last checkpoint that entered the top k.
        last_model_path: the most recent checkpoint's folder.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        *,
        monitor: str | None = None,
        mode: str = "min",
        save_top_k: int = 1,
        save_last: bool | None = None,
        every_n_train_steps: int | None = None,
        every_n_epochs: int | None = None,
        train_time_interval: float | datetime.timedelta | None = None,
        save_on_train_epoch_end: bool | None = None,
        save_weights_only: bool = False,
        verbose: bool = False,
        async_save: bool = True,
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"`mode` can be min, max but got {mode}")
        steps, epochs, seconds = _triggers(every_n_train_steps, every_n_epochs, train_time_interval)
        _check_policy(save_top_k, monitor, steps, epochs, seconds)
        self.dirpath = os.fspath(dirpath) if dirpath is not None else None
        self.monitor, self.mode = monitor, mode
        self.save_top_k, self.save_last = save_top_k, bool(save_last)
        self.every_n_train_steps, self.every_n_epochs = steps, epochs
        self.train_time_interval = seconds
        self.save_on_train_epoch_end = save_on_train_epoch_end
        self.save_weights_only, self.verbose = save_weights_only, verbose
        self.async_save = async_save
        self.best_model_path = ""
        self.best_model_score: float | None = None
        self.current_score: float | None = None
        self.last_model_path = ""
        # {"step", "epoch", "score", "ranked"} of the complete checkpoints kept,
        # oldest first, and of the one being written: only complete ones are ever
        # pruned. "ranked": it took part in the top k (not only saved as the last).
        self._records: list[dict[str, Any]] = []
        self._pending: dict[str, Any] | None = None
        self._known: set[int] = set()  # steps written by this callback, not yet deleted
        self._folder: _Folder | None = None  # shared with the fit's other checkpoints
        self._writer: CheckpointWriter | None = None  # the folder's
        self._last_global_step_saved = 0  # no check saves before the first step
        self._saved_any = False  # whether a checkpoint was written (save_last at the end)
        self._last_time_checked: float | None = None
        self._validated = False  # a validation ran in this fit (the sanity check's too)
        self._val_ran = False  # a validation other than the sanity check's ran
        self._deferred: dict[str, float] | None = None  # epoch-end validation's values
        self._warned_missing = False
        self._pending_state: dict[str, Any] | None = None
        self._resumed_from: str | None = None  # never deleted (Lightning's rule, local)

    # ------------------------------------------------------------ locations
    def resolve_dirpath(self, trainer: TrainerView) -> str:
        """The folder checkpoints go to: ``dirpath``, else ``checkpoints/`` in the
        first logger's run directory (``.../version_0/``, or ``.../awesome/`` for
        a logger of ``version="awesome"``), else in ``default_root_dir``."""
        if self.dirpath is None:
            root = trainer.log_dir or trainer.default_root_dir
            self.dirpath = storage.join(root, "checkpoints")
        return storage.resolve(self.dirpath)

    def _path(self, step: int) -> str:
        return storage.join(storage.resolve(self.dirpath or ""), str(step))

    # ----------------------------------------------------------------- hooks
    def on_fit_start(self, trainer: TrainerView, module: JaxModule) -> None:
        if trainer.fast_dev_run:  # a smoke test: checks skip, nothing is opened or moved
            return
        dirpath = self.resolve_dirpath(trainer)
        resumed = trainer.ckpt_path  # kept on local disks only, as Lightning's rule
        local = resumed is not None and not storage.is_remote(resumed)
        self._resumed_from = storage.resolve(resumed) if local else None
        if self._pending_state is not None:
            self._adopt(self._pending_state)
            self._pending_state = None
        self._protect_newer(dirpath, trainer.global_step)
        self._open(trainer)
        self._validated, self._val_ran, self._deferred = False, False, None

    def on_train_start(self, trainer: TrainerView, module: JaxModule) -> None:
        self._last_time_checked = time.monotonic()

    def wants_state_at(self, step: int) -> bool:
        """Whether it saves after update ``step`` (``every_n_train_steps``): a
        dispatch of several steps ends there, so the state saved is that step's."""
        n = self.every_n_train_steps
        return n >= 1 and step % n == 0

    def needs_each_step(self) -> bool:
        """Only a time interval reads each step's time (steps it saves after
        end a dispatch of several steps: `wants_state_at`)."""
        return self.train_time_interval is not None

    def on_stop_signal(self, trainer: TrainerView, module: JaxModule) -> str:
        """SIGTERM/SIGINT ends the fit: saves a resume point at this step and
        waits for it to be written; its path."""
        path = self.save(trainer, module, resume_point=True)
        self.finish(prune=True)
        return path

    def on_train_batch_end(self, trainer: TrainerView, module: JaxModule, batch_idx: int) -> None:
        if self._writer is not None and self._pending is not None and not self._writer.saving:
            self._commit()  # a failed save surfaces here, at the next step boundary
        due = self.wants_state_at(trainer.global_step)
        # With several steps per dispatch the state is the batch's own only at a
        # dispatch's end (where every_n_train_steps ends one): time waits for it.
        timed = not trainer.steps_ahead and self._time_due()
        if (timed or due) and not self._skips(trainer):
            self._check(trainer, module, self._candidates(trainer), as_last=self.save_last)

    def on_validation_end(self, trainer: TrainerView, module: JaxModule) -> None:
        if trainer.stage != "fit":
            return
        self._validated = True
        self._val_ran = self._val_ran or not trainer.sanity_checking
        if trainer.sanity_checking or self._saves_on_train_epoch_end(trainer):
            return
        candidates = self._candidates(trainer)
        if trainer.epoch_completed:
            # The validation at an epoch's end: its check is made at the epoch's
            # end, with these values, so that the checkpoint resumes at the next
            # epoch instead of running this validation again.
            self._deferred = candidates
        else:
            self._epoch_check(trainer, module, candidates)

    def on_train_epoch_end(self, trainer: TrainerView, module: JaxModule) -> None:
        # Also at the end of an epoch cut short (max_steps, should_stop), as
        # Lightning does: the checkpoint records the batch to resume from.
        candidates, self._deferred = self._deferred, None
        if candidates is None:
            if not self._saves_on_train_epoch_end(trainer):
                return
            candidates = self._candidates(trainer)
        self._epoch_check(trainer, module, candidates)

    def on_train_end(self, trainer: TrainerView, module: JaxModule) -> None:
        if self.save_last and not self._saved_any and not trainer.fast_dev_run:
            self._check(trainer, module, self._candidates(trainer), as_last=True, rank=False)

    def on_fit_end(self, trainer: TrainerView, module: JaxModule) -> None:
        self.finish(prune=True)

    def teardown(self, trainer: TrainerView, module: JaxModule, stage: str) -> None:
        # After on_fit_end this finds nothing to do. When fit is failing, a failed
        # pending save, or a store that no longer answers the pruning, is reported
        # as a warning (the first error is the one to see), and only complete
        # checkpoints take part in pruning.
        if stage != "fit":
            return
        try:
            self.finish(prune=True)
        except CheckpointError as exc:
            warnings.warn(str(exc), stacklevel=2)
        except Exception as exc:
            warnings.warn(f"pruning checkpoints failed: {type(exc).__name__}: {exc}", stacklevel=2)

    # ------------------------------------------------------------ when to check
    def _saves_on_train_epoch_end(self, trainer: TrainerView) -> bool:
        """Whether epoch checks run at the training epoch's end (else after each
        validation), Lightning's rule. A fit is taken to have no validation until
        one runs (the sanity check counts)."""
        if self.save_on_train_epoch_end is not None:
            return self.save_on_train_epoch_end
        if trainer.check_val_every_n_epoch != 1:
            return False
        if not self._validated:
            return True
        return trainer.val_check_interval == 1.0

    def _skips(self, trainer: TrainerView) -> bool:
        """Lightning's conditions for not checking at all: not fitting, the sanity
        check, a fast dev run, or a step already saved."""
        return (
            trainer.stage != "fit"
            or trainer.sanity_checking
            or bool(trainer.fast_dev_run)
            or trainer.global_step == self._last_global_step_saved
        )

    def _time_due(self) -> bool:
        """Whether ``train_time_interval`` has passed since it was last due (every
        process decides as process 0 does); restarts the interval when it has."""
        if self.train_time_interval is None or self._last_time_checked is None:
            return False
        now = time.monotonic()
        due = distributed.agree(now - self._last_time_checked >= self.train_time_interval)
        if due:
            self._last_time_checked = now
        return due

    def _epoch_check(
        self, trainer: TrainerView, module: JaxModule, candidates: dict[str, float]
    ) -> None:
        """The check of ``every_n_epochs``: only the top k is saved."""
        n = self.every_n_epochs
        if n >= 1 and (trainer.current_epoch + 1) % n == 0 and not self._skips(trainer):
            self._check(trainer, module, candidates, as_last=False)

    # ------------------------------------------------------------- checking
    def _candidates(self, trainer: TrainerView) -> dict[str, float]:
        """The values ``monitor`` may name: ``callback_metrics`` plus ``epoch`` and
        ``step`` (the trainer's, unless logged)."""
        values = dict(trainer.callback_metrics)
        values["epoch"] = int(values.get("epoch", trainer.current_epoch))
        values["step"] = int(values.get("step", trainer.global_step))
        return values

    def _score(self, candidates: dict[str, float], step: int) -> float | None:
        """The monitored value (NaN as the worst: ±inf); ``None`` without one."""
        if self.monitor is None:
            return None
        value = candidates.get(self.monitor)
        if value is None:
            message = (
                f"`ModelCheckpoint(monitor={self.monitor!r})` could not find the monitored "
                f"key in the returned metrics: {sorted(candidates)} (step {step}). HINT: Did "
                f"you call `self.log({self.monitor!r}, value)` in the module?"
            )
            if self._val_ran:  # Lightning's rule: an error once a validation has run
                raise ValueError(message)
            if not self._warned_missing:
                self._warned_missing = True
                warnings.warn(
                    f"{message} The check ranks nothing (a checkpoint due as the last one "
                    "is still saved)",
                    stacklevel=4,
                )
            return None
        score = monitored(value, f"ModelCheckpoint(monitor={self.monitor!r})")
        if math.isnan(score):
            score = math.inf if self.mode == "min" else -math.inf
        return score

    def _enters_top_k(self, record: dict[str, Any]) -> bool:
        if self.save_top_k == 0 or (self.monitor is not None and record["score"] is None):
            return False
        return record in self._top_k([*self._all_records(), record])

    def _check(
        self,
        trainer: TrainerView,
        module: JaxModule,
        candidates: dict[str, float],
        *,
        as_last: bool,
        rank: bool = True,
    ) -> str:
        """Saves a checkpoint of this step if it enters the top k (with ``rank``)
        or, with ``as_last``, as the most recent one. Returns its folder, or ""
        when nothing is saved."""
        step = trainer.global_step
        if self._latest_step() == step:
            return self._path(step)
        self._open(trainer)
        self._commit()  # the previous save first: its failure must not go unseen
        record = {
            "step": step,
            "epoch": int(candidates["epoch"]),
            "score": self._score(candidates, step),
        }
        record["ranked"] = rank and self._enters_top_k(record)
        if not (record["ranked"] or as_last):
            self._say_not_kept(record)
            return ""
        if record["ranked"] and self.monitor is not None:
            self.current_score = record["score"]
        path = self._write(trainer, module, record)
        if record["ranked"]:
            self._say_kept(record, path)
        return path

    def _say_kept(self, record: dict[str, Any], path: str) -> None:
        """With ``verbose``: the monitored value a checkpoint entered the top k with."""
        if not (self.verbose and self.monitor is not None and distributed.is_rank_zero()):
            return
        k = len(self._top_k(self._all_records())) if self.save_top_k == -1 else self.save_top_k
        print(
            f"Epoch {record['epoch']:d}, global step {record['step']:d}: {self.monitor!r} "
            f"reached {record['score']:0.5f} (best {self.best_model_score:0.5f}), saving model "
            f"to {path!r} as top {k}",
            flush=True,
        )

    def _say_not_kept(self, record: dict[str, Any]) -> None:
        """With ``verbose``: a monitored value that did not enter the top k."""
        if not (self.verbose and self.monitor is not None and self.save_top_k != 0):
            return
        if distributed.is_rank_zero():
            print(
                f"Epoch {record['epoch']:d}, global step {record['step']:d}: "
                f"{self.monitor!r} was not in top {self.save_top_k}",
                flush=True,
            )

    # ------------------------------------------------------------- saving
    def _open(self, trainer: TrainerView) -> CheckpointWriter:
        if self._writer is None:
            self._folder = _Folder.join(self.resolve_dirpath(trainer), self)
            self._writer = self._folder.writer
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

    def save(self, trainer: TrainerView, module: JaxModule, *, resume_point: bool = False) -> str:
        """Saves a checkpoint of the run now (once per step) and returns its folder.

        Kept as a step trigger's check keeps it: in the top k, or as the most
        recent with ``save_last``; returns ``""`` when the policy would not keep
        it. With ``resume_point`` it is saved and kept whatever the policy, until
        a later checkpoint is complete: the run is stopping and will resume from it.
        """
        candidates = self._candidates(trainer)
        if not resume_point:
            return self._check(trainer, module, candidates, as_last=self.save_last)
        step = trainer.global_step
        if self._latest_step() == step:
            return self._path(step)
        self._open(trainer)
        self._commit()
        record = {
            "step": step,
            "epoch": int(candidates["epoch"]),
            "score": self._score(candidates, step),
            "resume_point": True,
        }
        return self._write(trainer, module, record)

    def _write(self, trainer: TrainerView, module: JaxModule, record: dict[str, Any]) -> str:
        """Starts writing the checkpoint of ``record`` (this step's); returns its folder."""
        writer = self._open(trainer)
        step = record["step"]
        self._pending = record  # the checkpoint's own records count it as done
        self._update_best()
        try:
            tree, meta = trainer.checkpoint_payload(module)
            if self.save_weights_only:
                tree, meta = weights_only(tree), {**meta, "weights_only": True}
            assert self._folder is not None  # opened with the writer
            if self._folder.claim(step, self):  # another callback of this fit saved this step
                path = writer.path(step)
            else:
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
        self._last_global_step_saved = step
        self._saved_any = True
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

    # ------------------------------------------------------------- ranking
    def _all_records(self) -> list[dict[str, Any]]:
        """The kept checkpoints' records and the one being written."""
        return self._records + ([self._pending] if self._pending else [])

    def _rank_key(self, record: dict[str, Any]) -> tuple[bool, float, int]:
        score = record["score"]
        sign = -1.0 if self.mode == "max" else 1.0
        return (math.isnan(score), sign * score if not math.isnan(score) else 0.0, record["step"])

    def _ranked(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Best first: by score (ties: the older first), else most recent first.
        Checkpoints saved only as the last one take no part."""
        records = [r for r in records if r.get("ranked", True)]
        if self.monitor is None:
            return sorted(records, key=lambda r: -r["step"])
        scored = [r for r in records if r["score"] is not None]
        return sorted(scored, key=self._rank_key)

    def _top_k(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        ranked = self._ranked(records)
        return ranked if self.save_top_k == -1 else ranked[: self.save_top_k]

    @property
    def best_k_models(self) -> dict[str, float]:
        """``{folder: score}`` of the kept top k, best first (empty without ``monitor``)."""
        if self.monitor is None:
            return {}
        return {self._path(r["step"]): r["score"] for r in self._top_k(self._all_records())}

    @property
    def kth_best_model_path(self) -> str:
        """The worst of the top k once k are kept (with ``save_top_k=-1``: once
        any is), else ``""``; always ``""`` without ``monitor``."""
        top = list(self.best_k_models)
        full = self.save_top_k == -1 or len(top) == self.save_top_k
        return top[-1] if top and full else ""

    def _update_best(self) -> None:
        top = self._top_k(self._all_records())
        self.best_model_path = self._path(top[0]["step"]) if top else ""
        self.best_model_score = top[0]["score"] if top else None

    def _prune(self) -> None:
        """Deletes the complete checkpoints the policy no longer keeps (only ones
        this callback wrote: a shared folder may hold others; never the one the
        fit resumed from on a local disk, as Lightning's ``_should_remove_checkpoint``)."""
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
            if step in self._known and self._folder is not None:
                self._known.discard(step)
                resumed_from = self._path(step) == self._resumed_from
                if self._folder.release(step, self) and step in on_disk and not resumed_from:
                    self._writer.delete(step)

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
            folder, self._folder, self._writer = self._folder, None, None
            if folder is not None:
                folder.leave(self)

    # -------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "monitor": self.monitor,
            "dirpath": storage.resolve(self.dirpath) if self.dirpath else None,
            "records": self._all_records(),
            "best_model_path": self.best_model_path,
            "best_model_score": self.best_model_score,
            "current_score": self.current_score,
            "last_model_path": self.last_model_path,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Applied in on_fit_start, once this run's folder is known: the records
        # carry over only when the resumed run writes to the same folder.
        self._pending_state = dict(state)

    def _adopt(self, state: dict[str, Any]) -> None:
        if state.get("dirpath") != storage.resolve(self.dirpath or ""):
            return
        self._records = list(state.get("records", []))
        self._known = {r["step"] for r in self._records}
        self.best_model_path = state.get("best_model_path", "")
        self.best_model_score = state.get("best_model_score")
        self.current_score = state.get("current_score")
        self.last_model_path = state.get("last_model_path", "")


class _Folder:
    """A checkpoint folder of a fit, shared by every `ModelCheckpoint` saving
    into it (two with the default ``dirpath``, say): one writer (two would
    collide in orbax's temporary folder of a step), and who keeps each step
    saved in this fit. A step one callback saved is the others' checkpoint of
    that step too (the same state); it is deleted once none of them keeps it."""

    _open: ClassVar[dict[str, _Folder]] = {}

    def __init__(self, key: str, writer: CheckpointWriter, weights_only: bool) -> None:
        self.key, self.writer, self.weights_only = key, writer, weights_only
        self.users: set[int] = set()
        self.keepers: dict[int, set[int]] = {}  # step -> the callbacks keeping it

    @classmethod
    def join(cls, dirpath: str, user: ModelCheckpoint) -> _Folder:
        folder = cls._open.get(dirpath)
        if folder is None:
            writer = CheckpointWriter(dirpath, async_save=user.async_save)
            folder = cls._open[dirpath] = cls(dirpath, writer, user.save_weights_only)
        elif folder.weights_only != user.save_weights_only:
            raise ValueError(
                f"two ModelCheckpoints save into {dirpath}, one with save_weights_only=True "
                "and one without: a step's checkpoint there is one folder, so give one of "
                "them a dirpath of its own"
            )
        folder.users.add(id(user))
        return folder

    def claim(self, step: int, user: Any) -> bool:
        """``user`` keeps ``step``'s checkpoint; whether another already saved it."""
        keepers = self.keepers.setdefault(step, set())
        saved = bool(keepers - {id(user)})
        keepers.add(id(user))
        return saved

    def release(self, step: int, user: Any) -> bool:
        """``user`` no longer keeps ``step``; whether nobody does (delete it)."""
        keepers = self.keepers.get(step, set())
        keepers.discard(id(user))
        return not keepers

    def leave(self, user: Any) -> None:
        """``user``'s fit is over; the last to leave closes the writer."""
        self.users.discard(id(user))
        if not self.users:
            del self._open[self.key]
            self.writer.close()


def _triggers(
    every_n_train_steps: int | None,
    every_n_epochs: int | None,
    train_time_interval: float | datetime.timedelta | None,
) -> tuple[int, int, float | None]:
    """The triggers as ``(steps, epochs, seconds)``, 0 (or ``None``) meaning off:
    with none given, every epoch; else the ones not given are off (Lightning's)."""
    seconds = train_time_interval
    if isinstance(seconds, datetime.timedelta):
        seconds = seconds.total_seconds()
    if every_n_train_steps is None and every_n_epochs is None and seconds is None:
        return 0, 1, None
    return every_n_train_steps or 0, every_n_epochs or 0, seconds


def _check_policy(
    save_top_k: int, monitor: str | None, steps: int, epochs: int, seconds: float | None
) -> None:
    """Refuses the configurations Lightning refuses, with its messages."""
    if save_top_k < -1:
        raise ValueError(f"Invalid value for save_top_k={save_top_k}. Must be >= -1")
    if steps < 0:
        raise ValueError(f"Invalid value for every_n_train_steps={steps}. Must be >= 0")
    if epochs < 0:
        raise ValueError(f"Invalid value for every_n_epochs={epochs}. Must be >= 0")
    if (steps >= 1) + (epochs >= 1) + (seconds is not None) > 1:
        raise ValueError(
            f"Combination of parameters every_n_train_steps={steps}, every_n_epochs={epochs} "
            f"and train_time_interval={seconds} should be mutually exclusive: use one "
            "ModelCheckpoint per trigger"
        )
    if monitor is None and save_top_k not in (-1, 0, 1):
        raise ValueError(
            f"ModelCheckpoint(save_top_k={save_top_k}, monitor=None) is not a valid "
            "configuration. No quantity for top_k to track: set monitor, or save_top_k to "
            "-1 (all), 0 or 1 (the most recent)"
        )
