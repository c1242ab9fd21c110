"""Synchronized BatchNorm: user code may use the Trainer's device axis, `jl.AXIS`."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxlightning as jl
from tests.helpers import digits, loader, max_abs_diff, quiet_trainer


class BNNet(nn.Module):
    axis_name: str | None

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(16)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.8, axis_name=self.axis_name)(x)
        return nn.Dense(10)(nn.relu(x))


class LitBN(jl.JaxModule):
    def __init__(self, sync: bool, init_variables):
        super().__init__()
        self.net = BNNet(jl.AXIS if sync else None)
        self.init_variables = init_variables

    def setup(self, rng, batch):
        return self.init_variables

    def configure_optimizers(self):
        return optax.sgd(0.3)

    def loss(self, variables, batch, rngs):
        x, y = batch
        logits, updates = self.net.apply(variables, x, train=True, mutable=["batch_stats"])
        self.log("device", jax.lax.axis_index(jl.AXIS))  # the axis is bound in every trace
        return optax.softmax_cross_entropy_with_integer_labels(logits, y), updates

    def eval_step(self, variables, batch):
        x, y = batch
        self.log("acc", self.net.apply(variables, x).argmax(-1) == y)


@pytest.fixture(scope="module")
def runs():
    x, y = digits(256)
    init = BNNet(None).init(jax.random.PRNGKey(0), jnp.zeros((1, 64)))

    def fit(sync, devices):
        module = LitBN(sync, init)
        trainer = quiet_trainer(max_steps=6, devices=devices)
        trainer.fit(module, loader(x, y, 64), loader(*digits(64, 1000), 64))
        return module.variables, trainer

    return {(sync, n): fit(sync, n) for sync in (True, False) for n in (1, 8)}


def test_sync_batchnorm_on_8_devices_equals_one_device(runs):
    eight, one = runs[(True, 8)][0], runs[(True, 1)][0]
    assert max_abs_diff(eight["params"], one["params"]) < 1e-5
    assert max_abs_diff(eight["batch_stats"], one["batch_stats"]) < 1e-5


def test_per_device_batchnorm_differs_so_the_comparison_can_fail(runs):
    eight, one = runs[(False, 8)][0], runs[(False, 1)][0]
    assert max_abs_diff(eight["batch_stats"], one["batch_stats"]) > 1e-3


def test_hooks_see_the_device_axis(runs):
    trainer = runs[(True, 8)][1]
    assert trainer.callback_metrics["train/device"] == pytest.approx(np.mean(np.arange(8)))
