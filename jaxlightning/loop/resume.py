"""Resuming: which checkpoint ``ckpt_path`` names, what a checkpoint's record
holds, and whether a resumed run has anything left to do."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from jaxlightning.cluster import distributed
from jaxlightning.data.fit_data import FitData
from jaxlightning.io import storage
from jaxlightning.io.checkpoint import find_last, json_safe, read_meta, restore_variables
from jaxlightning.loggers import Logger
from jaxlightning.loggers.base import VersionedLogger
from jaxlightning.loop.hooks import Hooks
from jaxlightning.module import JaxModule
from jaxlightning.progress import Progress
from jaxlightning.schedule import Schedule

if TYPE_CHECKING:
    from jaxlightning.callbacks import ModelCheckpoint


def _checkpoint_dirs(
    callback: ModelCheckpoint | None, loggers: Sequence[Logger], default_root_dir: str
) -> list[str]:
    dirs = []
    if callback is not None and callback.dirpath is not None:
        dirs.append(storage.resolve(callback.dirpath))
    if loggers and isinstance(loggers[0], VersionedLogger):
        root = storage.join(loggers[0].save_dir, loggers[0].name)
        dirs += storage.glob(storage.join(root, "*", "checkpoints"))  # named versions too
    dirs.append(storage.join(default_root_dir, "checkpoints"))
    return dirs


def resolve_ckpt_path(
    ckpt_path: str | os.PathLike[str],
    callback: ModelCheckpoint | None,
    loggers: Sequence[Logger],
    default_root_dir: str,
) -> str:
    """The checkpoint folder ``ckpt_path`` names: ``"last"`` (the newest complete
    one in the run's checkpoint folders), ``"best"`` (the `ModelCheckpoint`'s best),
    or a folder."""
    if ckpt_path not in ("last", "best"):
        return storage.resolve(ckpt_path)
    if ckpt_path == "best" and callback is not None and callback.best_model_path:
        return callback.best_model_path
    dirs = _checkpoint_dirs(callback, loggers, default_root_dir)
    # Process 0's listing for all: it writes the checksums that make a step
    # complete, so another process may not see its newest step complete yet.
    last = distributed.gather_json(find_last(dirs))[0]
    if last is None:
        raise FileNotFoundError(
            f"ckpt_path={ckpt_path!r}: no complete checkpoint in "
            f"{sorted(set(dirs))}; pass a checkpoint folder instead"
        )
    if ckpt_path == "last":
        return last
    best = read_meta(last).get("callbacks", {}).get("ModelCheckpoint", {})
    if not best.get("best_model_path"):
        raise FileNotFoundError(f"ckpt_path='best': {last} records no best checkpoint")
    return best["best_model_path"]


def load_states(hooks: Hooks, datamodule: Any, module: JaxModule, meta: Mapping[str, Any]) -> None:
    """Hands a resumed checkpoint's record out in Lightning's order (before
    ``configure_optimizers``): the module's ``on_load_checkpoint``, the
    datamodule's state, the callbacks' ``on_load_checkpoint``, then their
    states (``load_state_dict``)."""
    module.on_load_checkpoint(dict(meta))
    if datamodule is not None and "datamodule" in meta:
        datamodule.load_state_dict(meta["datamodule"])
    for callback in hooks.callbacks:
        fn = getattr(callback, "on_load_checkpoint", None)
        if fn is not None:
            fn(hooks.view, module, dict(meta))
    load_callback_states(hooks, meta)


def load_callback_states(hooks: Hooks, meta: Mapping[str, Any], only: Any = None) -> None:
    """Each callback's saved state to its ``load_state_dict`` (``only``: to that
    callback alone: a scheduler's stepper, added by ``configure_optimizers``)."""
    states = meta.get("callbacks", {})
    for (key, cb), (old, _) in zip(hooks.keyed(), hooks.keyed(legacy=True), strict=True):
        state = states.get(key, states.get(old))  # older checkpoints: by class name
        if state is not None and hasattr(cb, "load_state_dict") and only in (None, cb):
            cb.load_state_dict(state)


def checkpoint_record(
    hooks: Hooks,
    module: JaxModule,
    progress: Progress,
    datamodule: Any,
    batching: Mapping[str, Any] | None = None,
    **run: Any,
) -> dict[str, Any]:
    """The JSON record a checkpoint saves: the resume position (and ``batching``,
    how the training batches were cut: see `rebatched`), callback and
    datamodule states, hyperparameters, and ``run`` (seed, log dir, ...),
    after the ``on_save_checkpoint`` hooks added theirs."""
    epoch, batch = progress.position
    states = {key: getattr(cb, "state_dict", dict)() for key, cb in hooks.keyed()}
    # Every process reads the same kind of loader: all have a state, or none.
    state = progress.data_state
    data_states = [] if state is None else distributed.gather_json(state)
    meta = {
        "progress": {
            "epoch": epoch,
            "batch": batch,
            "global_step": progress.global_step,
            "total_batches": progress.total_batches,
            "validated": progress.validated,
            **({"batching": dict(batching)} if batching else {}),
            # one per process: each reads its own shard
            **({"data_state": data_states} if any(data_states) else {}),
        },
        "callbacks": {key: state for key, state in states.items() if state},
        "hparams": json_safe(module.hparams),
        "module": f"{type(module).__module__}.{type(module).__qualname__}",
        **run,
    }
    if datamodule is not None and hasattr(datamodule, "state_dict"):
        meta["datamodule"] = datamodule.state_dict()
    hooks("on_save_checkpoint", module, meta)
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"the checkpoint record cannot be saved as JSON ({exc}); on_save_checkpoint "
            "hooks and state_dict methods must add only JSON values (numbers, strings, "
            "lists, dicts)"
        ) from exc
    return meta


def nothing_left(
    progress: Progress, schedule: Schedule, epoch_batches: int | None, skip: int
) -> str:
    """Why a fit from ``progress`` would train nothing (``""`` if it would)."""
    if schedule.max_epochs is not None and progress.current_epoch >= schedule.max_epochs:
        return f"max_epochs={schedule.max_epochs} reached"
    if not schedule.step_limit_reached(progress.global_step):
        return ""
    # At an epoch's last batch, that epoch's end (validation) is still due.
    epoch_end_due = skip > 0 and epoch_batches == skip
    return "" if epoch_end_due else f"max_steps={schedule.max_steps} reached"


def start_from(meta: Mapping[str, Any] | None, progress: Progress, data: FitData) -> None:
    """Moves ``progress`` to a checkpoint record's position and ``data`` to
    the batch of the epoch to start from, in this run's batches
    (`FitData.resume_at`); without a checkpoint, neither moves."""
    if meta is None:
        return
    at = meta["progress"]
    progress.resume_at(at["epoch"], at["batch"], at["global_step"], at.get("total_batches"))
    progress.validated = bool(at.get("validated", False))
    skip, state = data.resume_at(meta)
    progress.position = (at["epoch"], skip)  # in this run's batches, as its checkpoints save
    progress.data_state = state


def load_instead(module: JaxModule, path: str | None, progress: Progress, reason: str) -> None:
    """A fit with nothing left to do (``reason``): the module gets the
    checkpoint's variables (if resuming from one), and the user is told."""
    if path is not None:
        module.variables = restore_variables(path)
        where = f"the checkpoint {path} is"
    elif module.variables is not None:
        where = "this Trainer is"
    else:
        where = "this Trainer is (and the module was not trained by it)"
    if distributed.is_rank_zero():
        print(
            f"fit: nothing left to do: {reason}; {where} at epoch "
            f"{progress.current_epoch}, step {progress.global_step}. Raise max_epochs or "
            "max_steps to train further.",
            flush=True,
        )
