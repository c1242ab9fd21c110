"""Checkpoint files: orbax step folders holding the train state and a JSON record.

A checkpoint is one folder ``{dirpath}/{step}`` written by orbax: ``state``
(arrays, one unreplicated copy, so it restores on any device count) and
``meta`` (JSON: loop progress, callback states, hyperparameters). Orbax writes
into a temporary folder and renames it when complete, so a folder whose name is
a plain step number is always whole; a save interrupted by a crash leaves only
a temporary folder that is never chosen.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

import flax.serialization
import jax
import numpy as np
import orbax.checkpoint as ocp

FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"\d+")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: incomplete, corrupt or of another model."""


def json_safe(values: Mapping[str, Any]) -> dict[str, Any]:
    """Hyperparameters as JSON; values JSON cannot hold are kept as their repr."""
    out = {}
    for key, value in values.items():
        try:
            json.dumps(value)
            out[key] = value
        except (TypeError, ValueError):
            out[key] = {"__repr__": repr(value)}
    return out


class CheckpointWriter:
    """Writes checkpoints into one folder, asynchronously by default.

    `save` returns once the arrays are copied off the devices; files are
    written on a background thread. The previous save is finished first.
    """

    def __init__(self, dirpath: str, *, async_save: bool = True) -> None:
        self.dirpath = os.path.abspath(dirpath)
        self._manager = ocp.CheckpointManager(
            self.dirpath,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=None, enable_async_checkpointing=async_save, create=True
            ),
        )

    def path(self, step: int) -> str:
        return os.path.join(self.dirpath, str(step))

    def save(self, step: int, tree: Any, meta: Mapping[str, Any]) -> str:
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(flax.serialization.to_state_dict(tree)),
                meta=ocp.args.JsonSave(dict(meta, format_version=FORMAT_VERSION)),
            ),
            force=True,
        )
        return self.path(step)

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def steps(self) -> list[int]:
        """Steps of complete checkpoints."""
        return sorted(self._manager.all_steps())

    def delete(self, step: int) -> None:
        self._manager.delete(step)

    def close(self) -> None:
        self._manager.close()


def complete_checkpoints(dirpath: str) -> list[str]:
    """Paths of the complete checkpoints in ``dirpath``, oldest step first."""
    if not os.path.isdir(dirpath):
        return []
    steps = [int(d) for d in os.listdir(dirpath) if _STEP_DIR.fullmatch(d)]
    paths = [os.path.join(dirpath, str(s)) for s in sorted(steps)]
    return [p for p in paths if _is_complete(p)]


def _is_complete(path: str) -> bool:
    return all(os.path.isdir(os.path.join(path, item)) for item in ("state", "meta"))


def _checked(path: str | os.PathLike[str]) -> str:
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if not _is_complete(path):
        raise CheckpointError(
            f"{path} is not a complete jaxlightning checkpoint (it needs the 'state' and "
            "'meta' folders orbax writes); pass the folder of one saved step"
        )
    return path


def _checkpointer() -> ocp.Checkpointer:
    return ocp.Checkpointer(
        ocp.CompositeCheckpointHandler(
            state=ocp.PyTreeCheckpointHandler(), meta=ocp.JsonCheckpointHandler()
        )
    )


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON record of the checkpoint at ``path``."""
    path = _checked(path)
    try:
        meta = _checkpointer().restore(path, ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    except Exception as exc:
        raise CheckpointError(f"could not read checkpoint {path}: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path} holds no jaxlightning checkpoint record (meta)")
    return meta


def _has_shape(x: Any) -> bool:
    return hasattr(x, "shape")


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """Leaf shapes by slash-joined key path (arrays, shape structs or orbax metadata)."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_has_shape)[0]
    return {
        "/".join(str(getattr(k, "key", k)) for k in path): tuple(np.shape(leaf))
        for path, leaf in flat
    }


def _saved_tree(path: str) -> Any:
    """The metadata tree (shapes, dtypes) of a checkpoint's arrays."""
    try:
        metadata = _checkpointer().metadata(path).item_metadata["state"]
    except Exception as exc:
        raise CheckpointError(f"could not read checkpoint {path}: {exc}") from exc
    tree = getattr(metadata, "tree", None)
    if tree is None:
        raise CheckpointError(f"could not read checkpoint {path}: its 'state' has no metadata")
    return tree


def _first_mismatch(saved: dict, expected: dict) -> str | None:
    for key in sorted(set(saved) | set(expected)):
        if key not in saved:
            return f"'{key}' {expected[key]} is missing from the checkpoint"
        if key not in expected:
            return f"the checkpoint has '{key}' {saved[key]}, which this model does not"
        if saved[key] != expected[key]:
            return f"'{key}' has shape {saved[key]} in the checkpoint but {expected[key]} here"
    return None


def find_last(dirs: list[str]) -> str | None:
    """The most recently written complete checkpoint in any of ``dirs``."""
    paths = [p for d in dirs for p in complete_checkpoints(d)]
    return max(paths, key=os.path.getmtime) if paths else None


def restore_variables(
    path: str | os.PathLike[str], expected: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The flax variables (``params`` and other collections) of a checkpoint.

    With ``expected`` variables, a checkpoint of another model raises a
    `CheckpointError` naming the first differing parameter.
    """
    state = restore(path)["state"]
    variables = {"params": state["params"], **state.get("model_state", {})}
    if expected is not None:
        problem = _first_mismatch(_shapes(variables), _shapes(dict(expected)))
        if problem:
            raise CheckpointError(f"checkpoint {path} does not fit this model: {problem}")
    return variables


def restore(path: str | os.PathLike[str], target: Any | None = None) -> Any:
    """Restores the arrays of the checkpoint at ``path`` as host numpy arrays.

    Args:
        path: a checkpoint folder.
        target: a pytree of the expected structure (e.g. a fresh train state);
            the result has its structure. ``None`` returns nested dicts.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointError: incomplete or corrupt, or, with ``target``, of another
            model: names the first differing parameter path and both shapes.
    """
    path = _checked(path)
    saved = _saved_tree(path)
    if target is not None:
        expected = _shapes(flax.serialization.to_state_dict(target))
        problem = _first_mismatch(_shapes(saved), expected)
        if problem:
            raise CheckpointError(f"checkpoint {path} does not fit this model: {problem}")
    restore_args = jax.tree.map(
        lambda _: ocp.RestoreArgs(restore_type=np.ndarray), saved, is_leaf=_has_shape
    )
    try:
        state = (
            _checkpointer()
            .restore(
                path,
                ocp.args.Composite(state=ocp.args.PyTreeRestore(restore_args=restore_args)),
            )
            .state
        )
    except Exception as exc:
        raise CheckpointError(f"could not read checkpoint {path}: {exc}") from exc
    return state if target is None else flax.serialization.from_state_dict(target, state)
