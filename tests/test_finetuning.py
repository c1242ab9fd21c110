"""`BaseFinetuning` / `BackboneFinetuning` against a hand-written loop doing
what torch does: the head's Adam from the first step, the backbone's Adam
created (fresh moments, count 0) when its parameter group is added, its rate
set per Lightning's schedule at each epoch's start; frozen parameters bitwise
unchanged; no recompile; bitwise resume."""

from __future__ import annotations

import logging

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import jaxlightning as jl
from jaxlightning.callbacks.finetuning import (
    BackboneFinetuning,
    BaseFinetuning,
    FinetuneGate,
)
from jaxlightning.callbacks.swa import base_learning_rate
from tests.helpers import digits, loader, max_abs_diff, quiet_trainer

LR, EPOCHS, BATCH = 1e-2, 5, 8
X, Y = digits(48)  # six batches of 8 an epoch


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(16, name="backbone")(x))
        return nn.Dense(10, name="head")(h)


INIT = jax.device_get(Net().init(jax.random.PRNGKey(0), X[:1]))


class Finetuned(jl.JaxModule):
    def __init__(self, tx=None):
        super().__init__()
        self.net, self.tx = Net(), tx

    def setup(self, rng, batch):
        return INIT

    def configure_optimizers(self):
        return self.tx if self.tx is not None else optax.adam(LR)

    def loss(self, variables, batch, rngs):
        x, y = batch
        return optax.softmax_cross_entropy_with_integer_labels(self.net.apply(variables, x), y)


def backbone_rates(unfreeze, epochs, factor, lr_at=lambda step: LR, ratio=0.1):
    """Lightning's BackboneFinetuning schedule: {epoch: backbone rate}."""
    per_epoch = len(X) // BATCH
    rates, previous = {}, None
    for epoch in range(unfreeze, epochs):
        current = lr_at(epoch * per_epoch)
        if epoch == unfreeze:
            previous = current * ratio
        else:
            previous = min(factor * previous, current)  # should_align
        rates[epoch] = previous
    return rates


def by_hand(rates, epochs, head_lr=LR, head_from=0):
    """Plain optax: two Adam states; the backbone's is created at its first
    epoch in ``rates`` and updated at that epoch's rate; before it the
    backbone does not move."""
    params = INIT["params"]
    head_tx = optax.adam(head_lr)
    head_state, backbone_state = None, None

    @jax.jit
    def grad(p, x, y):
        def loss(p):
            logits = Net().apply({"params": p}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        return jax.grad(loss)(p)

    for epoch in range(epochs):
        if epoch == head_from:
            head_state = head_tx.init(params["head"])
        if epoch in rates and backbone_state is None:
            backbone_state = optax.adam(1.0).init(params["backbone"])
        for b in range(len(X) // BATCH):
            g = grad(params, X[b * BATCH : (b + 1) * BATCH], Y[b * BATCH : (b + 1) * BATCH])
            new = dict(params)
            if head_state is not None:
                up, head_state = head_tx.update(g["head"], head_state, params["head"])
                new["head"] = optax.apply_updates(params["head"], up)
            if backbone_state is not None:
                up, backbone_state = optax.adam(rates[epoch]).update(g["backbone"], backbone_state)
                new["backbone"] = optax.apply_updates(params["backbone"], up)
            params = new
    return params


def fit(callbacks, module=None, epochs=EPOCHS, **kw):
    module = module or Finetuned()
    trainer = quiet_trainer(max_epochs=epochs, devices=2, callbacks=callbacks, **kw)
    trainer.fit(module, loader(X, Y, BATCH))
    return trainer, module


class Backbones(jl.Callback):
    """The backbone's parameters at the end of every epoch."""

    def __init__(self):
        self.seen = []

    def on_train_epoch_end(self, trainer, module):
        self.seen.append(jax.device_get(trainer.state.params["backbone"]))


# ------------------------------------------------------ against the hand loop
def test_backbone_finetuning_is_a_second_adam_started_at_the_unfreeze_epoch():
    callback = BackboneFinetuning(unfreeze_backbone_at_epoch=2, lambda_func=lambda e: 1.5)
    _, module = fit([callback])
    rates = backbone_rates(2, EPOCHS, 1.5)
    assert list(rates.values()) == pytest.approx([1e-3, 1.5e-3, 2.25e-3])  # below LR
    assert max_abs_diff(module.variables["params"], by_hand(rates, EPOCHS)) < 1e-6
    assert callback.previous_backbone_lr == pytest.approx(rates[EPOCHS - 1])
    # the backbone moved, and not as it would have with the head's rate throughout
    assert max_abs_diff(module.variables["params"]["backbone"], INIT["params"]["backbone"]) > 1e-3
    everything = by_hand(dict.fromkeys(range(EPOCHS), LR), EPOCHS)
    assert max_abs_diff(module.variables["params"], everything) > 1e-3


def test_should_align_caps_the_rate_and_verbose_logs_both_rates(compiles):
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("jaxlightning").addHandler(handler)
    try:
        callback = BackboneFinetuning(1, lambda_func=lambda e: 4.0, verbose=True, rounding=6)
        _, module = fit([callback], epochs=4)
    finally:
        logging.getLogger("jaxlightning").removeHandler(handler)
    rates = backbone_rates(1, 4, 4.0)
    assert list(rates.values()) == pytest.approx([1e-3, 4e-3, LR])  # 1.6e-2 capped at LR
    assert max_abs_diff(module.variables["params"], by_hand(rates, 4)) < 1e-6
    assert [m for m in messages if m.startswith("Current lr")] == [
        "Current lr: 0.01, Backbone lr: 0.001",
        "Current lr: 0.01, Backbone lr: 0.004",
        "Current lr: 0.01, Backbone lr: 0.01",
    ]
    # unfreezing and three rate changes: written into the state, no recompile
    assert compiles.matching("train_step") == 1


def test_under_a_schedule_the_backbone_keeps_the_rate_it_was_set_to():
    # The head follows the schedule by the global step; the backbone's Adam is
    # fresh at the unfreeze epoch yet trains at the constant rates Lightning
    # sets (not at the schedule counted from its own first step).
    schedule = optax.exponential_decay(LR, transition_steps=1, decay_rate=0.9)
    callback = BackboneFinetuning(2, lambda_func=lambda e: 10.0)
    _, module = fit([callback], module=Finetuned(optax.adam(schedule)), epochs=4)
    rates = backbone_rates(2, 4, 10.0, lr_at=lambda s: float(np.float32(schedule(s))))
    assert rates[3] == pytest.approx(float(schedule(18)))  # capped at the decayed rate
    assert max_abs_diff(module.variables["params"], by_hand(rates, 4, head_lr=schedule)) < 1e-6


class TwoGroups(BaseFinetuning):
    """Both layers frozen; the head opens at epoch 1 at the optimizer's own
    rate, the backbone at epoch 2 at that rate / initial_denom_lr, then 1.5x."""

    def freeze_before_training(self, module):
        self.freeze(["backbone", "head"])

    def finetune_function(self, trainer, module, epoch):
        if epoch == 1:
            self.make_trainable(trainer, "head")
        if epoch == 2:
            self.rate = self.unfreeze_and_add_param_group(trainer, "backbone")
        if epoch == 3:
            self.set_group_lr(trainer, "backbone", 1.5 * self.rate)


def test_a_base_finetuning_subclass_with_two_groups():
    callback = TwoGroups()
    _, module = fit([callback], epochs=4)
    assert callback.rate == pytest.approx(LR / 10)
    expected = by_hand({2: LR / 10, 3: 1.5 * LR / 10}, 4, head_from=1)
    assert max_abs_diff(module.variables["params"], expected) < 1e-6


def test_an_optimizer_without_one_rate_still_unfreezes_at_its_own_rate_over_the_denominator():
    # A dict from configure_optimizers: one optimizer per group, no single rate.
    class Opens(BaseFinetuning):
        def freeze_before_training(self, module):
            self.freeze("backbone")

        def finetune_function(self, trainer, module, epoch):
            if epoch == 1:
                self.rate = self.unfreeze_and_add_param_group(trainer, "backbone")

    callback = Opens()
    tx = {"backbone": optax.sgd(0.5), "head": optax.sgd(0.2)}
    _, module = fit([callback], module=Finetuned(tx), epochs=2)
    assert callback.rate is None and callback.current_learning_rate(None) is None

    params = INIT["params"]
    grad = jax.jit(
        jax.grad(
            lambda p, x, y: optax.softmax_cross_entropy_with_integer_labels(
                Net().apply({"params": p}, x), y
            ).mean()
        )
    )
    for epoch in range(2):
        for b in range(len(X) // BATCH):
            g = grad(params, X[b * BATCH : (b + 1) * BATCH], Y[b * BATCH : (b + 1) * BATCH])
            rate = {"head": 0.2, "backbone": 0.05 if epoch == 1 else 0.0}
            params = {
                k: jax.tree.map(lambda p, g, r=rate[k]: p - r * g, params[k], g[k]) for k in params
            }
    assert max_abs_diff(module.variables["params"], params) < 1e-6


# ------------------------------------------------------------------ frozen
def test_a_frozen_group_is_bitwise_unchanged_even_under_weight_decay():
    seen = Backbones()
    tx = optax.adamw(LR, weight_decay=0.1)
    fit([BackboneFinetuning(2), seen], module=Finetuned(tx), epochs=3)
    for epoch in (0, 1):
        for name in ("kernel", "bias"):
            np.testing.assert_array_equal(seen.seen[epoch][name], INIT["params"]["backbone"][name])
    assert max_abs_diff(seen.seen[2], INIT["params"]["backbone"]) > 1e-4  # unfrozen at epoch 2


# ------------------------------------------------------------------ resume
@pytest.mark.parametrize("unfreeze", [2, 3])
def test_resume_across_the_unfreezing_is_bitwise(tmp_path, unfreeze):
    # unfreeze=2: the first run unfreezes, the resumed one goes on with the
    # restored gate, Adam state and previous_backbone_lr; unfreeze=3: the
    # resumed run unfreezes a group the checkpoint holds frozen.
    def callback():
        return BackboneFinetuning(unfreeze, lambda_func=lambda e: 1.5)

    whole_callback = callback()
    _, whole = fit([whole_callback])
    checkpoint = jl.ModelCheckpoint(dirpath=str(tmp_path), save_top_k=-1, every_n_epochs=1)
    fit([callback(), checkpoint], epochs=3)
    resumed, resumed_callback = Finetuned(), callback()
    trainer = quiet_trainer(max_epochs=EPOCHS, devices=2, callbacks=[resumed_callback])
    trainer.fit(resumed, loader(X, Y, BATCH), ckpt_path=checkpoint.last_model_path)
    leaves = zip(jax.tree.leaves(resumed.variables), jax.tree.leaves(whole.variables), strict=True)
    assert all(np.array_equal(a, b) for a, b in leaves)
    assert resumed_callback.previous_backbone_lr == whole_callback.previous_backbone_lr


# ------------------------------------------------------------------ pieces
def test_each_group_has_its_own_gate_type_and_the_rate_is_still_found():
    class Two(BaseFinetuning):
        pass

    callback = Two()
    callback.freeze(["backbone", "head"])
    kinds = callback.gate_type("backbone"), callback.gate_type("head")
    assert kinds[0] is not kinds[1] and all(issubclass(k, FinetuneGate) for k in kinds)
    assert callback.gate_type("backbone") is kinds[0]  # one type per group
    tx = callback.transform_optimizer(optax.adamw(3e-4))
    assert float(base_learning_rate(tx)(np.int32(0))) == pytest.approx(3e-4)  # for SWA after it
    state = tx.init(INIT["params"])
    gates = [
        n
        for n in jax.tree.leaves(state, is_leaf=lambda n: isinstance(n, FinetuneGate))
        if isinstance(n, FinetuneGate)
    ]
    assert sorted(type(g).__name__ for g in gates) == [
        "FinetuneGate[backbone]",
        "FinetuneGate[head]",
    ]
    with pytest.raises(NotImplementedError, match="freeze_before_training"):
        BaseFinetuning().freeze_before_training(None)


class Declares(BaseFinetuning):
    def __init__(self, groups=("backbone",), late=None, opens=None, lr=None):
        super().__init__()
        self.declared, self.late, self.opens, self.lr = groups, late, opens, lr

    def freeze_before_training(self, module):
        self.freeze(list(self.declared))

    def finetune_function(self, trainer, module, epoch):
        if self.late:
            self.freeze(self.late)
        if self.opens:
            self.unfreeze_and_add_param_group(trainer, self.opens, lr=self.lr)


def test_bad_groups_and_late_freezing_name_the_problem():
    with pytest.raises(ValueError, match=r"'encoder' matches no parameter.*\['backbone', 'head'\]"):
        fit([Declares(["encoder"])], epochs=1)
    with pytest.raises(ValueError, match="'backbone' and 'backbone/kernel' overlap"):
        fit([Declares(["backbone", "backbone/kernel"])], epochs=1)
    with pytest.raises(RuntimeError, match=r"freeze\('head'\) after fit started"):
        fit([Declares(late="head")], epochs=1)
    with pytest.raises(ValueError, match="'head' was not frozen before training"):
        fit([Declares(opens="head")], epochs=1)
    with pytest.raises(ValueError, match="path prefix"):
        Declares(["backbone/"]).freeze_before_training(None)


def test_rates_need_the_optimizers_rate_and_order_with_ema_is_checked():
    no_single_rate = {"backbone": optax.sgd(0.5), "head": optax.sgd(0.2)}
    with pytest.raises(ValueError, match=r"lr=0.01\) needs the optimizer's learning rate"):
        fit([Declares(opens="backbone", lr=0.01)], module=Finetuned(no_single_rate), epochs=1)
    with pytest.raises(ValueError, match="BackboneFinetuning sets the backbone's rate"):
        fit([BackboneFinetuning(0)], module=Finetuned(no_single_rate), epochs=1)
    with pytest.raises(ValueError, match="put BackboneFinetuning before EMA"):
        fit([jl.callbacks.EMA(0.9), BackboneFinetuning(0)], epochs=1)
    with pytest.raises(ValueError, match="unfreeze_backbone_at_epoch"):
        BackboneFinetuning(-1)
