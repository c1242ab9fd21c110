"""Inside the step: gradient clipping and the logged gradient norm, against optax
applied by hand to the averaged gradient."""

import jax
import numpy as np
import optax
import pytest

import jaxlightning as jl
from tests.helpers import MLP, LitMLP, digits, init_mlp, loader, max_abs_diff, quiet_trainer


class Sgd(LitMLP):
    def __init__(self, transform=None, **kw):
        super().__init__(init_variables=init_mlp(), **kw)
        self.transform = transform

    def configure_optimizers(self):
        sgd = optax.sgd(0.5)
        return sgd if self.transform is None else optax.chain(self.transform, sgd)


def _fit(module, devices=8, **trainer_kw):
    x, y = digits(100)  # an uneven last batch: 32, 32, 32, 4
    trainer = quiet_trainer(max_epochs=2, devices=devices, log_every_n_steps=1, **trainer_kw)
    trainer.fit(module, loader(x, y, 32))
    return module.variables, trainer


@pytest.mark.parametrize(
    ("algorithm", "by_hand"),
    [("norm", optax.clip_by_global_norm(0.05)), ("value", optax.clip(0.002))],
)
def test_clipping_equals_optax_on_the_averaged_gradient(algorithm, by_hand):
    clip_val = 0.05 if algorithm == "norm" else 0.002
    clipped, _ = _fit(Sgd(), gradient_clip_val=clip_val, gradient_clip_algorithm=algorithm)
    expected, _ = _fit(Sgd(by_hand), devices=1)
    unclipped, _ = _fit(Sgd(), devices=1)
    assert max_abs_diff(clipped, expected) < 1e-6
    assert max_abs_diff(clipped, unclipped) > 1e-3  # the clip did bite


def test_grad_norm_is_the_norm_of_the_full_batch_gradient():
    x, y = digits(32)
    variables = init_mlp()

    def mean_loss(params):
        logits = MLP().apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    grads = jax.grad(mean_loss)(variables["params"])
    expected = float(np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree.leaves(grads))))
    trainer = quiet_trainer(max_steps=1, log_grad_norm=True, gradient_clip_val=1e-3)
    trainer.fit(Sgd(), loader(x, y, 32))
    # logged before clipping
    assert trainer.callback_metrics["train/grad_norm"] == pytest.approx(expected, rel=1e-5)
    assert expected > 1e-3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gradient_clip_val": -1.0}, r"gradient_clip_val=-1.0: use a positive number"),
        ({"gradient_clip_algorithm": "l2"}, r"gradient_clip_algorithm='l2': use 'norm'"),
    ],
)
def test_bad_clipping_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        quiet_trainer(**kwargs)


def test_clipping_applies_to_each_manual_optimization_step():
    from tests.test_gan import LitGAN, gan_loader

    free, clipped = LitGAN(), LitGAN()
    quiet_trainer(max_steps=2).fit(free, gan_loader())
    quiet_trainer(max_steps=2, gradient_clip_val=1e-4).fit(clipped, gan_loader())
    start = LitGAN().setup(None, None)["params"]
    moved = max_abs_diff(clipped.variables["params"], start)
    assert 0 < moved < max_abs_diff(free.variables["params"], start)
    assert np.isfinite(moved)


def test_accumulating_4_batches_of_32_equals_batches_of_128_on_8_devices(tmp_path):
    x, y = digits(200)  # 7 batches of 32 (the last of 8): updates after 4, then after 3

    class Steps(jl.Callback):
        def __init__(self):
            self.seen = []

        def on_train_batch_end(self, trainer, module, batch_idx):
            self.seen.append(trainer.global_step)

    def fit(batch, **kw):
        module = LitMLP(init_variables=init_mlp(), lr=3e-3)
        trainer = quiet_trainer(max_epochs=2, log_every_n_steps=1, **kw)
        trainer.fit(module, loader(x, y, batch))
        return module.variables, trainer

    steps = Steps()
    accumulated, trainer = fit(
        32,
        accumulate_grad_batches=4,
        default_root_dir=tmp_path,
        enable_checkpointing=True,
        callbacks=[steps, jl.ModelCheckpoint()],
    )
    whole, reference = fit(128)
    assert max_abs_diff(accumulated, whole) < 1e-5
    assert trainer.global_step == reference.global_step == 4  # optimizer updates
    # Lightning steps the optimizer on the epoch's last batch with the partial
    # window (training_epoch_loop._should_accumulate: "Lightning steps on the
    # final batch"): that batch's hooks already see the update.
    assert steps.seen == [0, 0, 0, 1, 1, 1, 2] + [2, 2, 2, 3, 3, 3, 4]
    assert max_abs_diff(trainer.state.opt_state, reference.state.opt_state) < 1e-5
    from jaxlightning.io.checkpoint import complete_checkpoints, read_meta

    meta = read_meta(complete_checkpoints(tmp_path / "checkpoints")[-1])
    assert meta["progress"] == {
        "epoch": 2,
        "batch": 0,
        "global_step": 4,
        "total_batches": 14,  # batches trained (val_check_interval counts batches)
        "validated": False,
        "batching": {"processes": 1, "batch_size": 32},
    }


def test_accumulation_resumes_bit_exactly(tmp_path):
    x, y = digits(200)
    ckpt = jl.ModelCheckpoint(every_n_train_steps=1)  # saves after each update

    class StopAfterBatch(jl.Callback):  # stop 2 micro-batches into the second update
        def on_train_batch_end(self, trainer, module, batch_idx):
            if batch_idx == 4:
                trainer.should_stop = True

    def fit(max_epochs, callbacks, ckpt_path=None):
        module = LitMLP(init_variables=init_mlp(), lr=3e-3, dropout=0.2)
        trainer = quiet_trainer(
            max_epochs=max_epochs,
            accumulate_grad_batches=3,
            default_root_dir=tmp_path,
            callbacks=callbacks,
        )
        trainer.fit(module, loader(x, y, 32, shuffle=True), ckpt_path=ckpt_path)
        return module.variables, trainer

    straight, _ = fit(2, [])
    # Checkpoints are per update: the last one is after batch 3, with nothing pending;
    # the resumed run redoes batches 4 and 5 of that accumulation.
    fit(2, [ckpt, StopAfterBatch()])
    resumed, trainer = fit(2, [], ckpt_path="last")
    assert max_abs_diff(straight, resumed) == 0.0
    assert trainer.global_step == 6  # ceil(7 / 3) = 3 updates per epoch


def test_bf16_mixed_trains_digits_within_a_point_of_float32_with_float32_state():
    x, y = digits(1500)
    vx, vy = digits(297, 1500)

    def fit(precision):
        module = LitMLP(hidden=64, lr=1e-2, init_variables=init_mlp(64))
        trainer = quiet_trainer(max_epochs=10, precision=precision)
        trainer.fit(module, loader(x, y, 128, shuffle=True))
        (result,) = trainer.validate(module, loader(vx, vy, 128))
        return result["val/acc"], trainer.state

    acc32, _ = fit("32-true")
    acc16, state = fit("bf16-mixed")
    assert acc32 > 0.9 and abs(acc16 - acc32) <= 0.01
    for leaf in jax.tree.leaves((state.params, state.opt_state)):
        assert leaf.dtype in (np.float32, np.int32), leaf.dtype


def test_bf16_true_keeps_parameters_in_bfloat16_and_other_settings_are_named():
    import jax.numpy as jnp

    trainer = quiet_trainer(max_steps=2, precision="bf16-true")
    trainer.fit(LitMLP(), loader(*digits(32), 16))
    assert {leaf.dtype for leaf in jax.tree.leaves(trainer.state.params)} == {
        jnp.dtype(jnp.bfloat16)
    }
    with pytest.raises(ValueError, match="float16 parameters lose small updates"):
        quiet_trainer(precision="16-true")
    with pytest.raises(ValueError, match="64-true' needs 64-bit JAX"):
        quiet_trainer(precision="64-true")
    with pytest.raises(ValueError, match=r"precision='fp8': use one of"):
        quiet_trainer(precision="fp8")


def test_ema_is_the_average_of_the_parameter_trajectory_and_validates():
    from tests.helpers import np_logits

    decay = 0.8
    trajectory = []

    class Track(jl.Callback):
        def on_train_batch_end(self, trainer, module, batch_idx):
            trajectory.append(jax.device_get(trainer.state.params))

    x, y = digits(64)
    ema = jl.callbacks.EMA(decay, apply_at_end=True)
    module = LitMLP(init_variables=init_mlp(), lr=3e-2)
    trainer = quiet_trainer(max_epochs=2, callbacks=[ema, Track()], num_sanity_val_steps=0)
    trainer.fit(module, loader(x, y, 16), loader(x, y, 64))
    expected = jax.tree.map(np.asarray, init_mlp()["params"])
    for params in trajectory:  # 8 updates
        expected = jax.tree.map(lambda e, p: decay * e + (1 - decay) * p, expected, params)
    assert max_abs_diff(ema.ema_variables["params"], expected) < 1e-6
    assert max_abs_diff(trainer.state.params, expected) > 1e-3  # not the raw parameters
    assert module.variables is ema.ema_variables
    acc = (np_logits(expected, x).argmax(-1) == y).mean()
    assert trainer.callback_metrics["val/acc"] == pytest.approx(acc)  # validated with the EMA


class Plateau(LitMLP):
    """SGD scaled down by optax's plateau rule, which reads the loss (value=)."""

    def __init__(self):
        super().__init__(init_variables=init_mlp())

    def configure_optimizers(self):
        return plateau_tx()


class ManualPlateau(jl.JaxModule):
    """The same, optimized manually: `optimizers.step` passes its loss too."""

    def __init__(self):
        super().__init__()
        self.net = MLP()

    def setup(self, rng, batch):
        return init_mlp()

    def configure_optimizers(self):
        return plateau_tx()

    def training_step(self, optimizers, batch, rngs):
        x, y = batch

        def loss(params):
            logits = self.net.apply({"params": params}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y)

        optimizers.step(loss)


def plateau_tx():
    return optax.chain(
        optax.sgd(3.0), optax.contrib.reduce_on_plateau(patience=1, factor=0.5, cooldown=0)
    )


@pytest.mark.parametrize("module", [Plateau, ManualPlateau], ids=["automatic", "manual"])
def test_the_optimizer_gets_the_loss_as_value_like_optax_by_hand(module):
    """optax's reduce_on_plateau needs update(..., value=loss): the Trainer passes
    the global batch's mean loss, as a hand-written optax loop does."""
    trained, trainer = _fit(module(), devices=4)
    x, y = digits(100)
    net, tx = MLP(), plateau_tx()
    params = init_mlp()["params"]
    state = tx.init(params)

    def mean_loss(p, xb, yb):
        logits = net.apply({"params": p}, xb)
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    for _ in range(2):
        for i in range(0, 100, 32):
            xb, yb = x[i : i + 32], y[i : i + 32]
            value, grads = jax.value_and_grad(mean_loss)(params, xb, yb)
            updates, state = tx.update(grads, state, params, value=value)
            params = optax.apply_updates(params, updates)
    assert float(state[1].scale) < 1.0  # the plateau rule did bite
    trained_state = trainer.state.opt_state
    if isinstance(trained_state, dict):  # manual optimization: by group
        (trained_state,) = trained_state.values()
    assert float(trained_state[1].scale) == float(state[1].scale)
    assert max_abs_diff(trained["params"], params) < 1e-5


def test_an_optimizer_needing_the_loss_with_accumulation_is_named():
    with pytest.raises(TypeError, match="needs the loss .*accumulate_grad_batches=1"):
        _fit(Plateau(), devices=1, accumulate_grad_batches=2)
