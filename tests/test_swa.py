"""`StochasticWeightAveraging` against Lightning's schedule computed by hand:
the rate of each SWA epoch, the average of the parameters at the start of each
SWA epoch, BatchNorm statistics recomputed as torch's ``update_bn`` does, and
bit-exact resume."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxlightning as jl
from jaxlightning.callbacks.swa import base_learning_rate
from tests.helpers import MLP, LitMLP, digits, init_mlp, loader, max_abs_diff, quiet_trainer

EPOCHS, LR, SWA_LR = 5, 0.4, 0.05
X, Y = digits(96)  # three batches of 32 an epoch


def sgd_module(lr=LR):
    module = LitMLP(init_variables=init_mlp(), lr=lr)
    module.configure_optimizers = lambda: optax.sgd(lr if callable(lr) else lr)
    return module


def swa(**kw):
    kw = {"swa_lrs": SWA_LR, "swa_epoch_start": 2, "annealing_epochs": 2, **kw}
    return jl.callbacks.StochasticWeightAveraging(**kw)


def lightning_rates(lr0, start, anneal, strategy="cos"):
    """The rate of each epoch from SWA's start on, as torch's SWALR gives it."""
    rates = {}
    for epoch in range(start, EPOCHS):
        k = epoch - start
        t = 1.0 if anneal == 0 else min(1.0, k / max(1, anneal))
        a = (1 - math.cos(math.pi * t)) / 2 if strategy == "cos" else t
        rates[epoch] = SWA_LR * a + lr0 * (1 - a)
    return rates


def by_hand(lr_of_step, start, anneal, strategy="cos"):
    """The hand-written loop: full-batch-mean SGD on the same batches, the
    schedule replaced from ``start`` on, the parameters averaged at the start
    of each SWA epoch."""
    params = jax.tree.map(np.asarray, init_mlp()["params"])

    @jax.jit
    def grad(params, x, y):
        def loss(p):
            logits = MLP().apply({"params": p}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        return jax.grad(loss)(params)

    step, average, n = 0, None, 0
    rates = None
    for epoch in range(EPOCHS):
        if epoch == start:
            rates = lightning_rates(float(lr_of_step(step)), start, anneal, strategy)
        if epoch >= start:
            if n == 0:
                average = params
            else:
                average = jax.tree.map(lambda a, p, n=n: a + (p - a) / (n + 1), average, params)
            n += 1
        for b in range(3):
            g = grad(params, X[32 * b : 32 * b + 32], Y[32 * b : 32 * b + 32])
            rate = rates[epoch] if epoch >= start else float(lr_of_step(step))
            params = jax.tree.map(lambda p, g, r=rate: p - r * g, params, g)
            step += 1
    return params, average, n


def fit(callbacks, module=None, **kw):
    module = module or sgd_module()
    kw.setdefault("max_epochs", EPOCHS)
    trainer = quiet_trainer(devices=2, callbacks=callbacks, **kw)
    trainer.fit(module, loader(X, Y, 32))
    return module, trainer


@pytest.fixture(scope="module")
def cos_run():
    callback = swa()
    module, trainer = fit([callback])
    return callback, module, trainer


def test_the_average_and_the_rates_are_lightnings(cos_run):
    callback, module, trainer = cos_run
    last, average, n = by_hand(lambda s: LR, start=1, anneal=2)
    assert callback.swa_start == 1 and callback.swa_end == EPOCHS - 1
    assert callback.n_averaged == n == 4
    assert max_abs_diff(module.variables["params"], average) < 2e-6
    assert max_abs_diff(module.variables["params"], last) > 1e-3  # not the last parameters
    assert max_abs_diff(trainer.state.params, average) < 2e-6  # the state holds it too


@pytest.mark.parametrize(
    ("kw", "start", "anneal", "strategy"),
    [
        ({"annealing_epochs": 0, "annealing_strategy": "linear"}, 1, 0, "linear"),
        ({"swa_epoch_start": 0.6, "annealing_strategy": "linear"}, 2, 2, "linear"),
    ],
)
def test_linear_and_immediate_annealing_and_a_fractional_start(kw, start, anneal, strategy):
    callback = swa(**kw)
    module, _ = fit([callback])
    _, average, n = by_hand(lambda s: LR, start=start, anneal=anneal, strategy=strategy)
    assert callback.swa_start == start and callback.n_averaged == n
    assert max_abs_diff(module.variables["params"], average) < 2e-6


def test_a_schedule_stops_at_swa_start_and_lr0_is_its_value_there():
    schedule = optax.exponential_decay(LR, transition_steps=1, decay_rate=0.9)
    module = sgd_module(schedule)
    callback = swa()
    fit([callback], module=module)
    _, average, _ = by_hand(schedule, start=1, anneal=2)
    assert max_abs_diff(module.variables["params"], average) < 2e-6
    assert base_learning_rate(optax.sgd(schedule)) is schedule


def test_the_rate_is_found_in_aliases_and_refused_when_ambiguous():
    assert float(base_learning_rate(optax.adamw(3e-4))(jnp.int32(7))) == pytest.approx(3e-4)
    injected = optax.inject_hyperparams(optax.adam)(learning_rate=2e-3)
    assert float(base_learning_rate(injected)(jnp.int32(0))) == pytest.approx(2e-3)
    two = optax.multi_transform({"a": optax.sgd(0.1), "b": optax.sgd(0.2)}, {"w": "a", "v": "b"})
    assert base_learning_rate(two) is None
    module = sgd_module()
    module.configure_optimizers = lambda: two
    with pytest.raises(ValueError, match="could not find exactly one"):
        quiet_trainer(max_epochs=2, callbacks=[swa()]).fit(module, loader(X, Y, 32))


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="swa_lrs"):
        jl.callbacks.StochasticWeightAveraging(swa_lrs=-1.0)
    with pytest.raises(ValueError, match="one rate per parameter group"):
        jl.callbacks.StochasticWeightAveraging(swa_lrs=[0.1, 0.2])
    with pytest.raises(ValueError, match="swa_epoch_start"):
        jl.callbacks.StochasticWeightAveraging(swa_lrs=0.1, swa_epoch_start=1.5)
    with pytest.raises(ValueError, match="annealing_strategy"):
        jl.callbacks.StochasticWeightAveraging(swa_lrs=0.1, annealing_strategy="step")


def test_resume_mid_swa_is_bitwise(tmp_path, cos_run):
    _, whole, _ = cos_run
    first = sgd_module()
    checkpoint = jl.ModelCheckpoint(dirpath=str(tmp_path), save_top_k=-1, every_n_epochs=1)
    trainer = quiet_trainer(max_epochs=3, devices=2, callbacks=[swa(), checkpoint])
    trainer.fit(first, loader(X, Y, 32))  # stops inside SWA (its schedule is max_epochs=5's)
    resumed = sgd_module()
    trainer = quiet_trainer(max_epochs=EPOCHS, devices=2, callbacks=[swa()])
    trainer.fit(resumed, loader(X, Y, 32), ckpt_path=checkpoint.last_model_path)
    leaves = zip(jax.tree.leaves(resumed.variables), jax.tree.leaves(whole.variables), strict=True)
    assert all(np.array_equal(a, b) for a, b in leaves)


# ---------------------------------------------------------------- BatchNorm
class BnNet(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        x = nn.Dense(16)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.Dense(10)(nn.relu(x))


class BnModule(jl.JaxModule):
    def __init__(self):
        super().__init__()
        self.net = BnNet()

    def setup(self, rng, batch):
        return self.net.init(jax.random.key(1), batch[0], train=False)

    def configure_optimizers(self):
        return optax.sgd(0.2)

    def loss(self, variables, batch, rngs):
        x, y = batch
        logits, updates = self.net.apply(variables, x, train=True, mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, y), updates


class LastRunning(jl.Callback):
    """The running statistics as training left them."""

    def on_train_epoch_end(self, trainer, module):
        self.stats = jax.device_get(trainer.state.model_state["batch_stats"])


def test_batch_norm_statistics_are_recomputed_for_the_average():
    module = BnModule()
    running = LastRunning()
    fit([swa(), running], module=module)
    params = module.variables["params"]
    # torch's update_bn: the mean over the epoch's batches of each batch's
    # mean and (biased, as flax's) variance of the BatchNorm's input. Without
    # a synchronized BatchNorm each device normalizes its own 16 rows, and its
    # statistics are averaged across the devices, as in the train step.
    means, variances = [], []
    for rows in np.split(X, 6):  # 3 batches x 2 devices
        h = rows @ params["Dense_0"]["kernel"] + params["Dense_0"]["bias"]
        means.append(h.mean(0))
        variances.append(h.var(0))
    stats = module.variables["batch_stats"]["BatchNorm_0"]
    np.testing.assert_allclose(stats["mean"], np.mean(means, 0), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(stats["var"], np.mean(variances, 0), rtol=1e-4, atol=1e-5)
    assert max_abs_diff(stats, running.stats["BatchNorm_0"]) > 1e-3  # they were replaced


def test_the_swa_epochs_recompile_nothing(compiles):
    fit([swa()])
    assert compiles.matching("train_step") == 1


def test_no_epoch_limit_averages_until_the_fit_ends(cos_run):
    """max_epochs=-1 (Lightning accepts it): SWA runs from its start to the fit's
    end, here max_steps at the same epoch's end, so the result is the bounded run's."""
    callback, bounded, _ = cos_run
    unbounded = swa()
    module, trainer = fit([unbounded], max_epochs=-1, max_steps=EPOCHS * 3)
    assert trainer.max_epochs == -1 and unbounded.swa_end == math.inf
    assert unbounded.n_averaged == callback.n_averaged == 4
    assert max_abs_diff(module.variables["params"], bounded.variables["params"]) == 0
    with pytest.raises(ValueError, match=r"swa_epoch_start=0.5\) is a share of max_epochs"):
        fit([swa(swa_epoch_start=0.5)], max_epochs=-1, max_steps=3)
