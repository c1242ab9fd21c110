"""Runs kept in object storage: a real S3 server (moto's) on 127.0.0.1, dummy
credentials, every metadata lookup off, so nothing here reaches past localhost."""

import contextlib
import csv
import io
import os
import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import jaxlightning as jl
from jaxlightning.io.checkpoint import CheckpointError, complete_checkpoints, read_meta
from jaxlightning.launch import free_port
from tests.helpers import (
    LitMLP,
    assert_bitwise_equal,
    assert_params_close,
    bucket_fit,
    digits,
    fsdp_digits_params,
    fsdp_job_into,
    init_mlp,
    job_params,
    loader,
    trained_params,
    two_process_job,
)

pytestmark = pytest.mark.slow  # the full suite only (pytest --full)

boto3 = pytest.importorskip("boto3")
pytest.importorskip("s3fs")
pytest.importorskip("moto")

X, Y = digits(200)
VX, VY = digits(45, offset=1000)


@pytest.fixture(scope="module")
def bucket():
    with _moto_server() as (client, _):
        client.create_bucket(Bucket="runs")
        yield client


@contextlib.contextmanager
def _moto_server():
    """moto's S3 server on a free port of 127.0.0.1, this process's environment
    pointed at it: ``(client, server process)``."""
    port = free_port()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",  # boto3, s3fs and tensorboardX
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("moto's S3 server did not start") from None
                time.sleep(0.1)
        with pytest.MonkeyPatch.context() as mp:
            for key, value in env.items():
                mp.setenv(key, value)
            yield boto3.client("s3"), server
    finally:
        server.terminate()
        server.wait(timeout=30)


def _keys(client, prefix):
    pages = client.get_paginator("list_objects_v2").paginate(Bucket="runs", Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


_fit = bucket_fit


def test_a_run_in_the_bucket_resumes_from_last_bitwise_and_keeps_its_top_k(
    bucket, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # anything written locally by mistake would land here
    reference = trained_params(_fit(str(tmp_path / "local"), logger=False))

    root = "s3://runs/digits"
    stopped = _fit(root, max_steps=10)  # stops mid-epoch 1 (7 batches an epoch)
    assert stopped.global_step == 10
    ckpts = "digits/lightning_logs/version_0/checkpoints"
    resumed = _fit(root, ckpt_path="last")
    assert resumed.global_step == 21
    assert_bitwise_equal(trained_params(resumed), reference)
    assert resumed.log_dir == f"{root}/lightning_logs/version_0"  # the same run
    assert os.listdir(tmp_path) == ["local"]  # no 's3:' folder: everything in the bucket

    # The epoch-end validations, read back by TensorBoard from the bucket.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(resumed.log_dir)
    events.Reload()
    losses = {e.step: e.value for e in events.Scalars("val/loss")}
    assert sorted(losses) == [6, 13, 20]  # after each epoch's last update
    best_two = sorted(sorted(losses, key=losses.get)[:2])
    kept = sorted(int(p.rsplit("/", 1)[1]) for p in complete_checkpoints(f"s3://runs/{ckpts}"))
    assert kept == [s + 1 for s in best_two]  # a checkpoint is named by global_step
    # The stopped run's step-10 checkpoint (its "last") is gone with the rest.
    assert not [k for k in _keys(bucket, ckpts + "/10/")]
    assert read_meta(f"s3://runs/{ckpts}/{kept[-1]}")["progress"]["global_step"] == kept[-1]

    # The CSV log: one file, the stopped and the resumed run's rows in it.
    body = bucket.get_object(Bucket="runs", Key="digits/lightning_logs/version_0/metrics.csv")
    rows = list(csv.DictReader(io.StringIO(body["Body"].read().decode())))
    logged = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    np.testing.assert_allclose(logged, [losses[s] for s in sorted(losses)], rtol=1e-6)


def test_a_bucket_that_does_not_exist_is_named_before_training(bucket):
    trainer = jl.Trainer(
        max_epochs=1,
        default_root_dir="s3://no-such-bucket/run",
        logger=False,
        enable_progress_bar=False,
    )
    with pytest.raises(CheckpointError, match=r"cannot write checkpoints to s3://no-such-bucket"):
        trainer.fit(LitMLP(lr=1e-2, init_variables=init_mlp()), loader(X, Y, 32))


def test_the_cli_saves_its_config_in_the_bucket(bucket, tmp_path, monkeypatch):
    import yaml

    from tests.helpers import load_example

    monkeypatch.chdir(tmp_path)
    digits = load_example("digits")
    args = ["fit", "--trainer.max_steps=6", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false", "--trainer.default_root_dir=s3://runs/cli",
            "--model.lr=0.005"]  # fmt: skip
    cli = digits.DigitsCLI(digits.LitDigits, digits.DigitsData, args=args)
    assert cli.trainer.global_step == 6
    body = bucket.get_object(Bucket="runs", Key="cli/lightning_logs/version_0/config.yaml")
    config = yaml.safe_load(body["Body"].read())
    assert config["trainer"]["max_steps"] == 6 and config["model"]["lr"] == 0.005
    assert config["trainer"]["default_root_dir"] == "s3://runs/cli"
    assert os.listdir(tmp_path) == []


def test_resuming_an_older_checkpoint_in_the_bucket_moves_the_newer_aside(bucket):
    root = "s3://runs/aside"

    def fit(ckpt_path=None):
        trainer = jl.Trainer(
            max_steps=9,
            default_root_dir=root,
            logger=False,
            callbacks=[jl.ModelCheckpoint(every_n_train_steps=3, save_top_k=-1)],
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(
            LitMLP(lr=1e-2, init_variables=init_mlp()), loader(X, Y, 32), ckpt_path=ckpt_path
        )

    fit()
    folder = f"{root}/checkpoints"
    assert [p.rsplit("/", 1)[1] for p in complete_checkpoints(folder)] == ["3", "6", "9"]
    with pytest.warns(UserWarning, match=r"steps \[6, 9\].*superseded-"):
        fit(f"{folder}/3")
    aside = {k.split("/")[2] for k in _keys(bucket, "aside/checkpoints/superseded-")}
    assert len(aside) == 1  # one superseded-* folder, holding the old 6 and 9
    moved = {k.split("/")[3] for k in _keys(bucket, "aside/checkpoints/superseded-")}
    assert moved == {"6", "9"}
    assert [p.rsplit("/", 1)[1] for p in complete_checkpoints(folder)] == ["3", "6", "9"]


def test_a_step_whose_upload_was_cut_short_is_never_last(bucket):
    """checksums.json goes up last: a step in the bucket without it (the upload
    of a run killed mid-way) is not complete, and "last" is the step before."""
    root = "s3://runs/cut"
    trainer = jl.Trainer(
        max_steps=3,
        default_root_dir=root,
        logger=False,
        callbacks=[jl.ModelCheckpoint(every_n_train_steps=3)],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(LitMLP(lr=1e-2, init_variables=init_mlp()), loader(X, Y, 32))
    keys = _keys(bucket, "cut/checkpoints/3/")
    assert "cut/checkpoints/3/checksums.json" in keys and len(keys) > 1
    for key in keys:  # step 6, uploaded but for its last file
        if not key.endswith("/checksums.json"):
            src = {"Bucket": "runs", "Key": key}
            bucket.copy_object(Bucket="runs", Key=key.replace("/3/", "/6/"), CopySource=src)
    folder = f"{root}/checkpoints"
    assert [p.rsplit("/", 1)[1] for p in complete_checkpoints(folder)] == ["3"]
    resumed = jl.Trainer(
        max_steps=4,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    resumed.fit(LitMLP(lr=1e-2, init_variables=init_mlp()), loader(X, Y, 32), ckpt_path="last")
    assert resumed.global_step == 4  # from step 3, not the incomplete 6


def test_a_two_process_fsdp_job_checkpoints_into_the_bucket_and_resumes_on_any_count(
    bucket, tmp_path
):
    """Issue 40: each process uploads its own shards under the step's prefix,
    process 0 the rest and, after all of them, checksums.json (the step is then
    complete). A 1-process x 8-device run resumes from the bucket, and so does a
    2-process job, each equal to a straight 1 x 8 run (2 x 4 = 1 x 8 to 1e-5)."""
    root = "s3://runs/multi"
    ckpts, steps = fsdp_job_into(root, tmp_path / "straight2x4.npz", save_every=2)
    assert steps == [2, 4, 6, 8]
    keys = _keys(bucket, "multi/lightning_logs/version_0/checkpoints/4/")
    assert any("ocdbt.process_1/" in k for k in keys)  # process 1's shards, uploaded by it
    assert not os.path.exists("s3:")  # nothing written to a local folder named after the URL

    straight = fsdp_digits_params()
    assert_params_close(job_params(tmp_path / "straight2x4.npz"), straight)
    assert_params_close(fsdp_digits_params(f"{ckpts}/4"), straight)
    again = two_process_job(
        "--root", f"{root}-again", "--strategy", "fsdp", "--epochs", "2",
        "--ckpt-path", f"{ckpts}/4", "--out", tmp_path / "resumed2x4.npz",
    )  # fmt: skip
    assert again.returncode == 0, again.stdout[-3000:]
    assert_params_close(job_params(tmp_path / "resumed2x4.npz"), straight)


def test_a_server_that_stops_answering_mid_run_is_a_clear_error_on_every_process(tmp_path):
    """Issue 40's fault: the store goes away while a 2-process job checkpoints
    into it every 2 steps. The next save's uploads fail; the processes agree on
    it, so every process stops with a CheckpointError naming the step (none
    waits for ever at a barrier) and the job ends."""
    with _moto_server() as (client, server):
        client.create_bucket(Bucket="faults")
        proc = two_process_job(
            "--root", tmp_path / "logs", "--epochs", "100", "--sleep-per-step", "0.3",
            "--log-every", "50", "--save-every", "2", "--ckpt-dir", "s3://faults/ck",
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if re.match(r"\[rank 1\] step 5\b", line):
                server.terminate()  # the store stops answering
                server.wait(timeout=30)
                break
        out, _ = proc.communicate(timeout=240)  # no hang
    out = "".join(lines) + out
    assert proc.returncode != 0, out[-3000:]
    assert "CheckpointError" in out, out[-3000:]
    failed = re.findall(r"\[rank (\d)\].*saving the checkpoint of step (\d+)", out)
    # every process names the failed save and the last complete step; the error
    # that ends each one is that CheckpointError, not the store's own
    assert {rank for rank, _ in failed} == {"0", "1"}, out[-3000:]
    assert "The last complete checkpoint is s3://faults/ck/" in out, out[-3000:]
    for rank in "01":
        last = [ln for ln in out.splitlines() if ln.startswith(f"[rank {rank}]") and "Error" in ln]
        assert last and "CheckpointError" in last[-1], out[-3000:]


def test_a_process_killed_before_its_part_is_in_leaves_no_step_last_picks(bucket):
    """Issue 40's fault: a process dies between a save and its upload (which
    happens at the next save): the step never gets checksums.json, so the
    bucket's last complete step is the one before, and a run resumes there."""
    ckpts = "s3://runs/killed/ck"
    proc = two_process_job(
        "--root", "s3://runs/killed", "--epochs", "100", "--sleep-per-step", "0.3",
        "--log-every", "50", "--save-every", "2", "--ckpt-dir", ckpts,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    pids, lines = {}, []
    for line in proc.stdout:
        lines.append(line)
        if m := re.match(r"\[launch\] rank (\d) pid (\d+)", line):
            pids[int(m.group(1))] = int(m.group(2))
        if re.match(r"\[rank 1\] step 5\b", line):  # step 4 saved, not yet uploaded
            os.kill(pids[1], 9)
            break
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode != 0, ("".join(lines) + out)[-3000:]
    steps = [int(p.rsplit("/", 1)[1]) for p in complete_checkpoints(ckpts)]
    assert steps == [2], steps  # step 4 (and anything later) never became complete
    assert _keys(bucket, "killed/ck/2/") and not _keys(bucket, "killed/ck/4/checksums.json")
