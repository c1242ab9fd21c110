"""Runs kept in Google Cloud Storage: a real GCS server (gcp-storage-emulator's)
on 127.0.0.1, anonymous credentials, every metadata lookup off, so nothing here
reaches past localhost. The bucket is read back through google-cloud-storage's
own client, not through the gcsfs the Trainer writes with."""

import csv
import gc
import io
import os

import numpy as np
import pytest

# gcsfs (2026.3 and later) asks a gRPC API for each bucket's type unless told
# not to, when it is first imported; the emulator speaks only HTTP.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import jaxlightning as jl  # noqa: E402
from jaxlightning.io.checkpoint import (  # noqa: E402
    CheckpointError,
    complete_checkpoints,
    read_meta,
)
from jaxlightning.launch import free_port  # noqa: E402
from tests.helpers import (  # noqa: E402
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
)

pytestmark = pytest.mark.slow  # the full suite only (pytest --full)

pytest.importorskip("gcsfs")
emulator = pytest.importorskip("gcp_storage_emulator.server")
gcs = pytest.importorskip("google.cloud.storage")

X, Y = digits(200)
VX, VY = digits(45, offset=1000)


@pytest.fixture(scope="module")
def bucket():
    import fsspec
    from google.auth.credentials import AnonymousCredentials

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = emulator.create_server("127.0.0.1", port, in_memory=True, default_bucket="runs")
    server.start()
    saved = {p: fsspec.config.conf.get(p) for p in ("gs", "gcs")}
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("STORAGE_EMULATOR_HOST", url)  # google-cloud-storage (tensorboardX)
            mp.setenv("NO_GCE_CHECK", "true")  # google-auth: no metadata server
            mp.setenv("GOOGLE_CLOUD_PROJECT", "test")
            for protocol in saved:  # gcsfs, as a user's ~/.config/fsspec would set it
                fsspec.config.conf[protocol] = {"endpoint_url": url, "token": "anon"}
            client = gcs.Client(
                project="test",
                credentials=AnonymousCredentials(),
                client_options={"api_endpoint": url},
            )
            yield client.bucket("runs")
    finally:
        # tensorboardX keeps each writer until exit (an atexit hook holds it), and
        # its GCS record writer uploads its events once more when collected: the
        # server stops now, so those late repeats (of what was read back above)
        # would retry for two minutes each.
        from tensorboardX.record_writer import GCSRecordWriter

        for obj in gc.get_objects():
            if type(obj) is GCSRecordWriter:  # (isinstance would ask every object)
                obj.flush = lambda: None
        for protocol, conf in saved.items():
            if conf is None:
                fsspec.config.conf.pop(protocol, None)
            else:
                fsspec.config.conf[protocol] = conf
        server.stop()


_fit = bucket_fit


def test_a_run_in_a_gcs_bucket_resumes_from_last_bitwise_and_keeps_its_top_k(
    bucket, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # anything written locally by mistake would land here
    reference = trained_params(_fit(str(tmp_path / "local"), logger=False))

    root = "gs://runs/digits"
    stopped = _fit(root, max_steps=10)  # stops mid-epoch 1 (7 batches an epoch)
    assert stopped.global_step == 10
    resumed = _fit(root, ckpt_path="last")
    assert resumed.global_step == 21
    assert_bitwise_equal(trained_params(resumed), reference)
    assert resumed.log_dir == f"{root}/lightning_logs/version_0"  # the same run
    assert os.listdir(tmp_path) == ["local"]  # no 'gs:' folder: everything in the bucket

    run = "digits/lightning_logs/version_0"
    keys = [blob.name for blob in bucket.client.list_blobs("runs", prefix=run + "/")]
    # The epoch-end validations, from the event files in the bucket.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events_dir = tmp_path / "events"
    events_dir.mkdir()
    for key in keys:
        if "tfevents" in key.rsplit("/", 1)[-1]:
            bucket.blob(key).download_to_filename(events_dir / key.rsplit("/", 1)[-1])
    events = EventAccumulator(str(events_dir))
    events.Reload()
    losses = {e.step: e.value for e in events.Scalars("val/loss")}
    assert sorted(losses) == [6, 13, 20]  # after each epoch's last update
    best_two = sorted(sorted(losses, key=losses.get)[:2])
    ckpts = f"gs://runs/{run}/checkpoints"
    kept = sorted(int(p.rsplit("/", 1)[1]) for p in complete_checkpoints(ckpts))
    assert kept == [s + 1 for s in best_two]  # a checkpoint is named by global_step
    steps_in_bucket = {k.split("/")[4] for k in keys if k.startswith(run + "/checkpoints/")}
    assert steps_in_bucket == {str(s) for s in kept}  # the stopped run's step 10 is gone
    assert read_meta(f"{ckpts}/{kept[-1]}")["progress"]["global_step"] == kept[-1]

    # The CSV log: one object, the stopped and the resumed run's rows in it.
    text = bucket.blob(f"{run}/metrics.csv").download_as_text()
    rows = list(csv.DictReader(io.StringIO(text)))
    logged = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    np.testing.assert_allclose(logged, [losses[s] for s in sorted(losses)], rtol=1e-6)


def test_a_gcs_bucket_that_does_not_exist_is_named_before_training(bucket):
    trainer = jl.Trainer(
        max_epochs=1,
        default_root_dir="gs://no-such-bucket/run",
        logger=False,
        enable_progress_bar=False,
    )
    with pytest.raises(CheckpointError, match=r"cannot write checkpoints to gs://no-such-bucket"):
        trainer.fit(LitMLP(lr=1e-2, init_variables=init_mlp()), loader(X, Y, 32))


def test_a_two_process_fsdp_job_checkpoints_into_gcs_and_resumes_on_one_process(
    bucket, tmp_path, monkeypatch
):
    """Issue 40, for gs://: the 2-process x 4-device FSDP job of the S3 test,
    against the emulator (its processes reach it through fsspec's environment
    settings), resumed by a 1 x 8 run equal to a straight one (to 1e-5)."""
    url = os.environ["STORAGE_EMULATOR_HOST"]
    monkeypatch.setenv("FSSPEC_GS_ENDPOINT_URL", url)  # for the job's processes
    monkeypatch.setenv("FSSPEC_GS_TOKEN", "anon")
    ckpts, steps = fsdp_job_into("gs://runs/multi", tmp_path / "straight2x4.npz", save_every=4)
    assert steps == [4, 8]
    prefix = "multi/lightning_logs/version_0/checkpoints/4/"
    names = [b.name for b in bucket.list_blobs(prefix=prefix)]
    assert any("ocdbt.process_1/" in n for n in names)
    straight = fsdp_digits_params()
    resumed = fsdp_digits_params(f"{ckpts}/4")
    assert_params_close(resumed, straight)
    assert_params_close(job_params(tmp_path / "straight2x4.npz"), straight)
