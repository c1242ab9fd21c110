"""Several optimizers: a GAN's two updates in one compiled step (manual optimization),
and parameter groups under one loss."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import jaxlightning as jl
from tests.helpers import LitMLP, digits, init_mlp, loader, max_abs_diff, quiet_trainer

N, BATCH, NOISE = 100, 32, 4  # batches of 32, 32, 32 and 4 rows


class Generator(nn.Module):
    @nn.compact
    def __call__(self, z):
        return nn.Dense(6)(nn.tanh(nn.Dense(16)(z)))


class Discriminator(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.tanh(nn.Dense(16)(x)))[:, 0]


G, D = Generator(), Discriminator()


def d_loss(params, x, z):
    fake = G.apply({"params": params["generator"]}, z)
    real_logit = D.apply({"params": params["discriminator"]}, x)
    fake_logit = D.apply({"params": params["discriminator"]}, jax.lax.stop_gradient(fake))
    return jax.nn.softplus(-real_logit) + jax.nn.softplus(fake_logit)  # per example


def g_loss(params, z):
    fake = G.apply({"params": params["generator"]}, z)
    return jax.nn.softplus(-D.apply({"params": params["discriminator"]}, fake))


def initial_params():
    kg, kd = jax.random.split(jax.random.PRNGKey(0))
    return {
        "generator": G.init(kg, jnp.zeros((1, NOISE)))["params"],
        "discriminator": D.init(kd, jnp.zeros((1, 6)))["params"],
    }


def optimizers():
    return {"discriminator": optax.adam(1e-2), "generator": optax.adam(5e-3)}


class LitGAN(jl.JaxModule):
    def setup(self, rng, batch):
        return {"params": initial_params()}

    def configure_optimizers(self):
        return optimizers()

    def training_step(self, opt, batch, rngs):
        x, z = batch
        d = opt.step(lambda p: d_loss(p, x, z), "discriminator")
        g = opt.step(lambda p: g_loss(p, z), "generator")  # sees the updated discriminator
        self.log_dict({"d_loss": d, "g_loss": g}, prog_bar=True)


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(1.0, 0.5, (N, 6)).astype(np.float32)
    z = rng.normal(size=(N, NOISE)).astype(np.float32)  # the noise comes with the data
    return x, z


def gan_loader():
    x, z = data()
    return DataLoader(TensorDataset(torch.from_numpy(x), torch.from_numpy(z)), batch_size=BATCH)


def handwritten(epochs):
    """The two updates in sequence, one device, batches of real rows only."""
    x, z = data()
    params, txs = initial_params(), optimizers()
    states = {k: txs[k].init(params[k]) for k in txs}

    def update(params, states, group, loss_fn):
        def objective(sub):
            return loss_fn({**params, group: sub}).mean()

        grads = jax.grad(objective)(params[group])
        deltas, states[group] = txs[group].update(grads, states[group], params[group])
        return {**params, group: optax.apply_updates(params[group], deltas)}

    for _ in range(epochs):
        for i in range(0, N, BATCH):
            xb, zb = x[i : i + BATCH], z[i : i + BATCH]
            params = update(
                params, states, "discriminator", lambda p, xb=xb, zb=zb: d_loss(p, xb, zb)
            )
            params = update(params, states, "generator", lambda p, zb=zb: g_loss(p, zb))
    return params


@pytest.fixture(scope="module")
def fits():
    out = {}
    for n in (1, 8):
        module = LitGAN()
        trainer = quiet_trainer(max_epochs=2, devices=n, log_every_n_steps=1)
        trainer.fit(module, gan_loader())
        out[n] = (module, trainer)
    return out


def test_gan_on_8_devices_equals_1_device(fits):
    assert max_abs_diff(fits[8][0].variables, fits[1][0].variables) < 1e-5
    assert max_abs_diff(fits[8][1].state.opt_state, fits[1][1].state.opt_state) < 1e-5


def test_gan_equals_a_handwritten_loop_of_the_two_updates(fits):
    expected = handwritten(epochs=2)
    assert max_abs_diff(fits[8][0].variables["params"], expected) < 1e-5
    assert max_abs_diff(expected, initial_params()) > 1e-2  # both networks trained


def test_gan_logs_both_losses_and_counts_one_step_per_batch(fits):
    trainer = fits[8][1]
    assert trainer.global_step == 8
    assert {"train/d_loss", "train/g_loss"} <= set(trainer.progress_bar_metrics)
    assert "train/loss" not in trainer.callback_metrics  # manual: the module logs its losses


def test_gan_step_compiles_once(compiles):
    compiles.reset()
    quiet_trainer(max_epochs=2).fit(LitGAN(), gan_loader())
    assert compiles.matching("jl_manual_train_step") == 1, compiles.counts


def test_parameter_groups_under_one_loss_use_their_own_optimizers():
    class TwoRates(LitMLP):
        def configure_optimizers(self):
            rates = {"Dense_0": 0.0, "Dense_1": 0.5, "Dense_2": 0.5}
            return {name: optax.sgd(rate) for name, rate in rates.items()}

    x, y = digits(64)
    module = TwoRates(init_variables=init_mlp())
    quiet_trainer(max_steps=2).fit(module, loader(x, y, 32))
    params, start = module.variables["params"], init_mlp()["params"]
    assert max_abs_diff(params["Dense_0"], start["Dense_0"]) == 0.0  # learning rate 0
    assert max_abs_diff(params["Dense_1"], start["Dense_1"]) > 1e-3


def test_optimizer_keys_must_name_params_entries():
    class Wrong(LitGAN):
        def configure_optimizers(self):
            return {"disc": optax.adam(1e-3), "generator": optax.adam(1e-3)}

    with pytest.raises(ValueError, match=r"each key must name a top-level entry"):
        quiet_trainer(max_steps=1).fit(Wrong(), gan_loader())


def test_a_training_step_that_takes_no_step_is_named():
    class Idle(LitGAN):
        def training_step(self, opt, batch, rngs):
            self.log("nothing", 0.0)

    with pytest.raises(ValueError, match=r"called no optimizers.step"):
        quiet_trainer(max_steps=1).fit(Idle(), gan_loader())


def test_a_training_step_may_log_train_loss_as_its_own_step_value():
    # manual optimization logs its losses itself; "train/loss" is the module's
    # name there and reports the logging step's own value (Lightning's rule)
    class Logs(LitGAN):
        def training_step(self, opt, batch, rngs):
            super().training_step(opt, batch, rngs)
            self.log("train/loss", self.global_step * 1.0)

    trainer = quiet_trainer(max_steps=4, log_every_n_steps=4, stage_prefix=False)
    trainer.fit(Logs(), gan_loader())
    assert trainer.callback_metrics["train/loss"] == 3.0  # step 4's (0-based 3), not the mean
