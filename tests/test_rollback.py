"""Trainer(on_nonfinite="rollback"): back to the last good state, the batches
since skipped; checked against runs on the data without those batches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxlightning as jl
from jaxlightning.callbacks.rollback import RollbackScaleState
from jaxlightning.io.checkpoint import read_meta
from tests.helpers import (
    LitMLP,
    assert_bitwise_equal,
    digits,
    loader,
    quiet_trainer,
    trained_params,
)


@pytest.mark.parametrize("strategy", ["auto", "fsdp"])
def test_a_nan_at_update_5_goes_back_to_the_last_report_and_skips_the_batches_since(strategy):
    x, y = digits(64)
    bad = x.copy()
    bad[33] = np.nan  # batch 4 (rows 32-39): update 5
    # Reports at updates 2, 4, 6: the one at 6 finds the NaN, the state goes
    # back to update 4's, and batches 4 and 5 (rows 32-47) are left out.
    kept = np.r_[0:32, 48:64]
    common = dict(max_epochs=1, devices=2, strategy=strategy, seed=3, log_every_n_steps=2)
    policy = jl.Rollback()
    rolling = quiet_trainer(on_nonfinite=policy, **common)
    rolling.fit(LitMLP(dropout=0.1), loader(bad, y, 8))
    absent = quiet_trainer(**common)
    absent.fit(LitMLP(dropout=0.1), loader(x[kept], y[kept], 8))

    assert_bitwise_equal(trained_params(rolling), trained_params(absent))
    assert rolling.global_step == int(rolling.state.step) == 6
    (event,) = policy.events
    assert event["step"] == 6 and event["to_step"] == 4 and event["batches_skipped"] == 2
    assert "non-finite loss at step 5 (epoch 0, batch 4)" in event["reason"]
    assert rolling.callback_metrics["train/rollbacks"] == 1.0
    assert np.isfinite(rolling.callback_metrics["train/loss"])
    assert np.isfinite(rolling.callback_metrics["train/loss_max"])


def test_a_loss_spike_rolls_back_and_training_equals_a_run_without_those_batches():
    x, y = digits(256)
    bad = x.copy()
    bad[160:168] *= 200.0  # batch 20, relabelled: update 21's loss is ~150x the others
    y = y.copy()
    y[160:168] = (y[160:168] + 1) % 10
    kept = np.r_[0:160, 176:256]  # back to update 20's state: batches 20 and 21 skipped
    common = dict(max_epochs=1, devices=2, log_every_n_steps=2)
    policy = jl.Rollback(spike_factor=5.0)
    rolling = quiet_trainer(on_nonfinite=policy, **common)
    rolling.fit(LitMLP(), loader(bad, y, 8))
    absent = quiet_trainer(**common)
    absent.fit(LitMLP(), loader(x[kept], y[kept], 8))

    assert_bitwise_equal(trained_params(rolling), trained_params(absent))
    (event,) = policy.events
    assert event["to_step"] == 20 and event["batches_skipped"] == 2
    assert event["reason"].startswith("a loss spike (")
    # Without the rollback the spike's update is trained on.
    plain = quiet_trainer(**common)
    plain.fit(LitMLP(), loader(bad, y, 8))
    trained, clean = trained_params(plain)["Dense_0"], trained_params(absent)["Dense_0"]
    assert not np.allclose(trained["kernel"], clean["kernel"])


def test_a_step_counted_checkpoint_is_checked_first_and_the_record_keeps_the_event(tmp_path):
    x, y = digits(128)
    bad = x.copy()
    bad[33] = np.nan  # update 5, where the checkpoint is due; no report before it
    kept = np.r_[40:128]  # back to the start: batches 0-4 skipped
    checkpoint = jl.ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=5, save_top_k=-1)
    rolling = quiet_trainer(
        max_epochs=1, devices=2, log_every_n_steps=50, on_nonfinite="rollback",
        callbacks=[checkpoint],
    )  # fmt: skip
    rolling.fit(LitMLP(), loader(bad, y, 8))
    absent = quiet_trainer(max_epochs=1, devices=2)
    absent.fit(LitMLP(), loader(x[kept], y[kept], 8))

    assert_bitwise_equal(trained_params(rolling), trained_params(absent))
    assert rolling.global_step == 11
    meta = read_meta(checkpoint.last_model_path)
    (event,) = meta["callbacks"]["Rollback"]["events"]
    assert event["to_step"] == 0 and event["batches_skipped"] == 5
    for path in checkpoint.best_k_models:  # steps 5 and 10, after the rollback: finite
        assert read_meta(path)["progress"]["global_step"] in (5, 10, 11)


def test_a_rolled_back_run_resumes_bitwise(tmp_path):
    x, y = digits(64)
    bad = x.copy()
    bad[33] = np.nan  # in every epoch: one rollback per epoch
    common = dict(devices=2, log_every_n_steps=2, seed=3)
    straight_policy = jl.Rollback()
    straight = quiet_trainer(max_epochs=2, on_nonfinite=straight_policy, **common)
    straight.fit(LitMLP(dropout=0.1), loader(bad, y, 8))

    first = quiet_trainer(
        max_epochs=1, on_nonfinite="rollback", callbacks=[jl.ModelCheckpoint(str(tmp_path))],
        **common,
    )  # fmt: skip
    first.fit(LitMLP(dropout=0.1), loader(bad, y, 8))
    policy = jl.Rollback()
    second = quiet_trainer(
        max_epochs=2, on_nonfinite=policy, callbacks=[jl.ModelCheckpoint(str(tmp_path))],
        **common,
    )  # fmt: skip
    second.fit(LitMLP(dropout=0.1), loader(bad, y, 8), ckpt_path="last")

    assert_bitwise_equal(trained_params(second), trained_params(straight))
    assert second.global_step == straight.global_step == 12
    assert policy.events == straight_policy.events and len(policy.events) == 2
    assert policy.history == straight_policy.history


def test_lr_factor_scales_every_update_after_a_rollback():
    x, y = digits(64)
    bad = x.copy()
    bad[33] = np.nan
    kept = np.r_[0:32, 48:64]

    class HalvedAfterUpdate4(LitMLP):  # the same optimizer, its rate halved from update 5 on
        def configure_optimizers(self):
            half = optax.scale_by_schedule(lambda count: jnp.where(count >= 4, 0.5, 1.0))
            return optax.chain(super().configure_optimizers(), half)

    policy = jl.Rollback(lr_factor=0.5)
    rolling = quiet_trainer(max_epochs=1, devices=2, log_every_n_steps=2, on_nonfinite=policy)
    rolling.fit(LitMLP(), loader(bad, y, 8))
    absent = quiet_trainer(max_epochs=1, devices=2, log_every_n_steps=2)
    absent.fit(HalvedAfterUpdate4(), loader(x[kept], y[kept], 8))

    rolled, halved = trained_params(rolling), trained_params(absent)
    pairs = zip(jax.tree.leaves(rolled), jax.tree.leaves(halved), strict=True)
    for a, b in pairs:
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-7)

    def is_scale(node):
        return isinstance(node, RollbackScaleState)

    leaves = jax.tree.leaves(rolling.state.opt_state, is_leaf=is_scale)
    (scale,) = [node for node in leaves if is_scale(node)]
    assert float(np.asarray(scale.scale).reshape(-1)[0]) == 0.5
    assert policy.lr_scale == policy.events[0]["lr_scale"] == 0.5


def test_rollbacks_in_a_row_are_bounded():
    x, y = digits(128)
    bad = x.copy()
    bad[32:] = np.nan  # every batch from 4 on
    trainer = quiet_trainer(
        max_epochs=1, log_every_n_steps=2, on_nonfinite=jl.Rollback(max_retries=2)
    )
    with pytest.raises(jl.NonFiniteLossError, match="after 2 rollbacks in a row to step 4"):
        trainer.fit(LitMLP(), loader(bad, y, 8))


def test_the_spike_rule_and_bad_settings():
    policy = jl.Rollback(spike_factor=3.0, window=4, min_history=2)
    assert not policy.is_spike(100.0, [1.0])  # too little history
    assert policy.is_spike(3.5, [1.0, 1.0, 9.0])  # the median, not the mean
    assert not policy.is_spike(2.9, [1.0, 1.0])
    assert not policy.is_spike(50.0, [-1.0, -2.0])  # a negative median: no rule
    assert policy.verdict(0, float("nan")).startswith("a non-finite loss")
    assert jl.Rollback(spike_factor=None).verdict(0, 1e9) is None
    for bad in (dict(spike_factor=1.0), dict(window=0), dict(max_retries=0), dict(lr_factor=2)):
        with pytest.raises(ValueError, match=f"Rollback\\({next(iter(bad))}="):
            jl.Rollback(**bad)


@pytest.mark.slow
@pytest.mark.parametrize(
    "setting, kept",
    [
        # update 3 = batches 4-5; reports at updates 2 and 4: back to 2, batches 4-7 out
        (dict(accumulate_grad_batches=2), np.r_[0:32]),
        # two batches per dispatch: the report at update 6 still finds it
        (dict(steps_per_execution=2), np.r_[0:32, 48:64]),
    ],
)
def test_rollback_under_accumulation_and_several_steps_per_dispatch(setting, kept):
    x, y = digits(64)
    bad = x.copy()
    bad[33] = np.nan  # batch 4
    common = dict(max_epochs=1, devices=2, log_every_n_steps=2, **setting)
    rolling = quiet_trainer(on_nonfinite="rollback", **common)
    rolling.fit(LitMLP(), loader(bad, y, 8))
    absent = quiet_trainer(**common)
    absent.fit(LitMLP(), loader(x[kept], y[kept], 8))
    assert_bitwise_equal(trained_params(rolling), trained_params(absent))
    assert rolling.global_step == absent.global_step


def test_manual_optimization_rolls_back_on_a_non_finite_loss():
    class Manual(jl.JaxModule):
        def setup(self, rng, batch):
            return LitMLP().net.init(rng, batch[0])

        def configure_optimizers(self):
            return optax.sgd(0.1)

        def training_step(self, optimizers, batch, rngs):
            x, y = batch

            def loss(params):
                logits = LitMLP().net.apply({"params": params}, x)
                return optax.softmax_cross_entropy_with_integer_labels(logits, y)

            optimizers.step(loss)

    x, y = digits(64)
    bad = x.copy()
    bad[33] = np.nan
    kept = np.r_[0:32, 48:64]
    common = dict(max_epochs=1, devices=2, log_every_n_steps=2)
    rolling = quiet_trainer(on_nonfinite="rollback", **common)
    rolling.fit(Manual(), loader(bad, y, 8))
    absent = quiet_trainer(**common)
    absent.fit(Manual(), loader(x[kept], y[kept], 8))
    assert_bitwise_equal(trained_params(rolling), trained_params(absent))
