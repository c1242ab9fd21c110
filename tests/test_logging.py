"""TensorBoard output, read back with TensorBoard's own reader; callbacks; the bar."""

import glob
import os
from collections import Counter

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

import jaxlightning as jl
from tests.helpers import LitMLP, digits, loader


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("tb")
    x, y = digits(203)  # 7 steps per epoch
    recorder = Recorder()
    trainer = jl.Trainer(
        log_loss=True,  # what loss() returns, as train/loss
        stage_prefix=True,  # TensorBoard groups the names by stage
        max_epochs=3,
        log_every_n_steps=5,
        default_root_dir=root,
        enable_progress_bar=False,
        callbacks=[recorder],
    )
    model = LitMLP(hidden=16, lr=3e-3)
    trainer.fit(model, loader(x, y, 32), loader(x[:50], y[:50], 32))
    second = jl.Trainer(
        log_loss=True,  # what loss() returns, as train/loss
        stage_prefix=True,
        max_steps=1,
        default_root_dir=root,
        enable_progress_bar=False,
    )
    second.fit(LitMLP(hidden=16), loader(x, y, 32))
    events = EventAccumulator(trainer.log_dir)
    events.Reload()
    return trainer, second, events, recorder, root


class Recorder(jl.Callback):
    def __init__(self):
        self.calls, self.val_acc = [], []

    def on_fit_start(self, trainer, module):
        self.calls.append("fit_start")

    def on_train_epoch_end(self, trainer, module):
        self.calls.append(f"epoch_end_{trainer.current_epoch}")
        self.val_acc.append(trainer.callback_metrics["val/acc"])

    def on_validation_end(self, trainer, module):
        self.calls.append("val_end")

    def on_fit_end(self, trainer, module):
        self.calls.append("fit_end")


def test_each_run_gets_its_own_version_directory(run):
    trainer, second, _, _, root = run
    assert trainer.log_dir == os.path.join(root, "lightning_logs", "version_0")
    assert second.log_dir == os.path.join(root, "lightning_logs", "version_1")
    assert sorted(os.listdir(os.path.join(root, "lightning_logs"))) == ["version_0", "version_1"]


def test_train_loss_logged_every_n_steps_and_at_each_epoch_end(run):
    # 7 steps per epoch: every 5th step, and each epoch's last, partial interval
    # (intervals never span epochs, and none is lost).
    _, _, events, _, _ = run
    steps = [e.step for e in events.Scalars("train/loss")]
    # Lightning's numbering: a value is logged at its last update's 0-based index
    assert steps == [4, 6, 9, 13, 14, 19, 20]
    assert [e.step for e in events.Scalars("train/acc")] == steps


def test_val_metrics_logged_once_per_epoch_with_epoch(run):
    trainer, _, events, recorder, _ = run
    val = events.Scalars("val/acc")
    assert [e.step for e in val] == [6, 13, 20]
    assert [round(e.value, 6) for e in val] == [round(v, 6) for v in recorder.val_acc]
    assert "epoch" in events.Tags()["scalars"]
    assert [e.value for e in events.Scalars("epoch")][-1] == 2.0


def test_hparams_tab_lists_the_validation_metrics_as_columns(run):
    _, _, events, _, _ = run
    content = events.PluginTagToContent("hparams")
    experiment = plugin_data_pb2.HParamsPluginData.FromString(
        content["_hparams_/experiment"]
    ).experiment
    columns = {m.name.tag for m in experiment.metric_infos}
    assert {"val/acc", "val/loss", "train/loss"} <= columns and "epoch" not in columns
    assert {h.name for h in experiment.hparam_infos} >= {"hidden", "lr"}


def test_hparams_written_into_the_same_run(run):
    _, _, events, _, _ = run
    content = events.PluginTagToContent("hparams")
    info = plugin_data_pb2.HParamsPluginData.FromString(
        content["_hparams_/session_start_info"]
    ).session_start_info
    assert info.hparams["hidden"].number_value == 16
    assert info.hparams["lr"].number_value == pytest.approx(3e-3)
    assert info.hparams["scalar_loss"].bool_value is False


def test_callbacks_called_in_order(run):
    _, _, _, recorder, _ = run
    assert recorder.calls == [
        "fit_start",
        "val_end",  # the sanity check's validation calls its hooks, as in Lightning
        "val_end",
        "epoch_end_0",
        "val_end",
        "epoch_end_1",
        "val_end",
        "epoch_end_2",
        "fit_end",
    ]


def test_current_epoch_counts_completed_epochs(run):
    trainer, second, _, _, _ = run
    assert trainer.current_epoch == 3 and trainer.global_step == 21
    # an epoch cut short by max_steps still counts as done, as in Lightning
    assert second.current_epoch == 1 and second.global_step == 1


def test_progress_bar_shows_epochs_and_only_prog_bar_metrics(tmp_path, capsys):
    class BarAcc(LitMLP):
        def eval_step(self, variables, batch):
            x, y = batch
            self.log("acc", self.net.apply(variables, x).argmax(-1) == y, prog_bar=True)

    x, y = digits(96)
    trainer = jl.Trainer(
        log_loss=True,  # what loss() returns, as train/loss
        stage_prefix=True,
        max_epochs=2,
        log_every_n_steps=1,
        logger=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(BarAcc(hidden=16), loader(x, y, 32), loader(x, y, 32))
    err = capsys.readouterr().err
    assert "Epoch 0" in err and "Epoch 1" in err and "Validation" in err
    assert "train/loss=" in err and "val/acc=" in err
    assert "train/acc=" not in err  # logged without prog_bar
    assert set(trainer.progress_bar_metrics) == {"train/loss", "val/acc"}
    assert "train/acc" in trainer.callback_metrics


def test_tensorboard_logger_resumes_only_its_own_run_directories(tmp_path):
    from jaxlightning import TensorBoardLogger

    own = TensorBoardLogger(str(tmp_path))
    own.resume_in(str(tmp_path / "lightning_logs" / "version_3"))
    assert own.version == 3
    foreign = TensorBoardLogger(str(tmp_path))
    foreign.resume_in(str(tmp_path / "elsewhere" / "version_3"))  # not under save_dir/name
    assert foreign.version == 0
    fixed = TensorBoardLogger(str(tmp_path), version=7)
    fixed.resume_in(str(tmp_path / "lightning_logs" / "version_3"))  # a chosen version wins
    assert fixed.version == 7


def _points_per_file(run_dir):
    """Scalar points by tag, counted in every event file read on its own."""
    points = Counter()
    files = sorted(glob.glob(os.path.join(run_dir, "events.out.tfevents.*")))
    for path in files:
        events = EventAccumulator(path)
        events.Reload()
        for tag in events.Tags()["scalars"]:
            points[tag] += len(events.Scalars(tag))
    return points, len(files)


def test_fit_validate_and_test_in_quick_succession_lose_no_values(tmp_path):
    x, y = digits(96)  # 3 steps per epoch
    trainer = jl.Trainer(
        log_loss=True,  # what loss() returns, as train/loss
        max_epochs=2,
        log_every_n_steps=1,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        stage_prefix=True,
    )
    model = LitMLP(hidden=8)
    val = loader(*digits(32, 1000), 16)
    trainer.fit(model, loader(x, y, 32), val)
    trainer.validate(model, val)
    trainer.test(model, val)
    points, files = _points_per_file(trainer.log_dir)
    assert files == 3  # one writer per stage, none overwritten in the same second
    assert points["train/loss"] == 6 and points["val/acc"] == 3 and points["test/acc"] == 1


def test_validate_called_by_a_callback_mid_fit_loses_no_train_values(tmp_path):
    class ValidateEveryStep(jl.Callback):
        def on_train_batch_end(self, trainer, module, batch_idx):
            trainer.validate(module, val)

    val = loader(*digits(16, 1000), 16)
    trainer = jl.Trainer(
        log_loss=True,  # what loss() returns, as train/loss
        max_steps=30,
        log_every_n_steps=1,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        callbacks=[ValidateEveryStep()],
        stage_prefix=True,
    )
    trainer.fit(LitMLP(hidden=8), loader(*digits(240), 8))
    points, _ = _points_per_file(trainer.log_dir)
    assert points["train/loss"] == 30 and points["val/acc"] == 30
    steps = sorted(e.step for e in _reload(trainer.log_dir).Scalars("train/loss"))
    assert steps == list(range(30))  # Lightning's 0-based step numbers


def _reload(run_dir):
    events = EventAccumulator(run_dir)
    events.Reload()
    return events
