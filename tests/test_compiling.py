"""Compiling ahead on worker threads: same results, and other input types still work."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlightning.xla.compiling import Precompiled, in_background


def test_precompiled_runs_its_program_and_hands_other_types_to_jit(compiles):
    def jl_double_plus_sum(x, y):
        return x * 2 + y.sum()

    jitted = jax.jit(jl_double_plus_sum)
    x, y = np.arange(3, dtype=np.float32), np.ones(4, np.float32)
    fn = Precompiled(jitted, jax.ShapeDtypeStruct((3,), np.float32), y)
    np.testing.assert_array_equal(fn(x, y), x * 2 + 4)
    assert compiles.matching("jl_double_plus_sum") == 1
    longer = np.ones(6, np.float32)  # another shape: compiled by the jitted function
    np.testing.assert_array_equal(fn(x, longer), x * 2 + 6)
    np.testing.assert_array_equal(fn(x, y), x * 2 + 4)
    assert compiles.matching("jl_double_plus_sum") == 2


def test_background_errors_reach_the_caller():
    def fails():
        raise ValueError("from the worker")

    with pytest.raises(ValueError, match="from the worker"):
        in_background(fails).result(timeout=10)
    assert in_background(lambda: jnp.ones(2).sum()).result(timeout=10) == 2


@pytest.mark.slow
def test_a_batch_larger_than_the_first_still_trains_exactly():
    import optax

    from tests.helpers import MLP, LitMLP, digits, init_mlp, max_abs_diff, quiet_trainer

    x, y = digits(24)
    batches = [(x[:8], y[:8]), (x[8:], y[8:])]  # 8 rows, then 16: the step recompiles
    module = LitMLP(lr=1e-2, init_variables=init_mlp())
    trainer = quiet_trainer(max_epochs=1)
    with pytest.warns(UserWarning, match="larger than the fixed batch size 8"):
        trainer.fit(module, batches)

    net, tx = MLP(32), optax.adam(1e-2)
    params = init_mlp()["params"]
    opt_state = tx.init(params)
    for bx, by in batches:  # the independent reference: plain Adam on the batch mean
        grads = jax.grad(
            lambda p, bx=bx, by=by: optax.softmax_cross_entropy_with_integer_labels(
                net.apply({"params": p}, bx), by
            ).mean()
        )(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    assert trainer.global_step == 2
    assert max_abs_diff(trainer.state.params, params) < 1e-5
