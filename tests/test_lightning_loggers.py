"""Lightning's CSVLogger and TensorBoardLogger tests, translated.

Each test names the Lightning test it translates (in Lightning's
``tests/tests_pytorch/loggers/test_csv.py`` and ``test_tensorboard.py``) and
keeps its inputs and expected values. Event files are read back with
TensorBoard's own reader.
"""

from __future__ import annotations

import csv
import os

import numpy as np
import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import jaxlightning as jl
from tests.helpers import LitMLP, digits, loader, quiet_trainer

METRICS = {"float": 0.3, "int": 1, "FloatTensor": torch.tensor(0.1), "IntTensor": torch.tensor(1)}
ODD_HPARAMS = {"a": 1, "b": 2, 123: 3, 3.5: 4, 5j: 5}


def _rows(logger: jl.CSVLogger) -> list[dict[str, str]]:
    with open(logger.metrics_file_path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("name", ["", None])
def test_csv_no_name(tmp_path, name):
    """test_csv.py::test_no_name: versions go directly under save_dir."""
    logger = jl.CSVLogger(save_dir=tmp_path, name=name)
    logger.log_hyperparams({"a": 1})
    assert os.path.normpath(logger.root_dir) == str(tmp_path)
    assert logger.log_dir == os.path.join(str(tmp_path), "version_0")
    assert os.listdir(tmp_path / "version_0")


@pytest.mark.parametrize("step_idx", [10, None])
def test_csv_log_metrics(tmp_path, step_idx):
    """test_csv.py::test_log_metrics: tensors become numbers, a step is optional."""
    logger = jl.CSVLogger(tmp_path)
    logger.log_metrics(METRICS, step_idx)
    logger.save()
    (row,) = _rows(logger)
    assert set(row) == {"step", *METRICS}
    assert row["step"] == ("10" if step_idx else "0")  # without one, the row's number
    assert float(row["FloatTensor"]) == pytest.approx(0.1) and row["IntTensor"] == "1"


def test_csv_rows_without_a_step_are_numbered(tmp_path):
    """Lightning's ExperimentWriter numbers rows logged without a step."""
    logger = jl.CSVLogger(tmp_path, flush_logs_every_n_steps=1)
    for value in (1.0, 2.0, 3.0):
        logger.log_metrics({"a": value})
    rows = [(r["step"], r["a"]) for r in _rows(logger)]
    assert rows == [("0", "1.0"), ("1", "2.0"), ("2", "3.0")]


def test_csv_log_hyperparams(tmp_path):
    """test_csv.py::test_log_hyperparams: every key is in hparams.yaml."""
    logger = jl.CSVLogger(tmp_path)
    hparams = {
        "float": 0.3,
        "int": 1,
        "string": "abc",
        "bool": True,
        "dict": {"a": {"b": "c"}},
        "list": [1, 2, 3],
        "layer": torch.nn.BatchNorm1d,
        **ODD_HPARAMS,
    }
    logger.log_hyperparams(hparams)
    with open(os.path.join(logger.log_dir, "hparams.yaml")) as f:
        params = yaml.safe_load(f)
    assert all(str(n) in params for n in hparams)
    assert params["float"] == 0.3 and params["123"] == 3


@pytest.mark.parametrize("name", ["", None])
def test_tensorboard_no_name(tmp_path, name):
    """test_tensorboard.py::test_tensorboard_no_name: odd keys are logged too."""
    logger = jl.TensorBoardLogger(save_dir=tmp_path, name=name)
    logger.log_hyperparams(ODD_HPARAMS)
    assert os.path.normpath(logger.root_dir) == str(tmp_path)
    assert os.listdir(tmp_path / "version_0")
    logger.finalize()


def test_tensorboard_named_version_writes_hparams_yaml(tmp_path):
    """test_tensorboard.py::test_tensorboard_named_version and
    test_tensorboard_hparams_reload: a string version is the folder, and the
    hparams are in its hparams.yaml."""
    (tmp_path / "tb_versioning").mkdir()
    logger = jl.TensorBoardLogger(tmp_path, name="tb_versioning", version="2020-02-05-162402")
    logger.log_hyperparams({"b1": 0.5, "b2": 0.999, **ODD_HPARAMS})
    assert os.listdir(tmp_path / "tb_versioning") == ["2020-02-05-162402"]
    with open(os.path.join(logger.log_dir, "hparams.yaml")) as f:
        params = yaml.safe_load(f)
    assert params["b1"] == 0.5 and params["b2"] == 0.999 and params["123"] == 3
    logger.finalize()


@pytest.mark.parametrize("step_idx", [10, None])
def test_tensorboard_log_metrics(tmp_path, step_idx):
    """test_tensorboard.py::test_tensorboard_log_metrics, read back by TensorBoard."""
    logger = jl.TensorBoardLogger(tmp_path)
    logger.log_metrics(METRICS, step_idx)
    logger.finalize()
    events = EventAccumulator(logger.log_dir)
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(METRICS)
    (point,) = events.Scalars("FloatTensor")
    assert point.value == pytest.approx(0.1)
    assert point.step == (10 if step_idx else 0)


def test_tensorboard_hparams_yaml_after_fit(tmp_path):
    """test_tensorboard.py::test_tensorboard_save_hparams_to_yaml_once: a fit's
    hparams are in the run directory's hparams.yaml, not in the root."""
    logger = jl.TensorBoardLogger(tmp_path)
    trainer = quiet_trainer(max_steps=1, default_root_dir=tmp_path, logger=logger)
    trainer.fit(LitMLP(hidden=16), loader(*digits(32), 16))
    with open(os.path.join(trainer.log_dir, "hparams.yaml")) as f:
        params = yaml.safe_load(f)
    assert params["hidden"] == 16 and np.isclose(params["lr"], 1e-2)
    assert not (tmp_path / "hparams.yaml").exists()


def test_loggers_sharing_a_folder_share_the_run_version(tmp_path):
    """TensorBoard and CSV under one save_dir write one run's version_0 (the
    Trainer fixes every logger's version before any of them writes; TensorBoard's
    hparams.yaml used to make the CSV logger take version_1)."""
    loggers = [jl.TensorBoardLogger(tmp_path), jl.CSVLogger(tmp_path)]
    trainer = quiet_trainer(max_steps=2, logger=loggers, log_every_n_steps=1)
    trainer.fit(LitMLP(hidden=16), loader(*digits(32), 16))
    assert (
        loggers[0].log_dir == loggers[1].log_dir == str(tmp_path / "lightning_logs" / "version_0")
    )
    assert os.listdir(tmp_path / "lightning_logs") == ["version_0"]
    assert {"metrics.csv", "hparams.yaml"} <= set(os.listdir(loggers[1].log_dir))


class StatusLogger(jl.loggers.Logger):
    """A logger as Lightning writes one: ``finalize(self, status)``."""

    log_dir = None

    def __init__(self):
        self.statuses = []

    def log_hyperparams(self, params):
        pass

    def log_metrics(self, metrics, step=None):
        pass

    def finalize(self, status):
        self.statuses.append(status)


class FailsAtFirstStep(LitMLP):
    def on_train_batch_start(self, batch_idx):
        raise RuntimeError("stop here")


def test_finalize_gets_lightnings_status():
    """Lightning's Logger.finalize(status): "success" when a call ends, "failed"
    when it raises (a ported logger with the argument no longer crashes the fit)."""
    logger = StatusLogger()
    trainer = quiet_trainer(max_epochs=1, logger=logger)
    trainer.fit(LitMLP(), loader(*digits(32), 16))
    assert logger.statuses == ["success"]
    failing = StatusLogger()
    with pytest.raises(RuntimeError, match="stop here"):
        quiet_trainer(max_epochs=1, logger=failing).fit(FailsAtFirstStep(), loader(*digits(32), 16))
    assert failing.statuses == ["failed"]


@pytest.mark.parametrize("kind", [jl.CSVLogger, jl.TensorBoardLogger])
def test_log_hyperparams_without_params_writes_an_empty_file(tmp_path, kind):
    """Lightning's loggers take ``log_hyperparams()`` with no params (``None``)."""
    logger = kind(tmp_path)
    logger.log_hyperparams()
    logger.finalize("success")
    with open(os.path.join(logger.log_dir, "hparams.yaml")) as f:
        assert yaml.safe_load(f) in ({}, None)


def test_csv_into_an_existing_version_replaces_the_old_runs_metrics(tmp_path):
    """fabric/loggers/csv_logs.py::_ExperimentWriter._check_log_dir_exists (and
    test_csv.py's version tests): a fixed version whose folder holds another
    run's metrics.csv warns and starts the file over; a fit resumed from that
    run's checkpoint continues it instead."""
    first = jl.CSVLogger(tmp_path, version=0)
    first.log_metrics({"old": 1.0}, step=0)
    first.save()
    second = jl.CSVLogger(tmp_path, version=0)
    second.log_metrics({"new": 2.0}, step=5)
    with pytest.warns(UserWarning, match="exists and is not empty"):
        second.save()
    assert _rows(second) == [{"step": "5", "new": "2.0"}]
    third = jl.CSVLogger(tmp_path, version=0)
    third.resume_in(third.log_dir)  # what a resumed fit does first
    third.log_metrics({"new": 3.0}, step=6)
    third.save()
    assert [r["new"] for r in _rows(third)] == ["2.0", "3.0"]
