"""Checkpoints never lose the last good state: full disks, read-only folders,
pruning, NaN scores, older resumes, "last", corrupted bytes; logs on a full
disk never stop the run."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxlightning as jl
from jaxlightning.io.checkpoint import complete_checkpoints, find_last, read_meta, restore
from tests.helpers import LitMLP, digits, loader, quiet_trainer

ROOT = Path(__file__).resolve().parents[1]


def _can_unshare() -> bool:
    try:
        probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def _in_mount_namespace(setup: str, run: str, after: str) -> subprocess.Popen:
    """``setup`` (mounts), then tests/run_training.py ``run``, then ``after``, in a
    private mount namespace (as root: a real tmpfs or a read-only bind mount)."""
    script = (
        f"{setup} || exit 99; {sys.executable} -m tests.run_training {run}; rc=$?; {after}; "
        "exit $rc"
    )
    return subprocess.Popen(
        ["unshare", "-m", "sh", "-c", script],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.slow
@pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare -m for real mounts")
def test_full_disk_and_read_only_folder_fail_clearly_and_keep_the_last_good_checkpoint(tmp_path):
    full, kept = tmp_path / "full", tmp_path / "kept"
    readonly = tmp_path / "readonly"
    full.mkdir()
    (readonly / "ck").mkdir(parents=True)
    # A real 1 MiB tmpfs, filled once the checkpoint of step 4 is complete.
    disk = _in_mount_namespace(
        f"mount -t tmpfs -o size=1m tmpfs {full}",
        f"--root {full} --max-steps 22 --every-n-train-steps 4 --fill-disk-after 4",
        f"rm -f {full}/lightning_logs/version_0/filler; cp -a {full} {kept}",
    )
    ro = _in_mount_namespace(
        f"mount --bind {readonly}/ck {readonly}/ck && mount -o remount,ro,bind {readonly}/ck",
        f"--root {readonly} --max-steps 22 --every-n-train-steps 4 --dirpath {readonly}/ck",
        "true",
    )
    started = time.monotonic()
    out, _ = ro.communicate(timeout=240)
    assert ro.returncode == 1, out
    assert f"cannot write checkpoints to {readonly}/ck" in out and "Read-only" in out, out
    assert time.monotonic() - started < 120  # orbax's threads once waited 5 minutes

    out, _ = disk.communicate(timeout=240)
    assert disk.returncode == 1, out
    failed = re.search(r"CheckpointError: saving the checkpoint of step (\d+) .*No space", out)
    good = re.search(r"The last complete checkpoint is (\S+)/(\d+)\n", out)
    assert failed and good, out
    assert good.group(1) == f"{full}/lightning_logs/version_0/checkpoints"
    assert "DISK FULL after step 4" in out
    assert (good.group(2), failed.group(1)) == ("4", "8")
    folder = kept / "lightning_logs/version_0/checkpoints"
    assert [Path(p).name for p in complete_checkpoints(folder)] == [good.group(2)]
    assert restore(folder / good.group(2))["state"]["step"] == int(good.group(2))


_TENSORBOARD_ON_A_FULL_DISK = """
import warnings
from jaxlightning.loggers import TensorBoardLogger

logger = TensorBoardLogger({root!r})
logger.log_metrics({{"a": 0.0}}, step=0)  # the event file exists, its first flush done
try:
    with open({root!r} + "/filler", "wb", buffering=0) as f:
        while True:
            f.write(bytes(4096))
except OSError:
    pass
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for step in range(1, 3000):  # far more than tensorboardX's buffer and queue hold
        logger.log_metrics({{"a": float(step), "b": 1.0}}, step=step)
    logger.finalize()
print("WARNED", *(str(w.message) for w in caught), sep="\\n")
"""


@pytest.mark.slow
@pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare -m for real mounts")
def test_tensorboard_on_a_full_disk_warns_once_and_never_blocks(tmp_path):
    # tensorboardX's writer thread once died on ENOSPC and the next events
    # waited for ever on its full queue: a fit hung instead of going on.
    root = tmp_path / "full"
    root.mkdir()
    script = _TENSORBOARD_ON_A_FULL_DISK.format(root=str(root))
    done = subprocess.run(
        [
            "unshare",
            "-m",
            "sh",
            "-c",
            f'mount -t tmpfs -o size=1m tmpfs {root} && "$0" -c "$1"',
            sys.executable,
            script,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    warned = done.stdout.split("WARNED\n", 1)[1].strip().splitlines()
    assert len(warned) == 1, warned
    assert f"writing events to {root}" in warned[0] and "No space left" in warned[0]


class Scores(jl.Callback):
    """Puts a given sequence of ``score`` values into callback_metrics, one per validation."""

    def __init__(self, values):
        self.values, self.i = list(values), 0

    def on_validation_end(self, trainer, module):
        if trainer.sanity_checking:  # its values are discarded
            return
        trainer.callback_metrics["score"] = self.values[self.i]
        self.i += 1


def _fit_with_scores(root, values, **checkpoint):
    ckpt = jl.ModelCheckpoint(monitor="score", **checkpoint)
    trainer = quiet_trainer(
        max_epochs=len(values), default_root_dir=root, callbacks=[Scores(values), ckpt]
    )
    x, y = digits(32)
    trainer.fit(LitMLP(hidden=8), loader(x, y, 16), loader(x, y, 16))  # 2 steps per epoch
    return ckpt, [int(Path(p).name) for p in complete_checkpoints(ckpt.dirpath)]


def test_top_k_without_last_survives_scores_that_do_not_improve(tmp_path):
    # Pruning once deleted a save still being written, and fit crashed.
    ckpt, kept = _fit_with_scores(tmp_path, [0.5, 0.7, 0.6, 0.9], save_top_k=1, save_last=False)
    assert kept == [2]
    assert ckpt.best_model_path.endswith("/2") and ckpt.best_model_score == 0.5


@pytest.mark.parametrize("mode", ["min", "max"])
def test_nan_scores_rank_worst_in_either_mode(tmp_path, mode):
    values = [1.383, float("nan"), 1.118]
    ckpt, kept = _fit_with_scores(tmp_path, values, mode=mode, save_top_k=2, save_last=False)
    best = 6 if mode == "min" else 2
    assert sorted(kept) == [2, 6]
    assert ckpt.best_model_path.endswith(f"/{best}")


def _checkpointing_trainer(root, max_steps, **kw):
    ckpt = jl.ModelCheckpoint(every_n_train_steps=4, save_top_k=-1)
    return quiet_trainer(max_steps=max_steps, default_root_dir=root, callbacks=[ckpt], **kw)


def test_resuming_from_an_older_checkpoint_moves_newer_ones_aside(tmp_path):
    x, y = digits(64)
    _checkpointing_trainer(tmp_path, 12).fit(LitMLP(), loader(x, y, 8, shuffle=True))
    folder = tmp_path / "checkpoints"
    saved_at = {s: read_meta(folder / str(s))["saved_at"] for s in (4, 8, 12)}

    resumed = _checkpointing_trainer(tmp_path, 12)
    with pytest.warns(UserWarning, match=r"held checkpoints at steps \[8, 12\], after this run"):
        resumed.fit(LitMLP(), loader(x, y, 8, shuffle=True), ckpt_path=folder / "4")
    aside = [d for d in os.listdir(folder) if d.startswith("superseded-")]
    assert len(aside) == 1
    for step in (8, 12):  # the older run's checkpoints, untouched
        assert read_meta(folder / aside[0] / str(step))["saved_at"] == saved_at[step]
        assert read_meta(folder / str(step))["saved_at"] > saved_at[step]  # this run's
    assert read_meta(folder / "4")["saved_at"] == saved_at[4]


def test_last_is_the_highest_step_whatever_the_file_times(tmp_path):
    x, y = digits(64)
    trainer = _checkpointing_trainer(tmp_path, 8)
    trainer.fit(LitMLP(), loader(x, y, 8))
    folder = tmp_path / "checkpoints"
    (folder / "4" / "notes.txt").write_text("touched after step 8 was saved")
    os.utime(folder / "4")
    assert find_last([str(folder)]) == str(folder / "8")
    assert trainer._resolve_ckpt_path("last") == str(folder / "8")


def test_last_prefers_the_run_saved_most_recently_among_folders(tmp_path):
    x, y = digits(64)
    _checkpointing_trainer(tmp_path / "a", 12).fit(LitMLP(), loader(x, y, 8))
    _checkpointing_trainer(tmp_path / "b", 4).fit(LitMLP(), loader(x, y, 8))
    dirs = [str(tmp_path / "a" / "checkpoints"), str(tmp_path / "b" / "checkpoints")]
    assert find_last(dirs) == str(tmp_path / "b" / "checkpoints" / "4")


def test_flipped_bytes_in_a_checkpoint_are_detected(tmp_path):
    x, y = digits(64)
    _checkpointing_trainer(tmp_path, 4).fit(LitMLP(), loader(x, y, 8))
    path = tmp_path / "checkpoints" / "4"
    data = max(
        (p for p in (path / "state").rglob("*") if p.is_file() and "/d/" in str(p)),
        key=lambda p: p.stat().st_size,
    )
    raw = bytearray(data.read_bytes())
    middle = len(raw) // 2
    raw[middle : middle + 16] = bytes(b ^ 0xFF for b in raw[middle : middle + 16])
    data.write_bytes(bytes(raw))
    with pytest.raises(jl.CheckpointError, match=f"checkpoint {path} is corrupt: array '"):
        restore(path)
    with pytest.raises(jl.CheckpointError, match="is corrupt"):
        _checkpointing_trainer(tmp_path / "again", 8).fit(LitMLP(), loader(x, y, 8), ckpt_path=path)


def test_a_damaged_index_of_the_arrays_is_reported_as_corruption(tmp_path):
    # OCDBT finds the arrays through b-tree nodes (the files right under
    # state/d); flipped bytes there fail before any array is read (measured: at
    # each of 40 offsets of that file, as a bad magic number or a zstd error).
    x, y = digits(64)
    _checkpointing_trainer(tmp_path, 4).fit(LitMLP(), loader(x, y, 8))
    path = tmp_path / "checkpoints" / "4"
    nodes = [p for p in (path / "state" / "d").iterdir() if p.is_file()]
    assert nodes
    for node in nodes:
        raw = bytearray(node.read_bytes())
        raw[4:20] = bytes(b ^ 0xFF for b in raw[4:20])
        node.write_bytes(bytes(raw))
    with pytest.raises(jl.CheckpointError, match=f"checkpoint {path} is corrupt: the index"):
        restore(path)


@pytest.mark.parametrize(
    "decoder_says", ["Data corruption detected", "Destination buffer is too small"]
)
def test_bytes_that_no_longer_decode_are_reported_as_corruption_of_that_array(decoder_says):
    # Which chunk the flips above land in depends on the order orbax wrote the
    # arrays; in a compressed one the decoder, not the checksum, finds them
    # (both messages were seen in CI: a flipped frame header gives the second).
    from jaxlightning.io.checkpoint import _read_error

    seen = (
        'FAILED_PRECONDITION: Error reading "state.opt_state.0.mu.Dense_0.kernel/0.0" in '
        'OCDBT database at local file "/ckpt/4/state/": ZSTD_decompressStream() failed: '
        f"{decoder_says}; at byte 0; at uncompressed byte 0"
    )
    error = _read_error("/ckpt/4", ValueError(seen))
    array = "state/opt_state/0/mu/Dense_0/kernel"
    expected = f"checkpoint /ckpt/4 is corrupt: array '{array}' cannot be decoded"
    assert str(error).startswith(expected)
    other = _read_error("/ckpt/4", OSError("Permission denied"))
    assert str(other) == "could not read checkpoint /ckpt/4: Permission denied"


def test_saving_costs_one_checksum_pass(tmp_path):
    # The recorded checksums are those of the state's bytes, by array path.
    x, y = digits(64)
    trainer = _checkpointing_trainer(tmp_path, 4)
    trainer.fit(LitMLP(), loader(x, y, 8))
    folder = tmp_path / "checkpoints" / "4"
    meta = read_meta(folder)
    state = restore(folder)
    import zlib

    kernel = np.ascontiguousarray(state["state"]["params"]["Dense_0"]["kernel"])
    expected = zlib.crc32(kernel.reshape(-1).view(np.uint8))
    # Computed off the training thread, written beside the record once the save is done.
    assert meta["checksums"] == "checksums.json"
    recorded = json.loads((folder / "checksums.json").read_text())
    assert recorded["state/params/Dense_0/kernel"] == expected
    assert len(recorded) == len(jax.tree.leaves(state))
    shutil.rmtree(tmp_path / "checkpoints")


def test_checksums_in_the_record_or_in_their_file_are_checked_and_a_missing_file_warns(
    tmp_path,
):
    # Checkpoints saved before the checksums got their own file kept them in
    # the record: they are still checked. A run that stopped between the
    # arrays and their checksums leaves a checkpoint restored with a warning.
    import orbax.checkpoint as ocp

    from jaxlightning.io.checkpoint import FORMAT_VERSION, checksums

    state = {"state": {"params": {"w": np.arange(6, dtype=np.float32)}}}
    for name, recorded in (("1", checksums(state)), ("2", "checksums.json")):
        meta = {"format_version": FORMAT_VERSION, "checksums": recorded}
        ocp.Checkpointer(ocp.CompositeCheckpointHandler()).save(
            tmp_path / name,
            args=ocp.args.Composite(state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta)),
        )
    np.testing.assert_array_equal(restore(tmp_path / "1")["state"]["params"]["w"], np.arange(6))
    # Never chosen as "last" or kept as complete, but restorable when named.
    assert complete_checkpoints(str(tmp_path)) == [str(tmp_path / "1")]
    with pytest.warns(UserWarning, match="has no checksums.json: the run stopped"):
        restore(tmp_path / "2")
    bad = {"state/params/w": checksums(state)["state/params/w"] + 1}
    (tmp_path / "2" / "checksums.json").write_text(json.dumps(bad))
    assert len(complete_checkpoints(str(tmp_path))) == 2
    with pytest.raises(jl.CheckpointError, match="array 'state/params/w' does not match"):
        restore(tmp_path / "2")
