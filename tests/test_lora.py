"""LoRA adapters (`jl.LoRA`) and starting from pretrained weights (the module's
``pretrained`` hook): the base frozen bitwise, the adapters' updates checked
against gradients computed by hand, checkpoints of adapters only."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxlightning as jl
from jaxlightning.adapters.lora import adapters_only
from jaxlightning.io import safetensors_format
from jaxlightning.io.checkpoint import restore
from tests.helpers import (
    MLP,
    LitMLP,
    assert_bitwise_equal,
    digits,
    init_mlp,
    loader,
    nnx_mlp_module,
    quiet_trainer,
)

TARGETS = r"Dense_[01]/kernel$"


class LoraMLP(LitMLP):
    def __init__(self, rank=4, alpha=8.0, lr=1e-2, sgd=False, **kwargs):
        super().__init__(lr=lr, init_variables=init_mlp(), **kwargs)
        self.lora = jl.LoRA(rank=rank, alpha=alpha, targets=TARGETS)
        self.sgd = sgd

    def configure_optimizers(self):
        return optax.sgd(self.hparams.lr) if self.sgd else optax.adam(self.hparams.lr)


def digits_loader(n=64, batch_size=32):
    x, y = digits(n)
    return loader(x, y, batch_size)


def test_the_model_sees_its_base_plus_the_scaled_low_rank_product():
    lora = jl.LoRA(rank=3, alpha=6.0, targets=TARGETS)
    variables = lora.adapt(init_mlp(), jax.random.key(0))
    params = variables["params"]
    assert set(params["Dense_0"]) == {"kernel", "bias", "kernel_lora_a", "kernel_lora_b"}
    assert set(params["Dense_2"]) == {"kernel", "bias"}  # not targeted
    assert params["Dense_0"]["kernel_lora_a"].shape == (64, 3)
    np.testing.assert_array_equal(params["Dense_0"]["kernel_lora_b"], 0)
    rng = np.random.default_rng(0)
    b = rng.normal(size=(3, 32)).astype(np.float32)
    params["Dense_0"]["kernel_lora_b"] = b
    merged = lora.apply(variables)["params"]
    a = np.asarray(params["Dense_0"]["kernel_lora_a"], np.float64)
    expected = np.asarray(params["Dense_0"]["kernel"], np.float64) + 2.0 * a @ b
    np.testing.assert_allclose(merged["Dense_0"]["kernel"], expected, rtol=1e-6, atol=1e-6)
    assert "kernel_lora_a" not in merged["Dense_0"]  # the model's own tree
    assert_bitwise_equal(merged["Dense_2"], params["Dense_2"])


def test_no_matching_matrix_is_an_error_naming_the_paths():
    with pytest.raises(ValueError, match="matches no parameter.*Dense_0/bias"):
        jl.LoRA(rank=2, targets="q_proj").adapt(init_mlp(), jax.random.key(0))
    with pytest.raises(ValueError, match="rank is a positive integer"):
        jl.LoRA(rank=0)


def test_one_sgd_step_moves_b_by_the_chain_rule_and_leaves_the_base_bitwise():
    x, y = digits(32)
    module = LoraMLP(rank=4, alpha=8.0, lr=0.5, sgd=True)
    trainer = quiet_trainer(max_steps=1)
    trainer.fit(module, loader(x, y, 32))
    params = jax.tree.map(np.asarray, trainer.state.params)
    start = init_mlp()["params"]
    a = jl.LoRA(rank=4, alpha=8.0, targets=TARGETS).adapt(init_mlp(), module_rng(trainer))
    a0 = np.asarray(a["params"]["Dense_0"]["kernel_lora_a"])
    np.testing.assert_array_equal(params["Dense_0"]["kernel_lora_a"], a0)  # B = 0: no grad for A

    def loss(kernel):
        p = {**start, "Dense_0": {**start["Dense_0"], "kernel": kernel}}
        logits = MLP().apply({"params": p}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    grad_w = np.asarray(jax.grad(loss)(start["Dense_0"]["kernel"]), np.float64)
    expected_b = -0.5 * 2.0 * a0.astype(np.float64).T @ grad_w  # dL/dB = scale * A^T dL/dW
    np.testing.assert_allclose(params["Dense_0"]["kernel_lora_b"], expected_b, atol=1e-6)
    for layer in ("Dense_0", "Dense_1", "Dense_2"):
        for name in ("kernel", "bias"):
            np.testing.assert_array_equal(params[layer][name], start[layer][name])


def module_rng(trainer):
    """The key the Trainer adds adapters with (its init key, folded with 1)."""
    init_rng, _ = jax.random.split(jax.random.PRNGKey(trainer.args.seed or 0))
    return jax.random.fold_in(init_rng, 1)


def test_the_optimizer_keeps_state_for_the_adapters_only():
    module = LoraMLP()
    trainer = quiet_trainer(max_steps=2)
    trainer.fit(module, digits_loader())
    adapters = sum(x.size for x in jax.tree.leaves(adapters_only(trainer.state.params)))
    held = sum(x.size for x in jax.tree.leaves(trainer.state.opt_state) if x.ndim)
    assert held == 2 * adapters  # adam's two moments, of the adapters alone


def test_the_trained_change_of_a_target_has_at_most_the_rank():
    module = LoraMLP(rank=2)
    trainer = quiet_trainer(max_steps=5)
    trainer.fit(module, digits_loader())
    merged = module.lora.merged(module.variables)["params"]
    delta = np.asarray(merged["Dense_1"]["kernel"]) - init_mlp()["params"]["Dense_1"]["kernel"]
    assert np.linalg.matrix_rank(delta, tol=1e-6) == 2
    np.testing.assert_array_equal(
        merged["Dense_2"]["kernel"], init_mlp()["params"]["Dense_2"]["kernel"]
    )


def test_checkpoints_hold_the_adapters_only_and_resume_bitwise(tmp_path):
    data = digits_loader(n=128)
    whole = quiet_trainer(max_steps=4)
    whole.fit(LoraMLP(), data)
    every = jl.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    first = quiet_trainer(max_steps=2, callbacks=[every])
    first.fit(LoraMLP(), data)
    saved = restore(os.path.join(tmp_path, "2"))["state"]["params"]
    assert jax.tree.leaves(saved) and all(
        name.endswith(("_lora_a", "_lora_b"))
        for path, _ in jax.tree_util.tree_flatten_with_path(saved)[0]
        for name in [str(path[-1].key)]
    )
    resumed = quiet_trainer(max_steps=4)
    resumed.fit(LoraMLP(), data, ckpt_path=os.path.join(tmp_path, "2"))
    assert_bitwise_equal(resumed.state.params, whole.state.params)


def test_an_nnx_model_takes_adapters_unchanged():
    module = nnx_mlp_module(init_mlp())
    module.lora = jl.LoRA(rank=2, targets=TARGETS)
    trainer = quiet_trainer(max_steps=3)
    trainer.fit(module, digits_loader())
    params = jax.tree.map(np.asarray, trainer.state.params)
    assert (
        "kernel_lora_b" in params["Dense_0"]
        and np.abs(params["Dense_0"]["kernel_lora_b"]).max() > 0
    )
    np.testing.assert_array_equal(
        params["Dense_0"]["kernel"], init_mlp()["params"]["Dense_0"]["kernel"]
    )


def test_lora_under_fsdp_trains_as_under_data_parallel():
    data = digits_loader(n=128, batch_size=64)
    plain = quiet_trainer(max_steps=3)
    plain.fit(LoraMLP(), data)
    sharded = quiet_trainer(max_steps=3, strategy=jl.FSDPStrategy(min_size=16))
    sharded.fit(LoraMLP(), data)
    kernel = sharded.state.params["Dense_0"]["kernel"]
    assert kernel.sharding.spec != jax.sharding.PartitionSpec()  # the base is sharded
    got = jax.tree.map(np.asarray, sharded.state.params)
    want = jax.tree.map(np.asarray, plain.state.params)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, atol=1e-6)


class Pretrained(LitMLP):
    """Starts from a safetensors file of PyTorch-style names, with LoRA."""

    def __init__(self, path):
        super().__init__()
        self.path, self.seen = path, None
        self.lora = jl.LoRA(rank=2, targets=TARGETS)

    def pretrained(self, into):
        self.seen = into
        rules = [
            ("fc{i}.weight", "params/Dense_{i}/kernel", "T"),
            ("fc{i}.bias", "params/Dense_{i}/bias"),
        ]
        return jl.load_weights(self.path, into, rename=rules)


def test_the_pretrained_hook_fills_the_shards_the_strategy_gives(tmp_path):
    params = init_mlp(seed=3)["params"]
    names = {}
    for i in range(3):
        names[f"fc{i}.weight"] = np.asarray(params[f"Dense_{i}"]["kernel"]).T.copy()
        names[f"fc{i}.bias"] = np.asarray(params[f"Dense_{i}"]["bias"])
    safetensors_format.write(tmp_path / "w.safetensors", names)
    module = Pretrained(str(tmp_path / "w.safetensors"))
    trainer = quiet_trainer(strategy=jl.FSDPStrategy(min_size=16))
    trainer.validate(module, digits_loader())
    kernel = module.seen["params"]["Dense_0"]["kernel"]
    assert (
        isinstance(kernel, jax.ShapeDtypeStruct)
        and kernel.sharding.spec != jax.sharding.PartitionSpec()
    )
    loaded = module.variables["params"]
    np.testing.assert_array_equal(
        np.asarray(loaded["Dense_1"]["kernel"]), params["Dense_1"]["kernel"]
    )
    assert "kernel_lora_a" not in loaded["Dense_0"]  # adapters are added at fit, after
    # the loss of the model whose adapters are still zero is the pretrained model's
    (result,) = trainer.validate(module, digits_loader())
    x, y = digits(64)
    logits = MLP().apply({"params": params}, jnp.asarray(x))
    expected = float(optax.softmax_cross_entropy_with_integer_labels(logits, y).mean())
    assert result["val/loss"] == pytest.approx(expected, rel=1e-5)


class PretrainedMLP(jl.JaxModule):
    """Pretrained weights from a file, LoRA on top; its hyperparameters rebuild it."""

    def __init__(self, path: str, lr: float = 1e-2):
        super().__init__()
        self.save_hyperparameters()
        self.net = MLP()
        self.lora = jl.LoRA(rank=2, targets=TARGETS)

    def setup(self, rng, batch):
        return self.net.init(rng, batch[0])

    def pretrained(self, into):
        return jl.load_weights(self.hparams.path, into)

    def configure_optimizers(self):
        return optax.adam(self.hparams.lr)

    def loss(self, variables, batch, rngs):
        logits = self.net.apply(variables, batch[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1])

    def eval_step(self, variables, batch):
        logits = self.net.apply(variables, batch[0])
        self.log("loss", optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]))


def test_an_adapter_checkpoint_loads_beside_the_pretrained_weights(tmp_path, capsys):
    jl.save_weights(init_mlp(seed=5), tmp_path / "base.safetensors")
    every = jl.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3)
    trainer = quiet_trainer(max_steps=3, callbacks=[every], enable_model_summary=True)
    module = PretrainedMLP(str(tmp_path / "base.safetensors"))
    trainer.fit(module, digits_loader())
    out = capsys.readouterr().out
    assert "Trainable params: 320 (LoRA adapters" in out
    (trained,) = trainer.validate(module, digits_loader())
    restored = PretrainedMLP.load_from_checkpoint(every.best_model_path)
    assert (
        adapters_only(restored.variables["params"])
        and "kernel" not in restored.variables["params"]["Dense_0"]
    )  # the checkpoint holds the adapters alone
    (again,) = quiet_trainer().validate(restored, digits_loader())
    assert again == trained
