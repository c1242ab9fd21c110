"""Sharded strategies on 8 simulated devices: FSDP and tensor parallel against
data parallel, memory per device from the arrays' shards, and checkpoints that
move between strategies."""

import warnings

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
import torch
from torch.utils.data import DataLoader

import jaxlightning as jl
from jaxlightning.strategies.mesh import largest_divisible_dim
from tests.helpers import LitMLP, digits, load_example, loader, max_abs_diff, quiet_trainer

gpt = load_example("gpt")

X, Y = digits(300)  # batches of 48: six full, a last one of 12 rows
VX, VY = digits(45, offset=1000)


class ClippedMLP(LitMLP):
    """Global-norm clipping inside the optax chain: a reduction over every
    parameter, which must see all shards."""

    def configure_optimizers(self):
        return optax.chain(optax.clip_by_global_norm(0.05), optax.adam(self.hparams.lr))


def fit(strategy, module, steps=20, **kw):
    trainer = quiet_trainer(max_steps=steps, strategy=strategy, **kw)
    trainer.fit(module, loader(X, Y, 48))
    return trainer


def host(tree):
    return jax.tree.map(np.asarray, tree)


@pytest.fixture(scope="module")
def dp_and_fsdp():
    """The same MLP (with dropout, clipping in the optimizer and the gradient's
    norm logged) fitted 20 steps data parallel and fully sharded, both on 8
    devices."""
    runs = {}
    for strategy in ("auto", "fsdp"):
        module = ClippedMLP(hidden=256, lr=1e-2, dropout=0.1)
        runs[strategy] = (fit(strategy, module, log_grad_norm=True), module)
    return runs


def test_fsdp_equals_data_parallel_after_20_steps_with_an_uneven_last_batch(dp_and_fsdp):
    (dp, dp_module), (fsdp, fsdp_module) = dp_and_fsdp["auto"], dp_and_fsdp["fsdp"]
    assert dp.global_step == fsdp.global_step == 20
    # The global norm of the sharded gradient, as of the whole one.
    grad_norm = dp.callback_metrics["train/grad_norm"]
    assert fsdp.callback_metrics["train/grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
    assert max_abs_diff(host(dp.state.params), host(fsdp.state.params)) < 1e-5
    assert max_abs_diff(host(dp.state.opt_state), host(fsdp.state.opt_state)) < 1e-5
    val = loader(VX, VY, 16)
    (a,), (b,) = dp.validate(dp_module, val), fsdp.validate(fsdp_module, val)
    assert a["val/acc"] == b["val/acc"]
    assert a["val/loss"] == pytest.approx(b["val/loss"], abs=1e-5)
    pa = dp.predict(dp_module, val, concatenate=True)
    pb = fsdp.predict(fsdp_module, val, concatenate=True)
    assert pb["logits"].shape == (45, 10)
    np.testing.assert_allclose(pa["logits"], pb["logits"], atol=1e-4)


def _bytes_per_device(tree):
    per = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
    return per


def test_fsdp_keeps_an_eighth_of_parameter_and_optimizer_bytes_per_device(dp_and_fsdp):
    fsdp = dp_and_fsdp["fsdp"][0]
    state = fsdp.state
    total = sum(x.nbytes for x in jax.tree.leaves((state.params, state.opt_state)))
    per = _bytes_per_device((state.params, state.opt_state))
    assert len(per) == 8
    # Arrays of 1024 elements or more (the kernels, 64x256, 256x256 and 256x10,
    # and their Adam moments) are split 8 ways; the rest (biases, the step
    # count) stay whole on each device.
    expected = sum(
        x.nbytes // 8 if x.size >= 1024 else x.nbytes
        for x in jax.tree.leaves((state.params, state.opt_state))
    )
    assert set(per.values()) == {expected}
    assert expected / total < 1 / 8 + 0.006
    kernel = state.params["Dense_1"]["kernel"]
    assert {s.data.shape for s in kernel.addressable_shards} == {(32, 256)}
    mu = state.opt_state[1][0].mu["Dense_1"]["kernel"]
    assert mu.sharding == kernel.sharding
    dp = dp_and_fsdp["auto"][0]  # data parallel: everything whole on every device
    assert max(_bytes_per_device((dp.state.params, dp.state.opt_state)).values()) == total


@pytest.mark.parametrize("strategy", ["fsdp", "tensor"])
def test_sharded_train_step_compiles_once_ahead_for_its_planned_layout(strategy, compiles):
    # The step compiles on a worker thread (ahead of the first batch) for the
    # state's planned layout: were that program the wrong one, the first call
    # would compile the step again, on the main thread.
    s = "fsdp" if strategy == "fsdp" else jl.ModelParallelStrategy(data=4, model=2)
    trainer = quiet_trainer(max_epochs=2, strategy=s)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the MLP has no tensor-parallel annotations
        trainer.fit(LitMLP(), loader(*digits(64), 16))
    assert trainer.global_step == 8
    assert compiles.matching("jl_sharded_train_step") == 1, compiles.counts
    threads = [
        t for name, ts in compiles.threads.items() if "jl_sharded_train_step" in name for t in ts
    ]
    assert threads == ["jl-compile"], compiles.threads


def test_fsdp_shards_the_largest_divisible_dimension_of_arrays_big_enough():
    assert largest_divisible_dim((64, 256), 8, 1024) == 1
    assert largest_divisible_dim((256, 10), 8, 1024) == 0
    assert largest_divisible_dim((30, 10), 8, 1) is None  # nothing divisible
    assert largest_divisible_dim((256,), 8, 1024) is None  # too small to be worth it
    assert largest_divisible_dim((512, 512), 8, 1024) == 0  # equals: the first


def test_fsdp_shard_dim_override_and_accumulation_equal_data_parallel():
    def rows_only(path, shape):
        return 0 if len(shape) == 2 and shape[0] % 8 == 0 else None

    strategy = jl.FSDPStrategy(shard_dim=rows_only)
    sharded = fit(strategy, LitMLP(hidden=64, lr=1e-2), steps=6, accumulate_grad_batches=2)
    plain = fit("auto", LitMLP(hidden=64, lr=1e-2), steps=6, accumulate_grad_batches=2)
    kernel = sharded.state.params["Dense_0"]["kernel"]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec("batch")
    assert sharded.state.grad_sum["Dense_0"]["kernel"].sharding == kernel.sharding
    assert max_abs_diff(host(sharded.state.params), host(plain.state.params)) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "tensor_parallel"])
def test_manual_optimization_gan_under_sharded_strategies_equals_data_parallel(strategy):
    from tests.test_gan import LitGAN, gan_loader

    if strategy == "fsdp":  # the GAN's arrays are small: split those of 16+ elements
        chosen = jl.FSDPStrategy(min_size=16)
    else:
        chosen = jl.ModelParallelStrategy(model=2)
    sharded = quiet_trainer(max_epochs=3, strategy=chosen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nothing is annotated for the model axis
        sharded.fit(LitGAN(), gan_loader())
    plain = quiet_trainer(max_epochs=3, devices=8 if strategy == "fsdp" else 4)
    plain.fit(LitGAN(), gan_loader())
    assert sharded.global_step == plain.global_step == 12
    assert max_abs_diff(host(sharded.state.params), host(plain.state.params)) < 1e-5
    assert max_abs_diff(host(sharded.state.opt_state), host(plain.state.opt_state)) < 1e-5
    if strategy == "fsdp":  # still laid out as planned after the manual steps
        kernel = sharded.state.params["generator"]["Dense_0"]["kernel"]  # Dense(6): (16, 6)
        assert kernel.sharding.spec == jax.sharding.PartitionSpec("batch")


# ---------------------------------------------------------------- tensor parallel
def _tokens_loader():
    return DataLoader(torch.from_numpy(gpt.markov_tokens(200, 17)), 48)


def _gpt(dropout, scan=False):
    return gpt.LitGPT(d_model=32, heads=4, layers=2, context=16, dropout=dropout, scan=scan)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("devices", "dropout"),
    [(8, 0.0), (4, 0.1)],  # with dropout: the same 4 data shards, hence the same keys
)
def test_tensor_parallel_gpt_equals_data_parallel(devices, dropout):
    tp = quiet_trainer(max_steps=8, strategy=jl.ModelParallelStrategy(data=4, model=2))
    tp.fit(_gpt(dropout), _tokens_loader())
    dp = quiet_trainer(max_steps=8, devices=devices)
    dp.fit(_gpt(dropout), _tokens_loader())
    assert max_abs_diff(host(tp.state.params), host(dp.state.params)) < 1e-5
    up = tp.state.params["Block_0"]["Dense_0"]["kernel"]  # (32, 128): columns split
    assert up.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert {s.data.shape for s in up.addressable_shards} == {(32, 64)}
    down = tp.state.opt_state[0].mu["Block_0"]["Dense_1"]["kernel"]  # rows split
    assert {s.data.shape for s in down.addressable_shards} == {(64, 32)}


@pytest.mark.slow
def test_fsdp_gathers_each_scanned_layer_where_it_runs():
    """The GPT example's blocks in one nn.scan, each gathering its own
    parameters (jl.fsdp_gathered): FSDP equals data parallel, the compiled
    step's peak falls well below FSDP that gathers everything at the start, and
    the annotated kernels rest split as annotated (FSDP x TP on one mesh too)."""

    def fit(strategy, devices="auto", **model):
        trainer = quiet_trainer(max_steps=6, strategy=strategy, devices=devices)
        trainer.fit(
            gpt.LitGPT(d_model=64, heads=4, layers=4, context=16, **model), _tokens_loader()
        )
        return trainer

    per_layer = fit("fsdp", scan=True, dropout=0.1)
    dp = fit("auto", scan=True, dropout=0.1)
    assert max_abs_diff(host(per_layer.state.params), host(dp.state.params)) < 1e-5
    whole = fit("fsdp", scan=False)
    assert per_layer.train_step_cost().peak_bytes < 0.75 * whole.train_step_cost().peak_bytes
    query = per_layer.state.params["Blocks"]["Block_0"]["query"]["kernel"]  # (4, 64, 64)
    assert query.sharding.spec == jax.sharding.PartitionSpec(None, "batch", None)
    assert {s.data.shape for s in query.addressable_shards} == {(4, 8, 64)}

    both = fit(jl.ModelParallelStrategy(data=4, model=2), scan=True, dropout=0.1)
    dp4 = fit("auto", devices=4, scan=True, dropout=0.1)  # the same 4 data shards and keys
    assert max_abs_diff(host(both.state.params), host(dp4.state.params)) < 1e-5
    out = both.state.params["Blocks"]["Block_0"]["out"]["kernel"]  # rows on model, cols on data
    assert out.sharding.spec == jax.sharding.PartitionSpec(None, "model", "batch")
    assert {s.data.shape for s in out.addressable_shards} == {(4, 32, 16)}


def test_fsdp_gathered_names_a_policy_given_by_name():
    # a string policy was accepted silently and failed deep in remat (issue 61)
    with pytest.raises(TypeError, match=r"policy='nothing_saveable'.*not its name"):
        jl.fsdp_gathered(nn.Dense, policy="nothing_saveable")


def test_logical_partitioning_rules_and_clear_errors():
    rules = [("in", None), ("mlp", "model")]
    strategy = jl.ModelParallelStrategy(data=4, model=2, logical_rules=rules)

    class Net(nn.Module):
        width: int = 64

        @nn.compact
        def __call__(self, x, train=False):
            init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("in", "mlp"))
            hidden = nn.relu(nn.Dense(self.width, kernel_init=init, name="hidden")(x))
            return nn.Dense(10, name="out")(hidden)

    class Lit(LitMLP):
        def __init__(self, width):
            super().__init__()
            self.net = Net(width)

        def setup(self, rng, batch):
            return self.net.init(rng, batch[0])

    trainer = quiet_trainer(max_steps=3, strategy=strategy)
    trainer.fit(Lit(64), loader(X, Y, 48))
    kernel = trainer.state.params["hidden"]["kernel"]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    plain = quiet_trainer(max_steps=3, devices=8)
    plain.fit(Lit(64), loader(X, Y, 48))
    assert max_abs_diff(host(trainer.state.params), host(plain.state.params)) < 1e-5

    odd = quiet_trainer(
        max_steps=1, strategy=jl.ModelParallelStrategy(model=2, logical_rules=rules)
    )
    with pytest.raises(ValueError, match=r"params/hidden/kernel has shape \(64, 33\).*2 ways"):
        odd.fit(Lit(33), loader(X, Y, 48))
    unmapped = quiet_trainer(max_steps=1, strategy=jl.ModelParallelStrategy(model=2))
    with pytest.raises(
        ValueError, match="hidden/kernel is partitioned over mesh axis 'in'.*logical_rules"
    ):
        unmapped.fit(Lit(64), loader(X, Y, 48))
    with pytest.warns(UserWarning, match="no parameter is partitioned over 'model'"):
        quiet_trainer(max_steps=1, strategy=jl.ModelParallelStrategy(model=2)).fit(
            LitMLP(), loader(X, Y, 48)
        )
    with pytest.raises(ValueError, match=r"data=3, model=2\) needs 6 devices; the Trainer has 8"):
        quiet_trainer(strategy=jl.ModelParallelStrategy(data=3, model=2))


# ------------------------------------------------------------------- checkpoints
def _fit_ckpt(strategy, devices, root, steps, ckpt_path=None):
    trainer = jl.Trainer(
        max_steps=steps,
        strategy=strategy,
        devices=devices,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[jl.ModelCheckpoint(dirpath=str(root / "ckpt"), every_n_train_steps=5)],
    )
    trainer.fit(ClippedMLP(hidden=64, lr=1e-2), loader(X, Y, 48), ckpt_path=ckpt_path)
    return trainer


def _fit_gpt_ckpt(strategy, devices, root, ckpt_path=None, every=4):
    checkpoint = jl.ModelCheckpoint(str(root / "ckpt"), every_n_train_steps=every, save_top_k=-1)
    trainer = quiet_trainer(
        max_steps=8, strategy=strategy, devices=devices, default_root_dir=root,
        callbacks=[checkpoint],
    )  # fmt: skip
    trainer.fit(_gpt(0.1, scan=True), _tokens_loader(), ckpt_path=ckpt_path)
    return trainer


@pytest.mark.slow
def test_checkpoints_move_between_pmap_and_fsdp_x_tensor_parallel(tmp_path):
    """The scanned GPT's kernels rest whole on every device under pmap and split
    over both mesh axes under FSDP x TP (4 data shards either way: the same
    keys, the same numbers). A pmap checkpoint resumes under FSDP x TP, and
    that run's checkpoint under pmap again, each ending as the straight run."""
    both = jl.ModelParallelStrategy(data=4, model=2)
    straight = _fit_gpt_ckpt("pmap", 4, tmp_path / "a")
    sharded = _fit_gpt_ckpt(both, "auto", tmp_path / "b", tmp_path / "a/ckpt/4", every=2)
    out = sharded.state.params["Blocks"]["Block_0"]["out"]["kernel"]  # (2, 32, 32)
    assert {s.data.shape for s in out.addressable_shards} == {(2, 16, 8)}
    back = _fit_gpt_ckpt("pmap", 4, tmp_path / "c", tmp_path / "b/ckpt/6")
    for resumed in (sharded, back):
        assert resumed.global_step == 8
        assert max_abs_diff(host(resumed.state.params), host(straight.state.params)) < 1e-5
        assert max_abs_diff(host(resumed.state.opt_state), host(straight.state.opt_state)) < 1e-5


@pytest.mark.parametrize(
    ("first", "then"), [(("fsdp", "auto"), ("auto", 1)), (("auto", 1), ("fsdp", "auto"))]
)
def test_checkpoints_move_between_fsdp_on_8_and_data_parallel_on_1(tmp_path, first, then):
    _fit_ckpt(*first, tmp_path / "a", steps=10)
    ckpt = tmp_path / "a" / "ckpt" / "10"
    resumed = _fit_ckpt(*then, tmp_path / "b", steps=20, ckpt_path=ckpt)
    straight = _fit_ckpt(*then, tmp_path / "c", steps=20)
    assert resumed.global_step == 20
    assert max_abs_diff(host(resumed.state.params), host(straight.state.params)) < 1e-5
    assert max_abs_diff(host(resumed.state.opt_state), host(straight.state.opt_state)) < 1e-5
    if then[0] == "fsdp":  # restored straight into the sharded layout
        kernel = resumed.state.params["Dense_1"]["kernel"]
        assert {s.data.shape for s in kernel.addressable_shards} == {(8, 64)}
