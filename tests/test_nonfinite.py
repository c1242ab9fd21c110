"""Trainer(on_nonfinite="skip"): a bad update is left out, decided inside the step."""

from __future__ import annotations

import numpy as np
import optax
import pytest

import jaxlightning as jl
from tests.helpers import (
    LitMLP,
    assert_bitwise_equal,
    digits,
    init_mlp,
    loader,
    max_abs_diff,
    quiet_trainer,
    trained_params,
)


@pytest.mark.parametrize("strategy", ["auto", "fsdp"])
def test_a_nan_batch_is_skipped_as_if_it_were_absent(strategy):
    x, y = digits(64)
    bad = x.copy()
    bad[33] = np.nan  # batch 4 (rows 32-39): update 5
    kept = np.r_[0:32, 40:64]
    # Dropout on: keys come from the state's step counter, which a skipped
    # update leaves as it was, so the later batches get the same keys.
    common = dict(max_epochs=1, devices=2, strategy=strategy, on_nonfinite="skip", seed=3)
    skipping = quiet_trainer(log_every_n_steps=50, **common)
    skipping.fit(LitMLP(dropout=0.1), loader(bad, y, 8))
    absent = quiet_trainer(**common)
    absent.fit(LitMLP(dropout=0.1), loader(x[kept], y[kept], 8))

    assert_bitwise_equal(trained_params(skipping), trained_params(absent))
    assert int(skipping.state.step) == int(absent.state.step) == 7
    assert skipping.global_step == 8  # the host counts the batch it trained on
    metrics = skipping.callback_metrics
    assert metrics["train/skipped_updates"] == 1.0
    assert np.isfinite(metrics["train/loss"])  # the skipped step's loss is left out


def test_a_skipped_accumulated_update_is_as_if_its_batches_were_absent():
    x, y = digits(64)
    bad = x.copy()
    bad[[17, 29]] = np.nan  # batches 2 and 3: both micro-batches of update 2
    kept = np.r_[0:16, 32:64]
    common = dict(max_epochs=1, devices=2, on_nonfinite="skip", accumulate_grad_batches=2)
    skipping = quiet_trainer(**common)
    skipping.fit(LitMLP(), loader(bad, y, 8))
    absent = quiet_trainer(**common)
    absent.fit(LitMLP(), loader(x[kept], y[kept], 8))
    assert_bitwise_equal(trained_params(skipping), trained_params(absent))
    assert int(skipping.state.step) == 3


def test_on_nonfinite_choices_other_than_raise_skip_and_rollback_are_named():
    with pytest.raises(ValueError, match="on_nonfinite='ignore': use 'raise'.*'skip'.*'rollback'"):
        quiet_trainer(on_nonfinite="ignore")


@pytest.mark.slow  # an accuracy sweep; 16-mixed keeps its overflow test here
def test_float16_mixed_learns_digits_within_a_point_of_float32():
    x, y = digits()
    train, val = loader(x[:1400], y[:1400], 32, shuffle=True), loader(x[1400:], y[1400:], 128)
    accuracy = {}
    for precision in ("32-true", "16-mixed"):
        trainer, module = quiet_trainer(max_epochs=6, devices=2, precision=precision), LitMLP()
        trainer.fit(module, train)
        accuracy[precision] = trainer.validate(module, val)[0]["val/acc"]
    assert accuracy["32-true"] > 0.88
    assert abs(accuracy["16-mixed"] - accuracy["32-true"]) <= 0.01


def test_float16_overflow_skips_the_update_and_halves_the_scale():
    # A large loss: its float16 gradient overflows at the initial scale of
    # 2**16, so the first updates are skipped until the scale is small enough.
    class LargeLoss(LitMLP):
        def loss(self, variables, batch, rngs):
            return super().loss(variables, batch, rngs) * 1000.0

    x, y = digits(256)
    trainer = quiet_trainer(max_epochs=1, devices=2, precision="16-mixed", log_every_n_steps=99)
    trainer.fit(LargeLoss(lr=1e-3), loader(x, y, 16))
    skipped = int(trainer.callback_metrics["train/skipped_updates"])
    scale = trainer.state.opt_state.scale
    assert skipped >= 1
    assert float(scale) == 2.0**16 / 2**skipped  # halved once per skip, no growth yet
    assert int(trainer.state.step) == trainer.global_step - skipped == 16 - skipped
    assert np.isfinite(trainer.callback_metrics["train/loss"])


def test_float16_with_accumulation_equals_the_larger_batch_and_skips_overflowing_windows():
    # Lightning's 16-mixed with accumulate_grad_batches (torch's GradScaler: one
    # overflow check per optimizer step). 4 micro-batches of 16 are one update of a
    # batch of 64 (to float16's rounding); a loss large enough to overflow the
    # scaled float16 gradient spoils its whole window: no update, the scale halved.
    x, y = digits(256)

    def fit(module, batch, **kwargs):
        trainer = quiet_trainer(
            max_epochs=1, devices=2, precision="16-mixed", log_every_n_steps=99, **kwargs
        )
        trainer.fit(module, loader(x, y, batch))
        return trainer

    start = init_mlp()
    accumulated = fit(LitMLP(lr=1e-3, init_variables=start), 16, accumulate_grad_batches=4)
    whole = fit(LitMLP(lr=1e-3, init_variables=start), 64)
    assert accumulated.global_step == whole.global_step == 4
    # the initial scale 2**16 overflows the first windows alike (as GradScaler's
    # first steps often do): the same updates skipped, the same scale after
    assert int(accumulated.state.step) == int(whole.state.step) >= 1
    assert float(accumulated.state.opt_state.scale) == float(whole.state.opt_state.scale)
    assert max_abs_diff(accumulated.state.params, whole.state.params) < 1e-4
    assert max_abs_diff(accumulated.state.params, start["params"]) > 1e-3

    class LargeLoss(LitMLP):
        def loss(self, variables, batch, rngs):
            return super().loss(variables, batch, rngs) * 1000.0

    large = fit(LargeLoss(lr=1e-3), 16, accumulate_grad_batches=4)
    updates = int(large.state.step)
    skipped_windows = large.global_step - updates
    assert skipped_windows >= 1
    assert float(large.state.opt_state.scale) == 2.0**16 / 2**skipped_windows


class _Manual(LitMLP):
    """LitMLP optimized manually: one optimizer step per batch, with an optional
    factor on the loss."""

    loss = jl.JaxModule.loss  # optimizes manually instead
    factor = 1.0

    def training_step(self, optimizers, batch, rngs):
        x, y = batch

        def loss(params):
            logits = self.net.apply({"params": params}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y) * self.factor

        self.log("step_loss", optimizers.step(loss))


def test_float16_with_manual_optimization_scales_each_step_as_gradscaler():
    # Lightning's 16-mixed with manual optimization: the loss scaled before each
    # backward pass, each optimizer step skipped on overflow and the one scale
    # moved after it (torch's scaler.step + scaler.update per step).
    x, y = digits(256)

    def fit(module, precision):
        trainer = quiet_trainer(max_epochs=1, devices=2, precision=precision, log_every_n_steps=99)
        trainer.fit(module, loader(x, y, 16))
        return trainer

    start = init_mlp()
    half = fit(_Manual(lr=1e-3, init_variables=start), "16-mixed")
    full = fit(_Manual(lr=1e-3, init_variables=start), "32-true")
    scale = half.state.opt_state.scale
    assert half.global_step == full.global_step == 16
    assert float(scale) <= 2.0**16  # the first steps overflow at 2**16, as GradScaler's do
    assert max_abs_diff(half.state.params, full.state.params) < 2e-2
    assert max_abs_diff(half.state.params, start["params"]) > 1e-3

    large = _Manual(lr=1e-3, init_variables=start)
    large.factor = 1000.0
    trainer = fit(large, "16-mixed")
    skipped = int(trainer.callback_metrics["train/skipped_updates"])
    assert skipped >= 1
    assert float(trainer.state.opt_state.scale) == 2.0**16 / 2**skipped
    assert np.isfinite(trainer.callback_metrics["train/step_loss"])
