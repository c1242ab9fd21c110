"""Checkpoints: bit-exact resume (new process, mid-epoch too), faults, bad input."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import jaxlightning as jl
from jaxlightning.io.checkpoint import complete_checkpoints, read_meta
from tests.helpers import LitMLP, digits, loader, max_abs_diff, np_logits, quiet_trainer

ROOT = Path(__file__).resolve().parents[1]


def train(root, max_steps, *args, check=True, **popen):
    """Runs tests/run_training.py in a new process."""
    cmd = [
        sys.executable,
        "-m",
        "tests.run_training",
        "--root",
        str(root),
        "--max-steps",
        str(max_steps),
        *map(str, args),
    ]
    if popen:
        return subprocess.Popen(cmd, cwd=ROOT, text=True, **popen)
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def arrays(path):
    with np.load(path) as f:
        return {k: f[k] for k in f}


def assert_bitwise_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), f"{k} differs by {np.abs(a[k] - b[k]).max()}"


def scalars(run_dir):
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """22 uninterrupted steps (7 per epoch): the run every resumed run must equal."""
    root = tmp_path_factory.mktemp("reference")
    train(root, 22, "--out", root / "final.npz")
    return arrays(root / "final.npz"), scalars(root / "lightning_logs" / "version_0")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stop_at", "every", "progress"),
    [(14, None, (2, 0)), (10, None, (1, 3)), (7, 7, (0, 7)), (8, 8, (1, 1))],
    ids=["epoch-boundary", "mid-epoch", "last-batch", "first-batch"],
)
def test_resume_in_new_process_is_bit_exact(tmp_path, reference, stop_at, every, progress):
    # A checkpoint taken at an epoch's last batch (before that epoch's
    # validation) once failed to resume: that epoch has no batch left.
    ref_arrays, ref_scalars = reference
    extra = ["--every-n-train-steps", every] if every else []
    train(tmp_path, stop_at, *extra)
    meta = read_meta(complete_checkpoints(tmp_path / "lightning_logs/version_0/checkpoints")[-1])
    epoch, batch = progress
    assert meta["progress"] == {
        "epoch": epoch,
        "batch": batch,
        "global_step": stop_at,
        "total_batches": stop_at,
        "validated": False,
        "batching": {"processes": 1, "batch_size": 32},
    }
    train(tmp_path, 22, "--ckpt-path", "last", "--out", tmp_path / "final.npz")
    assert_bitwise_equal(arrays(tmp_path / "final.npz"), ref_arrays)

    # The resumed run logs into the same run directory, and every value logged
    # after the resume point equals the uninterrupted run's.
    assert os.listdir(tmp_path / "lightning_logs") == ["version_0"]
    got = scalars(tmp_path / "lightning_logs" / "version_0")
    for tag in ("train/loss", "train/acc", "val/acc", "val/loss"):
        later = {s: v for s, v in ref_scalars[tag].items() if s > stop_at}
        assert later, tag
        assert {s: got[tag][s] for s in later} == later, tag


@pytest.mark.slow
def test_sigterm_mid_epoch_saves_and_resume_completes_the_run(tmp_path, reference):
    proc = train(tmp_path, 22, "--slow-after", 9, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen = []
    for line in proc.stdout:  # wait until training is past step 9
        seen.append(line)
        if line.strip() == "READY":
            break
    assert seen and seen[-1].strip() == "READY", "".join(seen)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "Received SIGTERM at step" in out and "ckpt_path='last'" in out
    saved = complete_checkpoints(tmp_path / "lightning_logs/version_0/checkpoints")
    stopped = read_meta(saved[-1])["progress"]
    assert 9 <= stopped["global_step"] < 22 and stopped["global_step"] % 7 != 0

    train(tmp_path, 22, "--ckpt-path", "last", "--out", tmp_path / "final.npz")
    assert_bitwise_equal(arrays(tmp_path / "final.npz"), reference[0])


@pytest.mark.slow
def test_slurm_signal_saves_requeues_and_the_restarted_job_resumes(tmp_path, reference):
    """Under a SLURM batch job (faked: its variables, and a stand-in scontrol on
    the PATH that records its arguments) SIGUSR1 saves, requeues the job and
    exits; the requeued job's fit, without ckpt_path, resumes from "last"."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol.calls"
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(SLURM_JOB_ID="4242", SLURM_JOB_NAME="train", PATH=f"{bin_dir}:{env['PATH']}")
    proc = train(
        tmp_path, 22, "--slow-after", 9, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
    )
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.strip() == "READY":
            break
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGUSR1, out
    assert "Received SIGUSR1 at step" in out and "SLURM job 4242 requeued" in out
    assert calls.read_text().split() == ["requeue", "4242"]

    again = train(
        tmp_path, 22, "--out", tmp_path / "final.npz", stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, env={**env, "SLURM_RESTART_COUNT": "1"},
    )  # fmt: skip
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 0, out
    assert_bitwise_equal(arrays(tmp_path / "final.npz"), reference[0])


@pytest.mark.slow
def test_sigkill_during_save_leaves_previous_checkpoint_restorable(tmp_path, reference):
    result = train(
        tmp_path, 22, "--every-n-train-steps", 5, "--kill-during-save-at", 12, check=False
    )
    assert result.returncode == -signal.SIGKILL, result.stdout + result.stderr
    folder = tmp_path / "lightning_logs/version_0/checkpoints"
    assert [Path(p).name for p in complete_checkpoints(folder)] == ["10"]
    assert any("tmp" in name for name in os.listdir(folder)), os.listdir(folder)

    train(tmp_path, 22, "--ckpt-path", "last", "--out", tmp_path / "final.npz")
    assert_bitwise_equal(arrays(tmp_path / "final.npz"), reference[0])


def _fit(root, max_steps, devices=8, ckpt_path=None, **kw):
    x, y = digits(200)
    trainer = jl.Trainer(
        max_steps=max_steps,
        devices=devices,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        **kw,
    )
    model = LitMLP(lr=3e-3)
    trainer.fit(model, loader(x, y, 32, shuffle=True), ckpt_path=ckpt_path)
    return trainer, model


def test_resume_on_one_device_matches_continuing_on_eight(tmp_path):
    _fit(tmp_path, 10)
    ckpt = complete_checkpoints(tmp_path / "checkpoints")[-1]
    eight, _ = _fit(tmp_path / "eight", 20, devices=8, ckpt_path=ckpt)
    one, _ = _fit(tmp_path / "one", 20, devices=1, ckpt_path=ckpt)
    assert one.global_step == eight.global_step == 20
    assert max_abs_diff(one.state.params, eight.state.params) < 1e-5
    assert max_abs_diff(one.state.opt_state, eight.state.opt_state) < 1e-5


def test_save_top_k_keeps_exactly_the_two_best(tmp_path):
    x, y = digits(200)
    ckpt = jl.ModelCheckpoint(monitor="val/acc", mode="max", save_top_k=2, save_last=False)
    trainer = jl.Trainer(
        max_epochs=6,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        callbacks=[ckpt],
        stage_prefix=True,
    )
    trainer.fit(LitMLP(hidden=8, lr=2e-3), loader(x, y, 32), loader(*digits(97, 1000), 32))
    logged = scalars(trainer.log_dir)["val/acc"]
    assert len(logged) == 6
    # loggers number steps as Lightning (the update's 0-based index), checkpoints by updates
    best = [s + 1 for s in sorted(logged, key=lambda step: (-logged[step], step))[:2]]
    kept = [int(Path(p).name) for p in complete_checkpoints(ckpt.dirpath)]
    assert sorted(kept) == sorted(best)
    assert ckpt.best_model_path.endswith(f"/{best[0]}")
    assert ckpt.best_model_score == pytest.approx(logged[best[0] - 1])


def test_load_from_checkpoint_rebuilds_module_for_inference(tmp_path):
    trainer, model = _fit(tmp_path, 14)
    path = trainer.checkpoint_callback.best_model_path
    loaded = LitMLP.load_from_checkpoint(path)
    assert loaded.hparams == model.hparams
    x, y = digits(50, offset=1000)
    np.testing.assert_allclose(
        np_logits(loaded.variables["params"], x),
        np_logits(model.variables["params"], x),
        atol=1e-6,
    )
    fresh = LitMLP(lr=3e-3)
    out = quiet_trainer().predict(fresh, loader(x, y, 16), ckpt_path=path, concatenate=True)
    np.testing.assert_allclose(out["logits"], np_logits(model.variables["params"], x), atol=1e-4)
    val = quiet_trainer().validate(LitMLP(lr=3e-3), loader(x, y, 16), ckpt_path=path)[0]
    assert val["val/acc"] == pytest.approx((out["logits"].argmax(-1) == y).mean())


def test_nonfinite_loss_stops_with_step_and_keeps_last_good_checkpoint(tmp_path):
    x, y = digits(64)
    x[43] = np.nan  # batch 5 (rows 40-47) of epoch 0: step 6
    ckpt = jl.ModelCheckpoint(every_n_train_steps=2)
    trainer = quiet_trainer(max_epochs=3, default_root_dir=tmp_path, callbacks=[ckpt])
    with pytest.raises(jl.NonFiniteLossError, match=r"step 6 \(epoch 0, batch 5\)") as info:
        trainer.fit(LitMLP(), loader(x, y, 8))
    assert isinstance(info.value, RuntimeError)  # Lightning's type for it (detect_anomaly)
    assert [Path(p).name for p in complete_checkpoints(tmp_path / "checkpoints")] == ["4"]

    lenient = quiet_trainer(max_epochs=1, stop_on_nonfinite_loss=False)
    lenient.fit(LitMLP(), loader(x, y, 8))
    assert lenient.global_step == 8 and np.isnan(lenient.callback_metrics["train/loss"])


def test_nonfinite_loss_with_accumulation_names_its_update_epoch_and_batch():
    class NanAtUpdate4(LitMLP):  # 0-based update 4: epoch 1, its batches 3-5
        def loss(self, variables, batch, rngs):
            bad = jnp.where(self.global_step == 4, jnp.nan, 0.0)
            return super().loss(variables, batch, rngs) + bad

    x, y = digits(60)  # 8 batches of 8 rows: updates after batches 3, 6 and 8 (flushed)
    trainer = quiet_trainer(max_epochs=3, accumulate_grad_batches=3)
    with pytest.raises(jl.NonFiniteLossError, match=r"step 5 \(epoch 1, batch 3\)"):
        trainer.fit(NanAtUpdate4(), loader(x, y, 8))


def test_missing_checkpoint_path_is_named(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=f"checkpoint {missing} does not exist"):
        _fit(tmp_path, 2, ckpt_path=missing)
    with pytest.raises(FileNotFoundError, match="ckpt_path='last': no complete checkpoint"):
        _fit(tmp_path / "empty", 2, ckpt_path="last")


def test_corrupt_checkpoint_is_named(tmp_path):
    bad = tmp_path / "7"
    (bad / "state").mkdir(parents=True)
    (bad / "meta").mkdir()
    (bad / "meta" / "metadata").write_text("{not json")
    with pytest.raises(jl.CheckpointError, match=f"could not read checkpoint {bad}"):
        _fit(tmp_path, 2, ckpt_path=bad)
    half = tmp_path / "8"
    (half / "state").mkdir(parents=True)
    with pytest.raises(jl.CheckpointError, match="is not a complete jaxlightning checkpoint"):
        _fit(tmp_path, 2, ckpt_path=half)


def test_checkpoint_of_another_model_names_first_differing_parameter(tmp_path):
    trainer, _ = _fit(tmp_path, 2)
    path = trainer.checkpoint_callback.last_model_path
    x, y = digits(64)
    other = jl.Trainer(
        max_steps=4, logger=False, enable_progress_bar=False, default_root_dir=tmp_path / "other"
    )
    with pytest.raises(
        jl.CheckpointError,
        match=r"'state/params/Dense_0/bias' has shape \(32,\) in the checkpoint "
        r"but \(16,\) here",  # the parameter, not the optimizer state that follows it
    ):
        other.fit(LitMLP(hidden=16), loader(x, y, 32), ckpt_path=path)
    with pytest.raises(jl.CheckpointError, match=r"'params/Dense_0/bias' has shape \(32,\)"):
        quiet_trainer().validate(LitMLP(hidden=16), loader(x, y, 32), ckpt_path=path)


def test_hparams_and_progress_recorded(tmp_path):
    trainer, _ = _fit(tmp_path, 9)
    meta = read_meta(trainer.checkpoint_callback.last_model_path)
    assert meta["hparams"]["lr"] == 3e-3 and meta["hparams"]["hidden"] == 32
    assert meta["progress"] == {
        "epoch": 1,
        "batch": 2,
        "global_step": 9,
        "total_batches": 9,
        "validated": False,
        "batching": {"processes": 1, "batch_size": 32},
    }
    assert meta["module"].endswith("LitMLP") and meta["num_devices"] == 8
