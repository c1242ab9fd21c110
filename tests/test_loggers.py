"""Optional loggers on their real clients: wandb (offline run files) and MLflow
(a local file store), each getting every value a fit logs."""

import glob
import struct
import time

import pytest

import jaxlightning as jl
from tests.helpers import LitMLP, digits, loader, quiet_trainer

wandb = pytest.importorskip("wandb")
mlflow = pytest.importorskip("mlflow")


def _fit_with(logger):
    x, y = digits(96)  # 3 steps per epoch
    trainer = quiet_trainer(max_epochs=2, log_every_n_steps=2, logger=[logger])
    trainer.fit(LitMLP(hidden=8, lr=3e-3), loader(x, y, 32), loader(*digits(32, 1000), 16))
    return trainer


def _wandb_records(path):
    """The protobuf records of a wandb run file (LevelDB's log format: 32 KiB
    blocks of chunks, each with a CRC, a length and a kind)."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        payload, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending + payload)
            pending = b""
            yield record
        elif kind in (2, 3):
            pending += payload


def _key(item):
    return item.key or "/".join(item.nested_key)


def test_wandb_offline_run_holds_every_logged_value(tmp_path):
    logger = jl.loggers.WandbLogger(project="jl-test", save_dir=str(tmp_path), offline=True)
    trainer = _fit_with(logger)
    logger.finish()
    (path,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    # wandb's writer process may still be flushing the file when finish() returns:
    # wait (at most 30 s) for the run's closing record.
    deadline = time.monotonic() + 30
    while not any(r.HasField("exit") for r in _wandb_records(path)):
        assert time.monotonic() < deadline, "the wandb run file was never completed"
        time.sleep(0.2)
    history = []
    config = {}
    for record in _wandb_records(path):
        if record.HasField("history"):
            history.append({_key(item): float(item.value_json) for item in record.history.item})
        if record.HasField("config"):
            config.update({_key(u): u.value_json for u in record.config.update})
    losses = {h["trainer/global_step"]: h["train/loss"] for h in history if "train/loss" in h}
    val = [h["val/acc"] for h in history if "val/acc" in h]
    # every 2 steps and at each epoch's end, at Lightning's 0-based step numbers
    assert sorted(losses) == [1, 2, 3, 5]
    assert len(val) == 2 and val[-1] == pytest.approx(trainer.callback_metrics["val/acc"])
    assert losses[5] == pytest.approx(trainer.callback_metrics["train/loss"])
    assert "3e-3" in config.get("lr", "") or "0.003" in config.get("lr", "")


def test_mlflow_file_store_holds_every_logged_value(tmp_path):
    logger = jl.loggers.MLFlowLogger("jl-test", tracking_uri=f"file:{tmp_path / 'mlruns'}")
    trainer = _fit_with(logger)
    logger.finish()
    client = mlflow.tracking.MlflowClient(tracking_uri=logger.tracking_uri)
    run = client.get_run(logger.run_id)
    assert run.data.params["lr"] == "0.003" and run.info.status == "FINISHED"
    loss = {m.step: m.value for m in client.get_metric_history(logger.run_id, "train/loss")}
    val = client.get_metric_history(logger.run_id, "val/acc")
    assert sorted(loss) == [1, 2, 3, 5]  # Lightning's 0-based step numbers
    assert loss[5] == pytest.approx(trainer.callback_metrics["train/loss"])
    assert [m.step for m in val] == [2, 5]
    assert val[-1].value == pytest.approx(trainer.callback_metrics["val/acc"])
