"""Exact metrics on padded batches, compile-once, and cross-device batch_stats."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

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

# 203 examples in batches of 32 on 8 devices: 6 full batches and one of 11 rows,
# itself not a multiple of the device count.
VAL_N, BATCH = 203, 32


@pytest.fixture(scope="module")
def trained():
    x, y = digits(320)
    model = LitMLP(lr=1e-2)
    trainer = quiet_trainer(max_epochs=2)
    trainer.fit(model, loader(x, y, 32))
    return trainer, model


@pytest.fixture(scope="module")
def val_data():
    return digits(VAL_N, offset=1000)


@pytest.mark.parametrize("strategy", ["shard_map", "pmap"])
def test_validation_metrics_equal_numpy_over_whole_uneven_set(trained, val_data, strategy):
    _, model = trained
    x, y = val_data
    trainer = quiet_trainer(strategy=strategy)
    (result,) = trainer.validate(model, loader(x, y, BATCH))
    logits = np_logits(model.variables["params"], x)
    assert result["val/loss"] == pytest.approx(np_cross_entropy(logits, y).mean(), abs=1e-6)
    assert result["val/acc"] == pytest.approx((logits.argmax(-1) == y).mean(), abs=1e-6)


def test_test_stage_uses_test_prefix_and_matches_validate(trained, val_data):
    trainer, model = trained
    val = trainer.validate(model, loader(*val_data, BATCH))[0]
    test = trainer.test(model, loader(*val_data, BATCH))[0]
    assert sorted(test) == ["test/acc", "test/loss"]
    assert test["test/acc"] == val["val/acc"] and test["test/loss"] == val["val/loss"]


def test_several_val_loaders_get_dataloader_suffix(trained, val_data):
    trainer, model = trained
    x, y = val_data
    results = trainer.validate(model, [loader(x, y, BATCH), loader(x[:50], y[:50], BATCH)])
    assert len(results) == 2
    assert set(results[1]) == {"val/acc/dataloader_idx_1", "val/loss/dataloader_idx_1"}
    logits = np_logits(model.variables["params"], x[:50])
    assert results[1]["val/acc/dataloader_idx_1"] == pytest.approx(
        (logits.argmax(-1) == y[:50]).mean(), abs=1e-6
    )


def test_predict_returns_one_row_per_example_in_order(trained, val_data):
    trainer, model = trained
    x, y = val_data
    out = trainer.predict(model, loader(x, y, BATCH), concatenate=True)
    assert out["logits"].shape == (VAL_N, 10)
    np.testing.assert_allclose(out["logits"], np_logits(model.variables["params"], x), atol=1e-4)


def test_train_loss_is_exact_mean_over_epoch_with_padding():
    """lr=0 keeps params fixed, so the epoch's train/loss is a plain numpy mean."""
    x, y = digits(203)  # 7 batches of 32, the last 11 rows
    variables = init_mlp()
    model = LitMLP(lr=0.0, init_variables=variables)
    # the step values of the one interval: its mean (not its last step's)
    trainer = quiet_trainer(max_epochs=1, log_every_n_steps=7, step_values="interval")
    trainer.fit(model, loader(x, y, 32))
    logits = np_logits(variables["params"], x)
    assert trainer.logged_metrics["train/loss"] == pytest.approx(
        np_cross_entropy(logits, y).mean(), abs=1e-6
    )
    assert trainer.logged_metrics["train/acc"] == pytest.approx((logits.argmax(-1) == y).mean())


def test_scalar_loss_weights_shards_by_real_examples():
    """A scalar loss is taken as each shard's mean and weighted by its real rows."""
    x, y = digits(203)
    variables = init_mlp()
    model = LitMLP(lr=0.0, init_variables=variables, scalar_loss=True)
    # the step values of the one interval: its mean (not its last step's)
    trainer = quiet_trainer(max_epochs=1, log_every_n_steps=7, step_values="interval")
    trainer.fit(model, loader(x, y, 32))
    logits = np_logits(variables["params"], x)
    per_example = np_cross_entropy(logits, y)
    # Per device shard of 4 rows; the last batch has 11 real rows: shards of
    # 4, 4, 3 real rows, and padded shards of 0 real rows that must not count.
    expected_total = per_example[:192].sum()
    last = per_example[192:]
    for start in range(0, 11, 4):
        shard = last[start : start + 4]
        full = np.concatenate([shard, np.repeat(last[-1:], 4 - len(shard))])
        expected_total += full.mean() * len(shard)
    assert trainer.logged_metrics["train/loss"] == pytest.approx(expected_total / 203, abs=1e-6)


def test_train_and_eval_steps_compile_once_over_three_epochs(compiles):
    x, y = digits(203)  # uneven last batch
    model = LitMLP()
    trainer = quiet_trainer(max_epochs=3, log_every_n_steps=2)
    trainer.fit(model, loader(x, y, 32), loader(x[:77], y[:77], 32))
    trainer.validate(model, loader(x[:77], y[:77], 32))
    assert trainer.global_step == 21
    assert compiles.matching("jl_train_step") == 1, compiles.counts
    assert compiles.matching("jl_eval_step") == 1, compiles.counts


class BNNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.Dense(8)(x)
        h = nn.BatchNorm(use_running_average=not train, momentum=0.9)(h)
        return nn.Dense(10)(h)


class LitBN(jl.JaxModule):
    def __init__(self, variables):
        super().__init__()
        self.net, self.init_variables = BNNet(), variables

    def setup(self, rng, batch):
        return self.init_variables

    def configure_optimizers(self):
        return optax.sgd(0.1)

    def loss(self, variables, batch, rngs):
        x, y = batch
        logits, updates = self.net.apply(variables, x, train=True, mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, y), updates


@pytest.mark.parametrize("strategy", ["shard_map", "pmap"])
def test_batch_stats_are_cross_device_average(strategy):
    x, y = digits(64)
    variables = BNNet().init(jax.random.PRNGKey(0), x[:1])
    trainer = quiet_trainer(max_steps=1, strategy=strategy)
    trainer.fit(LitBN(variables), loader(x, y, 64))
    got = trainer.state.model_state["batch_stats"]["BatchNorm_0"]

    dense = variables["params"]["Dense_0"]
    h = x.astype(np.float64) @ np.asarray(dense["kernel"]) + np.asarray(dense["bias"])
    shards = h.reshape(8, 8, -1)  # 8 devices, 8 rows each
    mean = 0.1 * shards.mean(1).mean(0)  # initial mean 0, momentum 0.9
    var = 0.9 * 1.0 + 0.1 * shards.var(1).mean(0)
    np.testing.assert_allclose(got["mean"], mean, atol=1e-5)
    np.testing.assert_allclose(got["var"], var, atol=1e-5)
    # A single device's statistics would differ: the test can tell.
    assert not np.allclose(0.1 * shards[0].mean(0), mean, atol=1e-3)
