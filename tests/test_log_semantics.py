"""`self.log` as in Lightning: every on_step/on_epoch/reduce_fx combination on 8
devices with an uneven last batch, read back from TensorBoard, CSV and
callback_metrics, against numpy over the same examples."""

import csv
import os

import optax
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import jaxlightning as jl
from tests.helpers import (
    LitMLP,
    digits,
    init_mlp,
    loader,
    np_cross_entropy,
    np_logits,
    quiet_trainer,
)

N_TRAIN, BATCH, N_VAL = 100, 32, 37  # batches of 32, 32, 32, 4 and 16, 16, 5


class LogsEverything(LitMLP):
    def configure_optimizers(self):
        return optax.sgd(0.0)  # fixed parameters: numpy can recompute every value

    def loss(self, variables, batch, rngs):
        x, y = batch
        per_example = optax.softmax_cross_entropy_with_integer_labels(
            self.net.apply(variables, x), y
        )
        self.log("mean_step", per_example)  # defaults in training: on_step only
        self.log("mean_both", per_example, on_epoch=True)
        self.log("sum_epoch", per_example, on_step=False, on_epoch=True, reduce_fx="sum")
        self.log("max_both", per_example, on_epoch=True, reduce_fx="max", prog_bar=True)
        self.log_dict({"min_epoch": per_example}, on_step=False, on_epoch=True, reduce_fx="min")
        self.log("train_hidden", per_example, logger=False)  # carries its stage: kept as is
        self.log("step_seen", self.global_step.astype(float), reduce_fx="max")
        return per_example

    def eval_step(self, variables, batch):
        x, y = batch
        per_example = optax.softmax_cross_entropy_with_integer_labels(
            self.net.apply(variables, x), y
        )
        self.log("val_loss", per_example)  # Lightning's name: kept as written
        self.log("loss_sum", per_example, reduce_fx="sum")
        self.log("loss_max", per_example, reduce_fx="max")
        self.log("loss_min", per_example, reduce_fx="min")


def _fit(root, **kwargs):
    x, y = digits(N_TRAIN)
    vx, vy = digits(N_VAL, 1000)
    variables = init_mlp()
    module = LogsEverything(init_variables=variables)
    loggers = [jl.TensorBoardLogger(str(root)), jl.CSVLogger(str(root), name="csv")]
    trainer = quiet_trainer(max_epochs=2, log_every_n_steps=3, logger=loggers, **kwargs)
    trainer.fit(module, loader(x, y, BATCH), loader(vx, vy, 16))
    train_loss = np_cross_entropy(np_logits(variables["params"], x), y)
    val_loss = np_cross_entropy(np_logits(variables["params"], vx), vy)
    events = EventAccumulator(loggers[0].log_dir)
    events.Reload()
    tb = {t: {e.step: e.value for e in events.Scalars(t)} for t in events.Tags()["scalars"]}
    with open(loggers[1].metrics_file_path, newline="") as f:
        rows = list(csv.DictReader(f))
    return trainer, train_loss, val_loss, tb, rows


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A fit whose step values reduce over each logging interval (ours)."""
    return _fit(tmp_path_factory.mktemp("semantics"), step_values="interval")


def _rows_of_steps(steps):
    """Example indices of global steps (1-based), 4 steps per epoch, no shuffling."""
    out = []
    for s in steps:
        b = (s - 1) % 4
        out += list(range(b * BATCH, min((b + 1) * BATCH, N_TRAIN)))
    return out


# Reports every 3 steps and at each epoch's end (after steps 4 and 8): intervals never span
# epochs. Loggers get Lightning's step numbers: the 0-based index of the interval's last
# update (test_train_loop_logging.py::test_log_metrics_epoch_step_values), so 3 -> 2.
WINDOWS = {2: [1, 2, 3], 3: [4], 5: [5, 6], 7: [7, 8]}
EPOCH_ENDS = (3, 7)


def test_step_values_are_exact_per_interval(run):
    _, loss, _, tb, _ = run
    for step, steps in WINDOWS.items():
        rows = _rows_of_steps(steps)
        assert tb["train/mean_step"][step] == pytest.approx(loss[rows].mean(), rel=1e-5)
        assert tb["train/max_both_step"][step] == pytest.approx(loss[rows].max(), rel=1e-5)
        assert tb["train/step_seen"][step] == max(steps) - 1  # the traced global_step
        assert tb["train/loss"][step] == pytest.approx(loss[rows].mean(), rel=1e-5)


def test_step_values_are_their_steps_own_by_default(tmp_path):
    """Lightning's rule (the default, ``step_values="last"``): a value logged
    on_step reports the logging step's own value; the Trainer's train/loss
    (log_loss) stays the interval's mean, and on_epoch values are unchanged."""
    _, loss, _, tb, _ = _fit(tmp_path)
    for step, steps in WINDOWS.items():
        rows = _rows_of_steps(steps[-1:])
        assert tb["train/mean_step"][step] == pytest.approx(loss[rows].mean(), rel=1e-5)
        assert tb["train/max_both_step"][step] == pytest.approx(loss[rows].max(), rel=1e-5)
        assert tb["train/step_seen"][step] == max(steps) - 1
        every = _rows_of_steps(steps)
        assert tb["train/loss"][step] == pytest.approx(loss[every].mean(), rel=1e-5)
    for step in EPOCH_ENDS:
        assert tb["train/mean_both_epoch"][step] == pytest.approx(loss.mean(), rel=1e-5)


def test_epoch_values_are_exact_over_the_epoch(run):
    _, loss, _, tb, _ = run
    for step in EPOCH_ENDS:  # each epoch sees all 100 examples
        assert tb["train/mean_both_epoch"][step] == pytest.approx(loss.mean(), rel=1e-5)
        assert tb["train/sum_epoch"][step] == pytest.approx(loss.sum(), rel=1e-5)
        assert tb["train/max_both_epoch"][step] == pytest.approx(loss.max(), rel=1e-5)
        assert tb["train/min_epoch"][step] == pytest.approx(loss.min(), rel=1e-5)
    assert set(tb["train/sum_epoch"]) == set(EPOCH_ENDS)


def test_eval_values_reduce_over_the_whole_loader(run):
    trainer, _, val_loss, tb, _ = run
    expected = {
        "val_loss": val_loss.mean(),
        "val/loss_sum": val_loss.sum(),
        "val/loss_max": val_loss.max(),
        "val/loss_min": val_loss.min(),
    }
    for name, value in expected.items():
        assert tb[name] == {s: pytest.approx(value, rel=1e-5) for s in EPOCH_ENDS}
        assert trainer.callback_metrics[name] == pytest.approx(value, rel=1e-5)


def test_logger_false_and_prog_bar_route_values(run):
    trainer, loss, _, tb, rows = run
    assert "train_hidden" not in tb and all(not r.get("train_hidden") for r in rows)
    assert trainer.callback_metrics["train_hidden"] == pytest.approx(
        loss[_rows_of_steps([7, 8])].mean(), rel=1e-5
    )
    assert set(trainer.progress_bar_metrics) == {
        "train/loss",
        "train/max_both_step",
        "train/max_both_epoch",
    }
    # with both on_step and on_epoch, the plain name holds the latest of the two
    assert trainer.callback_metrics["train/max_both"] == pytest.approx(loss.max(), rel=1e-5)


def test_csv_holds_what_tensorboard_holds(run):
    _, _, _, tb, rows = run
    assert rows and "step" in rows[0]
    from_csv = {}
    for row in rows:
        for key, value in row.items():
            if key not in ("step", "epoch") and value != "":
                from_csv.setdefault(key, {})[int(row["step"])] = float(value)
    assert from_csv.keys() == tb.keys() - {"epoch"}
    for tag, points in from_csv.items():
        assert points == pytest.approx(tb[tag], rel=1e-6), tag
    csv_dir = os.path.dirname(run[0].loggers[1].metrics_file_path)
    assert csv_dir.endswith(os.path.join("csv", "version_0"))


def test_a_rank_metric_per_batch_in_evaluation_is_refused_with_the_reason():
    class StepEval(LitMLP):
        def eval_step(self, variables, batch):
            x, y = batch
            score = self.net.apply(variables, x)[:, 0]
            self.log("rho", jl.metrics.SpearmanCorrCoef(score, y), on_step=True)

    x, y = digits(32)
    with pytest.raises(ValueError, match=r"rank metric is computed over the whole evaluation"):
        quiet_trainer(max_steps=1).validate(StepEval(), loader(x, y, 16))


def test_unknown_reduce_fx_is_named():
    class Median(LitMLP):
        def eval_step(self, variables, batch):
            self.log("acc", 1.0, reduce_fx="median")

    x, y = digits(32)
    with pytest.raises(ValueError, match=r"reduce_fx='median'\): use one of"):
        quiet_trainer().validate(Median(), loader(x, y, 16))
