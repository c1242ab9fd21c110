"""The data-parallel recipe: the Trainer against the seeds' hand-written pmap loop."""

import flax.jax_utils
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import jaxlightning as jl
from jaxlightning.strategies import PmapStrategy, ShardMapStrategy
from jaxlightning.training.step import device_keys
from tests.helpers import (
    MLP,
    LitMLP,
    assert_bitwise_equal,
    digits,
    init_mlp,
    loader,
    max_abs_diff,
    quiet_trainer,
)

LR = 1e-2


def seeds_recipe_params(init_variables, x, y, batch_size, epochs=1):
    """The hand-written loop of seeds/pmap_data_parallel_flax.txt, without dropout."""
    n = jax.local_device_count()
    net = MLP(32)
    state = train_state.TrainState.create(
        apply_fn=net.apply, params=init_variables["params"], tx=optax.adam(LR)
    )

    def train_step(state, xs, ys):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, xs)
            return optax.softmax_cross_entropy_with_integer_labels(logits, ys).mean()

        grads = jax.grad(loss_fn)(state.params)
        grads = jax.lax.pmean(grads, "batch")
        return state.apply_gradients(grads=grads)

    p_train_step = jax.pmap(train_step, "batch")
    state = flax.jax_utils.replicate(state)
    for _ in range(epochs):
        for i in range(0, len(x), batch_size):
            xs = x[i : i + batch_size].reshape(n, -1, *x.shape[1:])
            ys = y[i : i + batch_size].reshape(n, -1)
            state = p_train_step(state, xs, ys)
    return jax.tree.map(lambda a: np.asarray(a[0]), state.params)


def fit_params(strategy="auto", devices="auto", x=None, y=None, batch_size=64, **kw):
    model = LitMLP(lr=LR, init_variables=init_mlp())
    trainer = quiet_trainer(max_epochs=1, strategy=strategy, devices=devices, **kw)
    trainer.fit(model, loader(x, y, batch_size))
    return trainer, jax.tree.map(np.asarray, trainer.state.params)


@pytest.fixture(scope="module")
def data():
    return digits(512)


@pytest.fixture(scope="module")
def reference(data):
    return seeds_recipe_params(init_mlp(), *data, batch_size=64)


@pytest.mark.parametrize("strategy", ["pmap", "shard_map"])
def test_fit_on_8_devices_equals_seeds_handwritten_pmap_loop(strategy, data, reference):
    trainer, params = fit_params(strategy, 8, *data)
    assert trainer.num_devices == 8 and trainer.global_step == 8
    assert max_abs_diff(params, reference) < 1e-5


def test_one_device_and_eight_devices_give_same_params(data, reference):
    _, params = fit_params("shard_map", 1, *data)
    assert max_abs_diff(params, reference) < 1e-5


def test_pmap_and_shard_map_agree_with_uneven_last_batch():
    x, y = digits(300)  # 4 full batches of 64 and one of 44
    _, a = fit_params("pmap", 8, x, y)
    _, b = fit_params("shard_map", 8, x, y)
    _, c = fit_params("shard_map", 1, x, y)
    assert max_abs_diff(a, b) < 1e-5
    assert max_abs_diff(b, c) < 1e-5


@pytest.mark.parametrize("strategy_cls", [PmapStrategy, ShardMapStrategy])
def test_device_keys_differ_across_devices_and_steps(strategy_cls):
    strategy = strategy_cls()
    strategy.setup(jax.local_devices())

    def keys(rng, step, rows):
        del rows  # only fixes the per-device shard
        k = device_keys(rng, step[0], ("dropout", "noise"))
        return {s: jax.random.key_data(v)[None] for s, v in k.items()}

    fn = strategy.compile(keys, sharded_args=(False, False, True), sharded_out=True)
    rng = strategy.replicate(jax.random.PRNGKey(0))
    rows = strategy.put_batch(np.zeros((8, 1), np.float32))
    seen = []
    for step in range(3):
        out = strategy.gather(fn(rng, strategy.replicate(np.array([step], np.int32)), rows))
        for stream in ("dropout", "noise"):
            seen.extend(tuple(k) for k in out[stream].reshape(8, -1))
    assert len(seen) == 3 * 2 * 8
    assert len(set(seen)) == len(seen), "every device, step and stream needs its own key"


def test_same_seed_reproduces_dropout_run_exactly_and_other_seed_differs():
    x, y = digits(256)

    def run(seed):
        model = LitMLP(lr=LR, dropout=0.3, init_variables=init_mlp())
        trainer = quiet_trainer(max_epochs=2, seed=seed)
        trainer.fit(model, loader(x, y, 64, shuffle=True))
        return jax.tree.map(np.asarray, trainer.state.params)

    first, again, other = run(1), run(1), run(2)
    assert all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again), strict=True)
    )
    assert max_abs_diff(first, other) > 1e-4


def test_dropout_keys_reach_loss_per_device():
    """With identical rows on every device, per-device dropout makes the shards differ."""

    class Probe(LitMLP):
        def loss(self, variables, batch, rngs):
            u = jax.random.uniform(rngs["dropout"], ())
            self.log("u", u)
            self.log("u_sq", u * u)
            return jnp.zeros(batch[0].shape[0])

    x = np.ones((64, 64), np.float32)
    y = np.zeros(64, np.int64)
    trainer = quiet_trainer(max_steps=1, log_every_n_steps=1)
    trainer.fit(Probe(init_variables=init_mlp()), loader(x, y, 64))
    m = trainer.callback_metrics
    # Averaged over 8 devices: with one shared key, mean(u^2) == mean(u)^2.
    variance = m["train/u_sq"] - m["train/u"] ** 2
    assert variance > 1e-4


def test_300_steps_on_8_devices_finish_without_collectives_deadlock():
    x, y = digits(64 * 30)
    trainer = quiet_trainer(max_steps=300)
    trainer.fit(LitMLP(hidden=16), loader(x, y, 64))
    assert trainer.global_step == 300
    assert np.isfinite(trainer.callback_metrics["train/loss"])


@pytest.mark.parametrize(
    "devices, asked, bound", [(1, None, 32), (8, None, 2), (1, 3, 3)], ids=["one", "eight", "set"]
)
def test_steps_in_flight_are_bounded_by_32_on_one_cpu_device_and_2_with_collectives(
    devices, asked, bound
):
    """One CPU device has no collectives to deadlock: its loop may run 32 steps
    ahead of the device (XLA's CPU client's own bound); several keep 2; a
    ``max_in_flight`` set is kept. Over more steps than that (no report among
    them: a report waits for all), the loop holds that many, never more."""
    steps = bound + 8
    x, y = digits(steps * 16)
    held_most = []

    class Watch(jl.Callback):
        def on_train_batch_end(self, trainer, module, batch_idx):
            held_most.append(len(trainer._program.held._in_flight))

    strategy = ShardMapStrategy(max_in_flight=asked)
    trainer = quiet_trainer(
        max_epochs=1, devices=devices, strategy=strategy, callbacks=[Watch()], log_every_n_steps=64
    )
    trainer.fit(LitMLP(hidden=16), loader(x, y, 16))
    assert strategy.max_in_flight == bound
    assert len(held_most) == steps and max(held_most) == bound


def test_initial_state_is_bitwise_a_plain_jit_of_setup():
    # The Trainer compiles its run-once init program with options chosen for
    # compile speed; the values must still be exactly those of the default compile.
    x, y = digits(64)
    module = LitMLP(hidden=256)
    trainer = quiet_trainer(max_steps=0, seed=3)
    trainer.fit(module, loader(x, y, 64))
    init_rng = jax.random.split(jax.random.PRNGKey(3))[0]
    rows = 64 // jax.local_device_count()
    expected = jax.jit(module.setup)(init_rng, (x[:rows], y[:rows]))
    got = module.variables
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert trainer.global_step == 0


class _DonatingParams(ShardMapStrategy):
    """The train step as compiled for accelerators: the whole state donated."""

    donates_params = True


def test_on_cpu_the_step_reuses_the_state_but_the_parameters_with_the_same_bits(data):
    """On the CPU backend the train step writes its new optimizer state over
    the old but its new parameters to fresh buffers (Strategy._compile_step);
    the parameters come out bitwise as when it donates everything."""
    held = []

    class Given(jl.Callback):
        def on_train_batch_start(self, trainer, module, batch_idx):
            if batch_idx == 2:  # the state the next dispatch is given
                held.append(trainer._program.held.live_state())

    runs = {}
    for name, strategy in (("cpu", ShardMapStrategy()), ("all", _DonatingParams())):
        _, runs[name] = fit_params(strategy, 8, *data, callbacks=[Given()])
    (cpu, donating_all) = held
    assert not any(x.is_deleted() for x in jax.tree.leaves(cpu.params))
    assert all(x.is_deleted() for x in jax.tree.leaves(cpu.opt_state))
    assert all(x.is_deleted() for x in jax.tree.leaves(donating_all.params))
    assert_bitwise_equal(runs["cpu"], runs["all"])


def test_a_state_with_other_parameters_is_its_replace_and_leaves_it_as_it_was():
    """`TrainState.with_params` (the host's fast ``replace(params=...)``, twice
    a step on CPU) builds the same frozen state and changes nothing else."""
    import dataclasses

    from jaxlightning.training.state import TrainState

    state = TrainState(
        step=np.int32(3),
        params={"w": np.ones(2)},
        opt_state=(np.zeros(2),),
        model_state={"batch_stats": {"m": np.ones(1)}},
        rng=np.arange(2, dtype=np.uint32),
    )
    new = state.with_params({"w": np.full(2, 5.0)})
    expected = state.replace(params={"w": np.full(2, 5.0)})
    assert type(new) is TrainState
    assert jax.tree.structure(new) == jax.tree.structure(expected)
    assert_bitwise_equal(new, expected)
    assert_bitwise_equal(state.params, {"w": np.ones(2)})
    assert new.opt_state is state.opt_state and new.rng is state.rng
    with pytest.raises(dataclasses.FrozenInstanceError):
        new.params = None  # type: ignore[misc]
