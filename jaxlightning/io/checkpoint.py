"""Checkpoint files: orbax step folders holding the train state and a JSON record.

A checkpoint is one folder ``{dirpath}/{step}`` written by orbax: ``state``
(arrays, one unreplicated copy, so it restores on any device count) and
``meta`` (JSON: loop progress, callback states, hyperparameters), and
``checksums.json`` (a CRC32 of every array, computed on a thread of its own
while orbax writes, and written once both are done; checkpoints saved before
it kept them in ``meta``). Orbax writes into a temporary folder and renames it
when complete, so a folder whose name is a plain step number is always whole; a
save interrupted by a crash leaves only a temporary folder that is never chosen.

A folder in object storage (``s3://``, ``gs://``: `storage`) is written through
a local staging folder: orbax writes the step there as above, and the step is
uploaded, ``checksums.json`` last, on the same background thread that computes
the checksums; a step in the bucket without that file is not complete.
Restoring downloads the step into a temporary folder first.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import tempfile
import threading
import time
import warnings
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import flax.serialization
import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxlightning.cluster import distributed
from jaxlightning.io import storage

FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"\d+")
_PARAMS = "state/params/"
CHECKSUMS = "checksums.json"


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


def _key(path: Any) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in path)


def checksummed(state_dict: Any) -> dict[str, np.ndarray]:
    """The arrays `checksums` covers, as host arrays, by slash-joined key path:
    arrays split across processes (sharded strategies) are left out, as no
    process holds their bytes. Host arrays are taken as they are; device
    arrays are copied to the host (here: a later step may donate them)."""
    flat = jax.tree_util.tree_flatten_with_path(state_dict)[0]
    return {
        _key(path): np.asarray(leaf)
        for path, leaf in flat
        if not isinstance(leaf, jax.Array) or leaf.is_fully_addressable or leaf.is_fully_replicated
    }


def checksums(state_dict: Any) -> dict[str, int]:
    """CRC32 of every array's bytes (`checksummed`), by slash-joined key path.

    One pass over the host copy (about 2 GB/s on these CPUs; zlib lets other
    threads run meanwhile); catches bytes changed on disk that the file format
    itself would load without complaint.
    """
    return {
        key: zlib.crc32(np.ascontiguousarray(leaf).reshape(-1).view(np.uint8))
        for key, leaf in checksummed(state_dict).items()
    }


class _Checksums(threading.Thread):
    """Computes `checksums` of a save's host arrays off the training thread and
    writes them into the step's folder once orbax has renamed it into place,
    which makes the checkpoint complete (`complete_checkpoints`)."""

    def __init__(
        self, arrays: dict[str, np.ndarray], folder: str, upload_to: str | None = None
    ) -> None:
        super().__init__(name="jaxlightning-checksums", daemon=True)
        self._arrays: dict[str, np.ndarray] | None = arrays
        self._folder = folder
        self._upload_to = upload_to  # then the folder is staged: uploaded, then removed
        self.cancelled = threading.Event()  # the save failed: its folder never comes
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            result = checksums(self._arrays)
            self._arrays = None  # the host copy is not kept past its checksums
            while not _has_arrays(self._folder):
                if self.cancelled.wait(0.01):
                    return
            _write_json(os.path.join(self._folder, CHECKSUMS), result)
            if self._upload_to is not None:
                storage.upload(self._folder, self._upload_to, last=(CHECKSUMS,))
                shutil.rmtree(self._folder, ignore_errors=True)
        except BaseException as exc:  # raised by the writer's `wait`
            self.error = exc


def _restore_arg(leaf: Any) -> Any:
    """Restores as host numpy, or, for a target array laid out over several
    devices (a sharded strategy), straight into that layout: each process
    reads only its shards, whatever layout the checkpoint was saved from."""
    sharding = getattr(leaf, "sharding", None)
    if isinstance(leaf, jax.Array) and len(sharding.device_set) > 1:
        return ocp.ArrayRestoreArgs(sharding=sharding, global_shape=leaf.shape, dtype=leaf.dtype)
    return ocp.RestoreArgs(restore_type=np.ndarray)


def _check_writable(dirpath: str) -> None:
    """Fails now, clearly, for a folder no checkpoint can be written to: orbax's
    save threads would otherwise wait minutes for a folder that never appears."""
    if storage.is_remote(dirpath):  # a bucket that is missing or not ours
        probe = storage.join(dirpath, f".jl-write-probe-{os.getpid()}")
        try:
            with storage.open_file(probe, "w") as f:
                f.write("")
            storage.remove_tree(probe)
        except Exception as exc:
            raise CheckpointError(
                f"cannot write checkpoints to {dirpath}: {type(exc).__name__}: {exc}. Check "
                "that the bucket exists and the credentials may write to it, or choose "
                "another folder: ModelCheckpoint(dirpath=...) or Trainer(default_root_dir=...)"
            ) from exc
        return
    try:
        os.makedirs(dirpath, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".jl-write-probe-", dir=dirpath)
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        raise CheckpointError(
            f"cannot write checkpoints to {dirpath}: {exc}. Make it writable or choose "
            "another folder: ModelCheckpoint(dirpath=...) or Trainer(default_root_dir=...)"
        ) from exc


class CheckpointWriter:
    """Writes checkpoints into one folder, asynchronously by default.

    `save` returns once the arrays are copied off the devices; files are
    written on a background thread. Its failure (a full disk, say) is raised as
    a `CheckpointError` by the next `wait`; `saving` tells, without waiting,
    whether that time has come.
    """

    def __init__(self, dirpath: str, *, async_save: bool = True) -> None:
        # In object storage: staged here, uploaded by the checksum thread.
        self.remote = storage.resolve(dirpath) if storage.is_remote(dirpath) else None
        if self.remote is not None:
            _check_writable(self.remote)
            self.dirpath = _staging_folder(self.remote)
        else:
            self.dirpath = os.path.abspath(dirpath)
            _check_writable(self.dirpath)
        self._manager = ocp.CheckpointManager(
            self.dirpath,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=None, enable_async_checkpointing=async_save, create=True
            ),
        )
        self._pending: int | None = None
        self._checksums: _Checksums | None = None  # of the pending save
        self._reported = False  # a save's failure was raised already

    def path(self, step: int) -> str:
        """Where step ``step``'s checkpoint is (in the bucket, once uploaded)."""
        return storage.join(self.remote or self.dirpath, str(step))

    def save(self, step: int, tree: Any, meta: Mapping[str, Any]) -> str:
        """Starts saving ``tree`` (host arrays) and ``meta`` as step ``step``;
        its checksums are computed meanwhile on another thread and written by
        `wait`, once orbax has finished (process 0's: it writes the record)."""
        self.wait()
        state = flax.serialization.to_state_dict(tree)
        record = dict(meta, format_version=FORMAT_VERSION, saved_at=time.time())
        record["checksums"] = CHECKSUMS  # where they are (a dict: inside, as saved before)
        if jax.process_index() == 0:
            staged = os.path.join(self.dirpath, str(step))
            # several processes: each uploads its part once orbax is done (`wait`)
            alone = self.remote is not None and jax.process_count() == 1
            self._checksums = _Checksums(
                checksummed(state), staged, self.path(step) if alone else None
            )
        self._pending = step
        try:
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(record)
                ),
                force=True,
            )
        except Exception as exc:
            self._failed(exc)
        if not self._manager.is_saving_in_progress():
            self.wait()  # a synchronous save: report its failure now
        return self.path(step)

    @property
    def saving(self) -> bool:
        """Whether a save started by `save` is still being written (or its
        checksums computed)."""
        if self._pending is None:
            return False
        if self.remote is not None and jax.process_count() > 1:
            return True  # its parts are uploaded together, at the next save or close
        summing = self._checksums is not None and self._checksums.is_alive()
        return summing or self._manager.is_saving_in_progress()

    def wait(self) -> None:
        """Waits for the pending save and writes its checksums; raises
        `CheckpointError` if it failed."""
        if self._pending is None:
            return
        summing, self._checksums = self._checksums, None
        try:
            self._manager.wait_until_finished()
            self._manager.check_for_errors()
        except Exception as exc:
            if summing is not None:
                summing.cancelled.set()
                summing.join()
            self._failed(exc)
        if summing is not None:
            summing.join()  # the folder is in place: its checksums follow at once
            if summing.error is not None:
                self._failed(summing.error)
        if self.remote is not None and jax.process_count() > 1:
            self._upload_parts(self._pending)
        self._pending = None

    def _upload_parts(self, step: int) -> None:
        """A multi-process save into a bucket: every process uploads the files
        it wrote (its shards, ``.../process_<i>/...``; process 0 the rest),
        then, once all have (a barrier), process 0 uploads ``checksums.json``,
        which completes the step. A process that dies before leaves the step
        incomplete, never picked as "last"."""
        index = jax.process_index()
        local = os.path.join(self.dirpath, str(step))
        if not os.path.isdir(local):  # another host's disk: orbax's temporary name stays
            found = glob.glob(os.path.join(self.dirpath, f"{step}.orbax-checkpoint-tmp*"))
            local = found[0] if found else ""
        mine = re.compile(rf"(^|/)(ocdbt\.)?process_{index}(/|$)")
        error: Exception | None = None
        try:
            if local and index == 0:
                storage.upload(local, self.path(step), skip=(CHECKSUMS,))
            elif local:
                storage.upload(local, self.path(step), only=lambda rel: bool(mine.search(rel)))
        except Exception as exc:
            error = exc
        # every part is in the bucket, or every process learns that one is not
        if distributed.agree_max(int(error is not None)):
            self._pending = step
            self._failed(error or RuntimeError("another process's upload of its part failed"))
        if index == 0:
            try:
                storage.upload(local, self.path(step), only=lambda rel: rel == CHECKSUMS)
            except Exception as exc:
                self._failed(exc)
            shutil.rmtree(local, ignore_errors=True)

    def _failed(self, exc: BaseException) -> None:
        step, self._pending = self._pending, None
        summing, self._checksums = self._checksums, None
        if summing is not None:  # a save that failed at once
            summing.cancelled.set()
        self._reported = True
        # Free the disk space of the half-written folder; it is never chosen anyway.
        for tmp in glob.glob(os.path.join(self.dirpath, f"{step}.orbax-checkpoint-tmp*")):
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"saving the checkpoint of step {step} to {self.dirpath} failed: {exc}"
        ) from exc

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints in the folder (not one being written)."""
        folder = self.remote or self.dirpath
        return [int(os.path.basename(p)) for p in complete_checkpoints(folder)]

    def delete(self, step: int) -> None:
        if self.remote is not None:
            if jax.process_index() == 0:  # the one that uploads
                storage.remove_tree(self.path(step))
            return
        self._manager.reload()
        self._manager.delete(step)

    def close(self) -> None:
        """Waits for the pending save (raising its failure) and stops orbax's threads.

        Orbax raises a failed save's error again when closing; once it has been
        reported as a `CheckpointError`, it is not raised a second time.
        """
        try:
            self.wait()
        finally:
            try:
                self._manager.close()
            except Exception as exc:
                if not self._reported:
                    raise CheckpointError(f"closing {self.dirpath} failed: {exc}") from exc
            finally:
                if self.remote is not None and jax.process_index() == 0:
                    shutil.rmtree(self.dirpath, ignore_errors=True)


def _staging_folder(remote: str) -> str:
    """The local folder orbax writes a bucket's steps into before they are
    uploaded. In a multi-process run every process stages at the same path
    (its own disk on another host: each writes only its own part, and process
    0, which holds the whole host copy of the state, uploads the step; the
    others' folders hold no arrays), so orbax's cross-process protocol sees
    one folder."""
    if jax.process_count() == 1:
        return tempfile.mkdtemp(prefix="jaxlightning-stage-")
    digest = zlib.crc32(remote.encode())
    job = os.environ.get("JAX_COORDINATOR_ADDRESS", "") + str(jax.process_count())
    folder = os.path.join(
        tempfile.gettempdir(), f"jaxlightning-stage-{digest:08x}-{zlib.crc32(job.encode()):08x}"
    )
    if jax.process_index() == 0:
        shutil.rmtree(folder, ignore_errors=True)  # a staging folder left by a crash
        os.makedirs(folder)
    return folder


def _write_json(path: str, value: Any) -> None:
    """Writes ``value`` to ``path`` whole or not at all (a temporary file renamed)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def complete_checkpoints(dirpath: str) -> list[str]:
    """Paths of the complete checkpoints in ``dirpath``, oldest step first."""
    steps = [int(d) for d in storage.listdir(dirpath) if _STEP_DIR.fullmatch(d)]
    paths = [storage.join(dirpath, str(s)) for s in sorted(steps)]
    return [p for p in paths if _is_complete(p)]


def _is_complete(path: str) -> bool:
    """Whether orbax finished the folder and, for a record that keeps its
    checksums in their own file, that file was written too."""
    return _has_arrays(path) and (
        storage.exists(storage.join(path, CHECKSUMS)) or not _checksums_apart(path)
    )


def _has_arrays(path: str) -> bool:
    return all(storage.isdir(storage.join(path, item)) for item in ("state", "meta"))


def _checksums_apart(path: str) -> bool:
    """Whether the record says its checksums are in their own file (read as a
    plain file: listing checkpoints should not start orbax)."""
    try:
        with storage.open_file(storage.join(path, "meta", "metadata")) as f:
            return isinstance(json.load(f).get("checksums"), str)
    except (OSError, ValueError, AttributeError):
        return False  # an unreadable record is reported when it is read


def _checked(path: str | os.PathLike[str]) -> str:
    path = storage.resolve(path)
    if not storage.exists(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if not _has_arrays(path):  # one whose checksums are missing restores unchecked
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


@contextlib.contextmanager
def _local(path: str, skip: tuple[str, ...] = ()) -> Iterator[str]:
    """The checkpoint folder ``path`` on this machine: itself, or for one in
    object storage a temporary download (without the folders in ``skip``)."""
    if not storage.is_remote(path):
        yield path
        return
    with storage.downloaded(path, skip=skip) as local:
        yield local


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON record of the checkpoint at ``path``."""
    path = _checked(path)
    try:
        with _local(path, skip=("state",)) as local:
            args = ocp.args.Composite(meta=ocp.args.JsonRestore())
            meta = _checkpointer().restore(local, args).meta
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
    return {_key(path): tuple(np.shape(leaf)) for path, leaf in flat}


def _saved_tree(path: str) -> Any:
    """The metadata tree (shapes, dtypes) of a checkpoint's arrays."""
    try:
        metadata = _checkpointer().metadata(path).item_metadata["state"]
    except Exception as exc:
        raise _read_error(path, exc) from exc
    tree = getattr(metadata, "tree", None)
    if tree is None:
        raise CheckpointError(f"could not read checkpoint {path}: its 'state' has no metadata")
    return tree


def _first_mismatch(saved: dict, expected: dict) -> str | None:
    # The parameters first: a different model is named by its own arrays, not
    # by the optimizer state that follows their shapes.
    for key in sorted(set(saved) | set(expected), key=lambda k: (_PARAMS not in k, k)):
        if key not in saved:
            return f"'{key}' {expected[key]} is missing from the checkpoint"
        if key not in expected:
            return f"the checkpoint has '{key}' {saved[key]}, which this model does not"
        if saved[key] != expected[key]:
            return f"'{key}' has shape {saved[key]} in the checkpoint but {expected[key]} here"
    return None


_OPT_STATE = "state/opt_state/"
_START_AFRESH = (
    "start a new fit from the checkpoint's weights instead: `module = "
    "YourModule.load_from_checkpoint(path)`, then `trainer.fit(module, ...)` without "
    "ckpt_path (the optimizer state and the step count start afresh)"
)


def _with_ema(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The train state's shapes had it been saved with an `EMA` callback: the
    optimizer state becomes ``(its state, EmaState(ema=params))``."""
    out = {}
    for key, shape in shapes.items():
        if key.startswith(_OPT_STATE):
            out[_OPT_STATE + "0/" + key[len(_OPT_STATE) :]] = shape
        else:
            out[key] = shape
            if key.startswith(_PARAMS):
                out[_OPT_STATE + "1/ema/" + key[len(_PARAMS) :]] = shape
    return out


def _optimizer_change(path: str, saved: dict, expected: dict) -> str | None:
    """Why a checkpoint whose parameters fit does not restore, when only the
    optimizer state differs: an `EMA` callback added or removed since it was
    saved, or another optimizer. ``None`` when the parameters differ too."""
    differing = {k for k in set(saved) | set(expected) if saved.get(k) != expected.get(k)}
    if not all(k.startswith(_OPT_STATE) for k in differing):
        return None
    if _with_ema(saved) == expected:
        return (
            f"checkpoint {path} was saved without an EMA callback, and this Trainer has one: "
            "the average lives in the optimizer state, which the checkpoint lacks. Resume "
            "it without EMA (remove EMA from callbacks), or, to average from here on, "
            + _START_AFRESH
            + "; the average then starts at the restored parameters"
        )
    if _with_ema(expected) == saved:
        return (
            f"checkpoint {path} was saved with an EMA callback, which this Trainer lacks: "
            "add EMA(...) to callbacks, with the same decay, to resume it, or " + _START_AFRESH
        )
    if not any(k.startswith(_OPT_STATE) for k in saved):
        return (
            f"checkpoint {path} holds no optimizer state (its optimizer kept none, or only "
            "the weights were saved), which this optimizer needs to resume: resume from a "
            "checkpoint of the same optimizer, or " + _START_AFRESH
        )
    return (
        f"checkpoint {path} does not fit this optimizer: its parameters fit, but "
        f"{_first_mismatch(saved, expected)} (the optimizer state). configure_optimizers(), "
        "gradient_clip_val or a callback that changes the optimizer differ from the run "
        "that saved it. Resume with the same optimizer, or " + _START_AFRESH
    )


def find_last(dirs: list[str]) -> str | None:
    """The checkpoint to resume from among the folders ``dirs``.

    In each folder, the one of the highest step. Among folders (the runs of
    several version directories), the one whose highest step was saved last,
    by the time recorded in it: touching files cannot change the choice.
    """
    newest = [paths[-1] for d in dict.fromkeys(dirs) if (paths := complete_checkpoints(d))]
    if len(newest) <= 1:
        return newest[0] if newest else None
    return max(newest, key=_saved_at)


def _saved_at(path: str) -> float:
    try:
        return float(read_meta(path).get("saved_at", 0.0))
    except CheckpointError:
        return 0.0


def move_aside(dirpath: str, steps: list[int]) -> str:
    """Moves the checkpoints of ``steps`` into a new ``superseded-*`` folder inside
    ``dirpath`` (never chosen by ``"last"``); returns that folder."""
    dest = storage.join(dirpath, time.strftime("superseded-%Y%m%d-%H%M%S"))
    base, n = dest, 1
    while storage.exists(dest):
        dest, n = f"{base}-{n}", n + 1
    storage.makedirs(dest)
    for step in steps:
        storage.move(storage.join(dirpath, str(step)), storage.join(dest, str(step)))
    return dest


def save_at(path: str, step: int, tree: Any, meta: Mapping[str, Any]) -> str:
    """Writes one checkpoint folder at ``path`` and waits for it (what
    ``trainer.save_checkpoint`` writes; one at ``path`` already is replaced once
    the new one is complete). It is written beside ``path`` and moved there
    whole, so ``path`` never holds half a checkpoint."""
    if storage.is_remote(path) or jax.process_count() > 1:
        where = "to a bucket" if storage.is_remote(path) else "in a multi-process run"
        raise ValueError(
            f"save_checkpoint({path!r}) {where} is not supported yet: a ModelCheckpoint "
            "saves there (trainer.checkpoint_callback.save(trainer, module))"
        )
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".jl-save-", dir=parent)
    try:
        writer = CheckpointWriter(staging, async_save=False)
        try:
            writer.save(step, tree, meta)
        finally:
            writer.close()
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.replace(os.path.join(staging, str(step)), path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def weights_only(tree: Mapping[str, Any]) -> dict[str, Any]:
    """What a checkpoint of weights only holds (``ModelCheckpoint(save_weights_only=True)``):
    of a checkpoint tree, the train state's ``step``, ``params`` and ``model_state``;
    neither the optimizer state, the ``rng`` nor the metric accumulator."""
    state = flax.serialization.to_state_dict(tree["state"])
    return {"state": {key: state[key] for key in ("step", "params", "model_state") if key in state}}


def _refuse_weights_only(path: str) -> None:
    """A checkpoint of weights only cannot resume training: says so, and what to do."""
    if read_meta(path).get("weights_only"):
        raise CheckpointError(
            f"checkpoint {path} holds the model's weights only "
            "(ModelCheckpoint(save_weights_only=True)): no optimizer state to resume "
            "training from. Use it for inference (YourModule.load_from_checkpoint(path), or "
            "ckpt_path= in validate, test or predict), start a new fit from its weights "
            "(load_from_checkpoint, then fit without ckpt_path), or resume from a checkpoint "
            "saved with save_weights_only=False"
        )


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
    """Restores the arrays of the checkpoint at ``path``.

    Args:
        path: a checkpoint folder.
        target: a pytree of the expected structure (e.g. a fresh train state);
            the result has its structure, and its arrays laid out over several
            devices are restored with that layout (the rest as host numpy
            arrays). ``None`` returns nested dicts of numpy arrays.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointError: incomplete or corrupt, or, with ``target``, of another
            model: names the first differing parameter path and both shapes;
            with ``target``, a checkpoint of weights only (`weights_only`).
    """
    path = _checked(path)
    with _local(path) as local:
        return _restore_from(path, local, target)


def _restore_from(path: str, local: str, target: Any | None) -> Any:
    """`restore` from the folder ``local`` (``path`` itself, or its download)."""
    saved = _saved_tree(local)
    if target is not None:
        _refuse_weights_only(path)
        expected = _shapes(flax.serialization.to_state_dict(target))
        problem = _first_mismatch(_shapes(saved), expected)
        if problem:
            reason = _optimizer_change(path, _shapes(saved), expected)
            raise CheckpointError(reason or f"checkpoint {path} does not fit this model: {problem}")
    if target is None:
        restore_args = jax.tree.map(
            lambda _: ocp.RestoreArgs(restore_type=np.ndarray), saved, is_leaf=_has_shape
        )
    else:
        restore_args = jax.tree.map(_restore_arg, flax.serialization.to_state_dict(target))
    try:
        state = (
            _checkpointer()
            .restore(
                local,
                ocp.args.Composite(state=ocp.args.PyTreeRestore(restore_args=restore_args)),
            )
            .state
        )
    except Exception as exc:
        raise _read_error(path, exc) from exc
    _verify(local, state, path)
    return state if target is None else flax.serialization.from_state_dict(target, state)


_UNREADABLE_ARRAY = re.compile(r'Error reading "([^"/]+)/')


def _read_error(path: str, exc: Exception) -> CheckpointError:
    """What failed to restore: bytes that no longer decode (a flipped block in a
    compressed chunk, caught by the decompressor: its checksum, or a frame size
    it cannot hold; or in the index that finds the arrays) are corruption, named
    like a checksum mismatch; anything else is reported as it is."""
    message = str(exc)
    damaged = any(
        w in message for w in ("corrupt", "DATA_LOSS", "checksum verification failed", "decompress")
    )
    found = _UNREADABLE_ARRAY.search(message)
    if damaged and "b-tree node" in message:
        return CheckpointError(
            f"checkpoint {path} is corrupt: the index that finds its arrays (an OCDBT "
            f"b-tree node) cannot be decoded (its bytes changed on disk: {exc}). Resume "
            "from an older checkpoint"
        )
    if damaged and found:
        key = found.group(1).replace(".", "/")
        return CheckpointError(
            f"checkpoint {path} is corrupt: array '{key}' cannot be decoded (its bytes "
            f"changed on disk: {exc}). Resume from an older checkpoint"
        )
    return CheckpointError(f"could not read checkpoint {path}: {exc}")


def _verify(local: str, state: Any, path: str) -> None:
    """Compares the restored arrays with the checksums recorded at save (in the
    checkpoint ``path``, here at ``local``)."""
    recorded = read_meta(local).get("checksums")
    if recorded is None:  # written before checksums were recorded
        return
    if isinstance(recorded, str):  # in their own file (a dict: in the record, as before)
        try:
            with open(os.path.join(local, recorded)) as f:
                recorded = json.load(f)
        except FileNotFoundError:
            warnings.warn(
                f"checkpoint {path} has no {recorded}: the run stopped after its arrays "
                "were written but before their checksums were; restored without checking "
                "them",
                stacklevel=4,
            )
            return
    for key, crc in checksums(state).items():
        if key in recorded and recorded[key] != crc:  # not recorded: split across processes
            raise CheckpointError(
                f"checkpoint {path} is corrupt: array '{key}' does not match the checksum "
                "recorded when it was saved (its bytes changed on disk). Resume from an "
                "older checkpoint"
            )
