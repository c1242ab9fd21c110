"""Checkpoints and stopping: what the Trainer saves, how a run resumes, and
whether a resumed run has anything left to do."""

from __future__ import annotations

import glob
import json
import os
import signal
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np

from jaxlightning import distributed
from jaxlightning.callbacks import Callback, ModelCheckpoint
from jaxlightning.checkpoint import find_last, json_safe, read_meta, restore_variables
from jaxlightning.loggers.base import VersionedLogger
from jaxlightning.module import JaxModule


class CheckpointingMixin:
    """Checkpoint contents, ``ckpt_path`` resolution and stop signals of the Trainer.

    Part of the Trainer (it uses its state, callbacks and logger), kept in its
    own file so that the training loop reads on its own.
    """

    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        """The first `ModelCheckpoint` among the callbacks."""
        return next((c for c in self.callbacks if isinstance(c, ModelCheckpoint)), None)

    def _callback_keys(self) -> list[tuple[str, Callback]]:
        seen: dict[str, int] = {}
        keys = []
        for cb in self.callbacks:
            name = type(cb).__name__
            seen[name] = seen.get(name, 0) + 1
            keys.append((name if seen[name] == 1 else f"{name}_{seen[name]}", cb))
        return keys

    def _load_states(self, module: JaxModule, meta: Mapping[str, Any]) -> None:
        """Hands a resumed checkpoint's record to the callbacks, the datamodule and
        the ``on_load_checkpoint`` hooks."""
        states = meta.get("callbacks", {})
        for key, cb in self._callback_keys():
            if key in states and hasattr(cb, "load_state_dict"):
                cb.load_state_dict(states[key])
        if self.datamodule is not None and "datamodule" in meta:
            self.datamodule.load_state_dict(meta["datamodule"])
        self._call("on_load_checkpoint", module, dict(meta))

    def checkpoint_payload(self, module: JaxModule) -> tuple[Any, dict[str, Any]]:
        """What a checkpoint of the run holds now: arrays and a JSON record.

        Waits for the steps in flight, and refuses (`NonFiniteLossError`) when
        a step since the last report had a non-finite loss, so a bad state is
        never saved.
        """
        if self._state is None:
            raise RuntimeError("nothing to checkpoint: fit has not started")
        self._drain()
        acc = self._fetch(self._acc)
        self._check_finite(acc)
        tree = {"state": self.strategy.checkpoint_arrays(self._state), "acc": acc}
        epoch, batch = self._progress
        states = {key: getattr(cb, "state_dict", dict)() for key, cb in self._callback_keys()}
        meta = {
            "progress": {"epoch": epoch, "batch": batch, "global_step": self.global_step},
            "callbacks": {key: state for key, state in states.items() if state},
            "hparams": json_safe(module.hparams),
            "module": f"{type(module).__module__}.{type(module).__qualname__}",
            "seed": self.seed,
            "log_dir": self.log_dir,
            "num_devices": self.num_devices,
        }
        if self.datamodule is not None and hasattr(self.datamodule, "state_dict"):
            meta["datamodule"] = self.datamodule.state_dict()
        self._call("on_save_checkpoint", module, meta)
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"the checkpoint record cannot be saved as JSON ({exc}); on_save_checkpoint "
                "hooks and state_dict methods must add only JSON values (numbers, strings, "
                "lists, dicts)"
            ) from exc
        return tree, meta

    def _agreed_signal(self, at_report: bool) -> int:
        """The stop signal every process acts on, so that all stop at one step.

        Alone, a signal counts at the next step. In a multi-process run the
        processes compare notes at each logging interval (a collective).
        """
        signum = self._stop_request.signum or 0
        if jax.process_count() == 1:
            return signum
        if not at_report:
            return 0
        from jax.experimental import multihost_utils

        return int(np.max(multihost_utils.process_allgather(np.int32(signum))))

    def _stop_on_signal(self, module: JaxModule) -> None:
        name = signal.Signals(self._stop_signal).name
        checkpoints = [c for c in self.callbacks if isinstance(c, ModelCheckpoint)]
        paths = [c.save(self, module, resume_point=True) for c in checkpoints]
        for c in checkpoints:
            c.finish(prune=True)
        if not distributed.is_rank_zero():
            pass
        elif paths:
            print(
                f"Received {name} at step {self.global_step}: saved {paths[0]}. Resume with "
                "trainer.fit(model, ..., ckpt_path='last') (or that path).",
                flush=True,
            )
        else:
            print(
                f"Received {name} at step {self.global_step}: no ModelCheckpoint, nothing saved.",
                flush=True,
            )
        raise SystemExit(128 + self._stop_signal)

    def _checkpoint_dirs(self) -> list[str]:
        dirs = []
        cb = self.checkpoint_callback
        if cb is not None and cb.dirpath is not None:
            dirs.append(os.path.abspath(cb.dirpath))
        if isinstance(self.logger, VersionedLogger):
            root = os.path.join(self.logger.save_dir, self.logger.name)
            dirs += glob.glob(os.path.join(root, "version_*", "checkpoints"))
        dirs.append(os.path.join(self.default_root_dir, "checkpoints"))
        return dirs

    def _resolve_ckpt_path(self, ckpt_path: str | os.PathLike[str]) -> str:
        if ckpt_path not in ("last", "best"):
            return os.path.abspath(os.fspath(ckpt_path))
        cb = self.checkpoint_callback
        if ckpt_path == "best" and cb is not None and cb.best_model_path:
            return cb.best_model_path
        last = find_last(self._checkpoint_dirs())
        if last is None:
            raise FileNotFoundError(
                f"ckpt_path={ckpt_path!r}: no complete checkpoint in "
                f"{sorted(set(self._checkpoint_dirs()))}; pass a checkpoint folder instead"
            )
        if ckpt_path == "last":
            return last
        best = read_meta(last).get("callbacks", {}).get("ModelCheckpoint", {})
        if not best.get("best_model_path"):
            raise FileNotFoundError(f"ckpt_path='best': {last} records no best checkpoint")
        return best["best_model_path"]

    def _adopt_log_dir(self, log_dir: str | None) -> None:
        """Resumes logging into the checkpoint's run directory (one run in TensorBoard)."""
        if log_dir:
            for logger in self.loggers:
                logger.resume_in(log_dir)

    def _finished(self, loader: Iterable[Any], skip: int) -> str:
        """Why a fit from the current progress would train nothing ("" if it would)."""
        if self.max_epochs is not None and self.current_epoch >= self.max_epochs:
            return f"max_epochs={self.max_epochs} reached"
        if not self._step_limit_reached():
            return ""
        # At an epoch's last batch, that epoch's end (validation) is still due.
        epoch_end_due = skip > 0 and self._epoch_batch_count(loader) == skip
        return "" if epoch_end_due else f"max_steps={self.max_steps} reached"

    def _nothing_left(self, module: JaxModule, resume: str | None, reason: str) -> None:
        if resume is not None:
            module.variables = restore_variables(resume)
            if self._fit_module is module:  # its variables no longer are the fit's state
                self._fit_module = None
            where = f"checkpoint {resume} is"
        elif module.variables is not None:
            where = "this Trainer is"
        else:
            where = "this Trainer is (and the module was not trained by it)"
        if distributed.is_rank_zero():
            print(
                f"fit: nothing left to do: {reason}; the {where} at epoch "
                f"{self.current_epoch}, step {self.global_step}. Raise max_epochs or "
                "max_steps to train further.",
                flush=True,
            )
