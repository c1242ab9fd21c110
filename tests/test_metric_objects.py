"""Metric objects for `self.log` (`jl.metrics.F1Score`, `AUROC`, ...) against
scikit-learn and numpy on the same predictions: through `validate` and `fit` on
2 devices with padded last batches, and their summed states directly."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats
from sklearn import metrics as skm

import jaxlightning as jl
from jaxlightning.metrics.logged import LogOptions, from_logged, zero
from tests.helpers import quiet_trainer

CLASSES, GRID = 5, 11
# 101 rows in batches of 16 on 2 devices: the last batch has 5 real rows, so one
# device holds 5 real rows and 3 padding copies, the other 8 padding copies.
N, BATCH = 101, 16


def outputs(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A model's outputs, made up: class scores right about half the time, a
    binary problem, a regression, and scores on `GRID` thresholds."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, n)
    y[y == 3] = 2  # class 3 never a target: macro averages must leave it out
    scores = rng.normal(size=(n, CLASSES)) + 1.2 * np.eye(CLASSES)[y]
    scores[:, 3] -= 1.0  # ... and rarely predicted
    target = rng.normal(size=n)
    return {
        "scores": scores.astype(np.float32),
        "y": y,
        "positive": (y == 0).astype(np.int32),
        "prob": 1 / (1 + np.exp(-scores[:, 0] + scores[:, 1:].mean(-1))).astype(np.float32),
        "on_grid": np.linspace(0, 1, GRID).astype(np.float32)[rng.integers(0, GRID, n)],
        "tied": np.round(rng.random(n) * 0.6 + 0.4 * (y == 0), 1).astype(np.float32),
        "pred": (target + rng.normal(scale=0.7, size=n)).astype(np.float32),
        "target": target.astype(np.float32),
    }


def log_every_metric(module: jl.JaxModule, batch: dict) -> None:
    scores, y, positive = batch["scores"], batch["y"], batch["positive"]
    labels = scores.argmax(-1)
    m = jl.metrics
    for average in ("macro", "micro", "weighted"):
        module.log(f"f1_{average}", m.F1Score(scores, y, num_classes=CLASSES, average=average))
        module.log(
            f"precision_{average}", m.Precision(labels, y, num_classes=CLASSES, average=average)
        )
        module.log(f"recall_{average}", m.Recall(labels, y, num_classes=CLASSES, average=average))
    binary = batch["prob"] > 0.5
    module.log("f1_binary", m.F1Score(binary, positive))
    module.log("precision_binary", m.Precision(binary, positive))
    module.log("recall_binary", m.Recall(binary, positive))
    module.log("mcc", m.MatthewsCorrCoef(labels, y, num_classes=CLASSES))
    module.log("acc", m.Accuracy(labels, y))
    module.log("top2", m.Accuracy(scores, y, top_k=2))
    module.log("mae", m.MeanAbsoluteError(batch["pred"], batch["target"]))
    module.log("mse", m.MeanSquaredError(batch["pred"], batch["target"]))
    module.log("rmse", m.MeanSquaredError(batch["pred"], batch["target"], squared=False))
    module.log("pearson", m.PearsonCorrCoef(batch["pred"], batch["target"]))
    module.log("auroc_grid", m.AUROC(batch["on_grid"], positive, thresholds=GRID))
    module.log("auroc_exact", m.AUROC(batch["prob"], positive, thresholds=None))
    module.log("auroc_ties", m.AUROC(batch["tied"], positive, thresholds=None))
    module.log("average_precision", m.AveragePrecision(batch["tied"], positive))
    module.log("spearman", m.SpearmanCorrCoef(batch["pred"], batch["target"]))
    module.log("spearman_ties", m.SpearmanCorrCoef(batch["tied"], batch["target"]))
    module.log("confusion", m.ConfusionMatrix(labels, y, num_classes=CLASSES))
    module.log(
        "confusion_true", m.ConfusionMatrix(labels, y, num_classes=CLASSES, normalize="true")
    )


def sklearn_values(d: dict[str, np.ndarray]) -> dict[str, float]:
    """What scikit-learn and numpy say for `log_every_metric`'s names over ``d``."""
    y, labels, positive = d["y"], d["scores"].argmax(-1), d["positive"]
    binary = d["prob"] > 0.5
    expected = {}
    for average in ("macro", "micro", "weighted"):
        expected[f"f1_{average}"] = skm.f1_score(y, labels, average=average, zero_division=0)
        expected[f"precision_{average}"] = skm.precision_score(
            y, labels, average=average, zero_division=0
        )
        expected[f"recall_{average}"] = skm.recall_score(
            y, labels, average=average, zero_division=0
        )
    expected["f1_binary"] = skm.f1_score(positive, binary)
    expected["precision_binary"] = skm.precision_score(positive, binary)
    expected["recall_binary"] = skm.recall_score(positive, binary)
    expected["mcc"] = skm.matthews_corrcoef(y, labels)
    expected["acc"] = skm.accuracy_score(y, labels)
    expected["top2"] = skm.top_k_accuracy_score(y, d["scores"], k=2, labels=range(CLASSES))
    expected["mae"] = skm.mean_absolute_error(d["target"], d["pred"])
    expected["mse"] = skm.mean_squared_error(d["target"], d["pred"])
    expected["rmse"] = np.sqrt(expected["mse"])
    expected["pearson"] = np.corrcoef(d["pred"], d["target"])[0, 1]
    expected["auroc_grid"] = skm.roc_auc_score(positive, d["on_grid"])
    expected["auroc_exact"] = skm.roc_auc_score(positive, d["prob"])
    expected["auroc_ties"] = skm.roc_auc_score(positive, d["tied"])
    expected["average_precision"] = skm.average_precision_score(positive, d["tied"])
    expected["spearman"] = stats.spearmanr(d["pred"], d["target"]).statistic
    expected["spearman_ties"] = stats.spearmanr(d["tied"], d["target"]).statistic
    return expected


def sklearn_matrices(d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """scikit-learn's confusion matrices for `log_every_metric`'s matrix names."""
    y, labels = d["y"], d["scores"].argmax(-1)
    return {
        "confusion": skm.confusion_matrix(y, labels, labels=range(CLASSES)),
        "confusion_true": np.nan_to_num(
            skm.confusion_matrix(y, labels, labels=range(CLASSES), normalize="true")
        ),
    }


class Outputs(jl.JaxModule):
    """Logs metric objects of the outputs in its batches (scaled by a parameter)."""

    def setup(self, rng, batch):
        return {"params": {"scale": jnp.ones(())}}

    def configure_optimizers(self):
        return optax.sgd(0.0)  # fixed parameters: the outputs stay as given

    def loss(self, variables, batch, rngs):
        scores = batch["scores"] * variables["params"]["scale"]
        labels = scores.argmax(-1)
        self.log(
            "f1",
            jl.metrics.F1Score(labels, batch["y"], num_classes=CLASSES, average="macro"),
            on_step=False,
            on_epoch=True,
        )
        self.log(
            "auroc",
            jl.metrics.AUROC(batch["on_grid"], batch["positive"], thresholds=GRID),
            on_step=False,
            on_epoch=True,
        )
        return optax.softmax_cross_entropy_with_integer_labels(scores, batch["y"])

    def eval_step(self, variables, batch):
        scaled = {**batch, "scores": batch["scores"] * variables["params"]["scale"]}
        log_every_metric(self, scaled)


def ready(module: jl.JaxModule) -> jl.JaxModule:
    """``module`` with its variables set, for `validate` without `fit`."""
    module.variables = {"params": {"scale": np.ones((), np.float32)}}
    return module


@pytest.fixture(scope="module")
def validated():
    data = outputs(N)
    (result,) = quiet_trainer(devices=2).validate(
        ready(Outputs()), jl.arrays(data, batch_size=BATCH)
    )
    return data, result


EXPECTED_NAMES = sorted(sklearn_values(outputs(N)))


@pytest.mark.parametrize("name", EXPECTED_NAMES)
def test_validate_equals_sklearn_over_the_real_rows(validated, name):
    data, result = validated
    assert result[f"val/{name}"] == pytest.approx(sklearn_values(data)[name], abs=1e-5)


def test_counting_the_padding_rows_would_change_the_values(validated):
    """The last real row, copied into the 11 padding rows, shifts the references."""
    data, result = validated
    padded = {k: np.concatenate([v, np.repeat(v[-1:], 11, axis=0)]) for k, v in data.items()}
    wrong = sklearn_values(padded)
    for name in ("f1_macro", "mcc", "acc", "mae", "pearson", "auroc_grid", "auroc_exact"):
        assert result[f"val/{name}"] != pytest.approx(wrong[name], abs=1e-5), name
    # (average precision is left out: copies of a low-scored negative leave it as it is)
    assert result["val/spearman"] != pytest.approx(wrong["spearman"], abs=1e-5)
    wrong_matrix = sklearn_matrices(padded)["confusion"]
    assert not np.array_equal(result["val/confusion"], wrong_matrix)


@pytest.mark.parametrize("name", ["confusion", "confusion_true"])
def test_confusion_matrices_equal_sklearn_and_stay_out_of_the_loggers(validated, name):
    data, result = validated
    expected = sklearn_matrices(data)[name]
    np.testing.assert_allclose(result[f"val/{name}"], expected, atol=1e-12)
    assert result[f"val/{name}"].shape == (CLASSES, CLASSES)


@pytest.mark.parametrize("strategy", ["auto", "fsdp"])
def test_rank_metrics_equal_scipy_with_a_last_batch_split_over_devices(tmp_path, strategy):
    """57 rows in batches of 8 on 4 devices: the last batch's one real row sits on
    the first device; the rows come back from every device (pmap and shard_map)."""
    data = outputs(57, seed=7)
    trainer = quiet_trainer(devices=4, strategy=strategy, logger=jl.CSVLogger(str(tmp_path)))
    (result,) = trainer.validate(ready(Outputs()), jl.arrays(data, batch_size=8))
    expected = sklearn_values(data)
    for name in ("spearman", "spearman_ties", "auroc_exact", "auroc_ties", "average_precision"):
        assert result[f"val/{name}"] == pytest.approx(expected[name], abs=1e-12), name
    assert "val/confusion" in trainer.callback_metrics
    assert "val/confusion" not in trainer.logged_metrics
    (csv,) = tmp_path.rglob("metrics.csv")
    header = csv.read_text().splitlines()[0].split(",")
    assert "val/spearman" in header and "val/confusion" not in header


def test_a_rank_metric_in_the_training_loss_is_refused_naming_it():
    class TrainSpearman(Outputs):
        def loss(self, variables, batch, rngs):
            self.log("rho", jl.metrics.SpearmanCorrCoef(batch["pred"], batch["target"]))
            return super().loss(variables, batch, rngs)

    message = r"self.log\('rho', SpearmanCorrCoef\(\)\) in loss\(\): a rank metric"
    with pytest.raises(ValueError, match=message):
        quiet_trainer(devices=2, max_epochs=1).fit(
            TrainSpearman(), jl.arrays(outputs(16), batch_size=8)
        )


def test_monitoring_a_confusion_matrix_is_refused_naming_its_shape():
    class Confused(Outputs):
        def eval_step(self, variables, batch):
            labels = batch["scores"].argmax(-1)
            self.log("cm", jl.metrics.ConfusionMatrix(labels, batch["y"], num_classes=CLASSES))

    stop = jl.EarlyStopping(monitor="val/cm")
    message = r"EarlyStopping\(monitor='val/cm'\): the value has shape \(5, 5\)"
    with pytest.raises(ValueError, match=message):
        data = jl.arrays(outputs(16), batch_size=8)
        quiet_trainer(devices=2, max_epochs=1, callbacks=[stop]).fit(Confused(), data, data)


def test_training_epoch_value_equals_sklearn_over_the_epoch():
    data = outputs(N, seed=1)
    trainer = quiet_trainer(devices=2, max_epochs=1)
    trainer.fit(Outputs(), jl.arrays(data, batch_size=BATCH))
    labels = data["scores"].argmax(-1)
    assert trainer.callback_metrics["train/f1"] == pytest.approx(
        skm.f1_score(data["y"], labels, average="macro"), abs=1e-6
    )
    assert trainer.callback_metrics["train/auroc"] == pytest.approx(
        skm.roc_auc_score(data["positive"], data["on_grid"]), abs=1e-9
    )


# ------------------------------------------------------ states, without a Trainer
def _state(metric, mask=None):
    mask = np.ones(metric.rows, bool) if mask is None else mask
    return from_logged("m", metric, jnp.asarray(mask), LogOptions(False, True))


@pytest.mark.parametrize("score", ["precision", "recall", "f1"])
@pytest.mark.parametrize("average", ["macro", "micro", "weighted"])
def test_masked_confusion_scores_equal_sklearn_on_the_real_rows(score, average):
    rng = np.random.default_rng(2)
    y, pred = rng.integers(0, 6, 60), rng.integers(0, 4, 60)  # classes 4, 5 never predicted
    mask = rng.random(60) < 0.7
    kind = {
        "precision": jl.metrics.Precision,
        "recall": jl.metrics.Recall,
        "f1": jl.metrics.F1Score,
    }
    reference = {"precision": skm.precision_score, "recall": skm.recall_score, "f1": skm.f1_score}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # zero division gives 0.0, without a warning
        value = _state(kind[score](pred, y, num_classes=7, average=average), mask).compute()
    expected = reference[score](y[mask], pred[mask], average=average, zero_division=0)
    assert value == pytest.approx(expected, abs=1e-12)


def test_states_of_two_halves_merge_into_the_state_of_the_whole():
    rng = np.random.default_rng(3)
    y, pred = rng.integers(0, 4, 40), rng.integers(0, 4, 40)
    metric = lambda s: jl.metrics.MatthewsCorrCoef(pred[s], y[s], num_classes=4)  # noqa: E731
    merged = _state(metric(slice(0, 25))).merge(_state(metric(slice(25, 40))))
    np.testing.assert_array_equal(merged.matrix, _state(metric(slice(None))).matrix)
    assert merged.compute() == pytest.approx(skm.matthews_corrcoef(y, pred), abs=1e-12)


def test_the_empty_state_has_the_structure_of_a_logged_one():
    for metric in (
        jl.metrics.F1Score(np.zeros(4, int), np.zeros(4, int), num_classes=7, average="micro"),
        jl.metrics.AUROC(np.zeros(4), np.zeros(4), thresholds=[0.1, 0.5, 0.9]),
        jl.metrics.MeanSquaredError(np.zeros((4, 2)), np.zeros((4, 2)), squared=False),
    ):
        empty = zero(LogOptions(False, True, metric=metric.spec))
        logged = _state(metric)
        assert jax.tree.structure(empty) == jax.tree.structure(logged)
        assert [a.shape for a in jax.tree.leaves(empty)] == [
            a.shape for a in jax.tree.leaves(logged)
        ]
        assert int(empty.merge(logged).count) == 4


def test_auroc_off_the_grid_is_sklearn_on_scores_rounded_down_to_the_grid():
    rng = np.random.default_rng(4)
    positive = rng.integers(0, 2, 300)
    prob = np.clip(0.3 * positive + rng.random(300) * 0.7, 0, 1).astype(np.float32)
    grid = np.array([0.2, 0.35, 0.5, 0.8], np.float32)
    value = _state(jl.metrics.AUROC(prob, positive, thresholds=grid)).compute()
    below = np.searchsorted(grid, prob, side="right")
    rounded = np.where(below > 0, grid[np.maximum(below - 1, 0)], -1.0)
    assert value == pytest.approx(skm.roc_auc_score(positive, rounded), abs=1e-12)
    fine = _state(jl.metrics.AUROC(prob, positive, thresholds=1000)).compute()
    assert fine == pytest.approx(skm.roc_auc_score(positive, prob), abs=2e-3)


def test_errors_of_several_outputs_average_them_uniformly_as_sklearn():
    rng = np.random.default_rng(5)
    pred, target = rng.normal(size=(30, 3)), rng.normal(size=(30, 3))
    mask = np.arange(30) < 23
    mae = _state(jl.metrics.MeanAbsoluteError(pred, target), mask).compute()
    mse = _state(jl.metrics.MeanSquaredError(pred, target), mask).compute()
    assert mae == pytest.approx(skm.mean_absolute_error(target[:23], pred[:23]), rel=1e-6)
    assert mse == pytest.approx(skm.mean_squared_error(target[:23], pred[:23]), rel=1e-6)


@pytest.mark.filterwarnings("ignore:A single label was found")
def test_undefined_values_are_nan_or_zero_as_in_sklearn_and_numpy():
    ones = np.ones(6, np.int32)
    assert np.isnan(_state(jl.metrics.AUROC(np.linspace(0, 1, 6), ones, thresholds=5)).compute())
    assert np.isnan(_state(jl.metrics.PearsonCorrCoef(ones, np.arange(6.0))).compute())
    mcc = _state(jl.metrics.MatthewsCorrCoef(ones, ones, num_classes=3)).compute()
    assert mcc == skm.matthews_corrcoef(ones, ones) == 0.0


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: jl.metrics.F1Score(np.zeros(8, int), np.zeros(6, int)),
            r"preds of shape \(8,\) and target of shape \(6,\) have different numbers of rows",
        ),
        (
            lambda: jl.metrics.F1Score(
                np.zeros((8, 3)), np.zeros(8, int), num_classes=5, average="macro"
            ),
            r"preds of shape \(8, 3\) hold 3 scores per row; give scores of shape \(8, 5\)",
        ),
        (
            lambda: jl.metrics.Recall(np.full(8, 0.7), np.zeros(8, int)),
            r"preds of shape \(8,\) are float32 numbers; give class labels",
        ),
        (
            lambda: jl.metrics.F1Score(np.zeros(8, int), np.zeros(8, int), num_classes=10),
            r"F1Score\(num_classes=10, average='binary'\): 'binary' scores class 1 of two",
        ),
        (
            lambda: jl.metrics.Accuracy(np.zeros(8, int), np.zeros(8, int), top_k=3),
            r"top_k needs scores of shape \(8, classes\); preds have shape \(8,\)",
        ),
        (
            lambda: jl.metrics.MeanAbsoluteError(np.zeros((8, 2)), np.zeros(8)),
            r"preds of shape \(8, 2\) and target of shape \(8,\) differ",
        ),
        (
            lambda: jl.metrics.AUROC(np.zeros(8), np.zeros(8), thresholds=[0.5, 0.2]),
            r"strictly increasing",
        ),
    ],
)
def test_bad_inputs_raise_naming_the_shapes_or_settings(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_rows_other_than_the_shard_are_named():
    metric = jl.metrics.AUROC(np.zeros(6), np.zeros(6), thresholds=5)
    with pytest.raises(
        ValueError,
        match=r"self.log\('m', AUROC\(thresholds=5\)\) got inputs of 6 rows but this device's "
        "shard has 4",
    ):
        from_logged("m", metric, jnp.ones(4, bool), LogOptions(False, True))


def test_reduce_fx_other_than_mean_is_refused_naming_the_metric():
    class MaxF1(Outputs):
        def eval_step(self, variables, batch):
            f1 = jl.metrics.F1Score(
                batch["scores"], batch["y"], num_classes=CLASSES, average="macro"
            )
            self.log("f1", f1, reduce_fx="max")

    with pytest.raises(
        ValueError,
        match=r"self.log\('f1', F1Score\(num_classes=5, average='macro'\), reduce_fx='max'\)",
    ):
        quiet_trainer(devices=2).validate(ready(MaxF1()), jl.arrays(outputs(8), batch_size=8))


def test_a_metric_object_in_a_host_side_hook_is_refused():
    class HostF1(Outputs):
        def eval_step(self, variables, batch):
            self.log("acc", batch["y"] == 0)

        def on_validation_epoch_end(self):
            self.log("f1", jl.metrics.F1Score(np.zeros(4, int), np.zeros(4, int)))

    with pytest.raises(
        ValueError,
        match=r"in on_validation_epoch_end\(\): a metric object is reduced on the devices",
    ):
        quiet_trainer(devices=2).validate(ready(HostF1()), jl.arrays(outputs(8), batch_size=8))
