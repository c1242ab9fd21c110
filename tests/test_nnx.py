"""Flax NNX models: trained like linen ones, 1 = 8 devices, bit-exact resume."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxlightning as jl
from tests.helpers import LitMLP, digits, loader, max_abs_diff, quiet_trainer


class NNXNet(nnx.Module):
    def __init__(self, rngs, *, dropout=0.0, batch_norm=False):
        self.dense1 = nnx.Linear(64, 32, rngs=rngs)
        self.norm = nnx.BatchNorm(32, axis_name=jl.AXIS, rngs=rngs) if batch_norm else None
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.dense2 = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        x = self.dense1(x)
        if self.norm is not None:
            x = self.norm(x)
        return self.dense2(self.drop(nnx.relu(x)))


class LitNNX(jl.JaxModule):
    def __init__(self, lr=1e-2, sgd=False, **net):
        super().__init__()
        self.lr, self.sgd = lr, sgd
        self.model = NNXNet(nnx.Rngs(0, dropout=1), **net)  # built here: no setup()

    def configure_optimizers(self):
        # Adam would turn the round-off in the zero gradient of a bias before
        # BatchNorm into full-size steps; SGD keeps device counts comparable.
        return optax.sgd(self.lr * 10) if self.sgd else optax.adam(self.lr)

    def loss(self, model, batch):
        x, y = batch
        logits = model(x)
        self.log("acc", logits.argmax(-1) == y)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y)

    def eval_step(self, model, batch):
        x, y = batch
        self.log("acc", model(x).argmax(-1) == y)

    def predict_step(self, model, batch):
        return {"logits": model(batch[0])}


@pytest.mark.slow  # an accuracy sweep; NNX fits stay fast (dropout, resume)
def test_nnx_mlp_learns_digits_like_the_linen_mlp():
    x, y = digits(1500)
    vx, vy = digits(297, 1500)
    accuracies = []
    for module in (LitNNX(), LitMLP(hidden=32, lr=1e-2)):  # one hidden layer vs two
        trainer = quiet_trainer(max_epochs=12)
        trainer.fit(module, loader(x, y, 128, shuffle=True))
        accuracies.append(trainer.validate(module, loader(vx, vy, 128))[0]["val/acc"])
    nnx_acc, linen_acc = accuracies
    assert nnx_acc > 0.85 and nnx_acc > linen_acc - 0.03, (nnx_acc, linen_acc)


def test_trained_arrays_are_in_the_users_model_and_predict_uses_them():
    x, y = digits(64)
    module = LitNNX()
    before = jax.device_get(nnx.to_pure_dict(nnx.state(module.model, nnx.Param)))
    trainer = quiet_trainer(max_steps=4)
    trainer.fit(module, loader(x, y, 16))
    after = nnx.to_pure_dict(nnx.state(module.model, nnx.Param))
    assert max_abs_diff(after, module.variables["params"]) == 0.0
    assert max_abs_diff(after, before) > 1e-3
    out = trainer.predict(module, loader(x, y, 16), concatenate=True)
    np.testing.assert_allclose(out["logits"], np.asarray(module.model(x)), atol=1e-5)


def test_nnx_batchnorm_synced_on_8_devices_equals_1_device():
    x, y = digits(200)  # an uneven last batch

    def fit(devices):
        module = LitNNX(lr=5e-3, batch_norm=True, sgd=True)
        quiet_trainer(max_epochs=2, devices=devices).fit(module, loader(x, y, 32))
        return module.variables

    eight, one = fit(8), fit(1)
    assert max_abs_diff(eight["params"], one["params"]) < 1e-5
    assert max_abs_diff(eight["nnx"], one["nnx"]) < 1e-5  # the batch statistics
    assert np.abs(np.asarray(eight["nnx"]["norm"]["mean"])).max() > 1e-3  # statistics moved


def test_nnx_dropout_differs_per_step_and_device_and_resumes_bit_exactly(tmp_path):
    x, y = digits(200)

    def fit(max_steps, ckpt_path=None, seed=0):
        module = LitNNX(dropout=0.3, batch_norm=True)
        trainer = quiet_trainer(
            max_steps=max_steps,
            seed=seed,
            default_root_dir=tmp_path,
            enable_checkpointing=True,
            callbacks=[jl.ModelCheckpoint(every_n_train_steps=5)],
        )
        trainer.fit(module, loader(x, y, 32, shuffle=True), ckpt_path=ckpt_path)
        return module.variables

    straight = fit(12)
    other_seed = fit(12, seed=1)
    assert max_abs_diff(straight, other_seed) > 1e-4  # the seed reaches the dropout keys
    fit(10)  # its checkpoint at step 10 is mid-epoch (7 steps per epoch)
    resumed = fit(12, ckpt_path=tmp_path / "checkpoints" / "10")
    assert max_abs_diff(straight, resumed) == 0.0


def test_an_nnx_loss_returning_updates_is_named():
    class Tuple(LitNNX):
        def loss(self, model, batch):
            return super().loss(model, batch), {}

    with pytest.raises(TypeError, match="NNX model's loss\\(\\) returns the loss only"):
        quiet_trainer(max_steps=1).fit(Tuple(), loader(*digits(16), 8))


class ShardedNet(nnx.Module):
    """Megatron-style annotations: hidden units split over the "model" axis."""

    def __init__(self, rngs):
        def split(*names):
            return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)

        self.up = nnx.Linear(64, 64, kernel_init=split(None, "model"), rngs=rngs)
        self.down = nnx.Linear(64, 10, kernel_init=split("model", None), rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.relu(self.up(x)))


class LitSharded(LitNNX):
    def __init__(self):
        jl.JaxModule.__init__(self)
        self.lr, self.sgd = 1e-2, False
        # flax 0.12 places annotated variables at construction unless told not
        # to; the strategy places them instead.
        with nnx.use_eager_sharding(False):
            self.model = ShardedNet(nnx.Rngs(0))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["tp", "fsdp"])
def test_nnx_models_under_sharded_strategies_equal_data_parallel(strategy):
    x, y = digits(300)
    chosen = jl.ModelParallelStrategy(model=2) if strategy == "tp" else jl.FSDPStrategy(min_size=64)
    sharded = quiet_trainer(max_steps=5, strategy=chosen)
    module = LitSharded()
    sharded.fit(module, loader(x, y, 48))
    plain = quiet_trainer(max_steps=5)
    plain.fit(LitSharded(), loader(x, y, 48))
    assert max_abs_diff(jax.device_get(sharded.state.params), plain.state.params) < 1e-5
    expected = P(None, "model") if strategy == "tp" else P("batch")
    assert sharded.state.params["up"]["kernel"].sharding.spec == expected
    kernel = module.model.up.kernel[...]  # the trained arrays, still laid out
    assert kernel.sharding.spec == expected
