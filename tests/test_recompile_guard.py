"""Trainer(recompile=...): a training batch whose shapes differ from the first
one's is named (the leaf, the batch) before it compiles the step again."""

import warnings

import numpy as np
import pytest

import jaxlightning as jl
from tests.helpers import LitMLP, digits, quiet_trainer


class Pooled(LitMLP):
    """The MLP over the mean of a sequence of rows: any sequence length trains."""

    def setup(self, rng, batch):
        return self.net.init(rng, batch[0].mean(1))

    def loss(self, variables, batch, rngs):
        x, y = batch
        return super().loss(variables, (x.mean(1), y), rngs)


def _batches(lengths):
    x, y = digits(32 * len(lengths))
    return [
        (np.repeat(x[i * 32 : (i + 1) * 32, None], n, axis=1), y[i * 32 : (i + 1) * 32])
        for i, n in enumerate(lengths)
    ]


def test_a_new_shape_mid_epoch_is_named_once_with_its_leaf_and_batch():
    trainer = quiet_trainer(max_epochs=2, devices=1)
    with pytest.warns(RuntimeWarning) as record:
        trainer.fit(Pooled(), _batches([4, 4, 6, 4, 6]))
    messages = [str(w.message) for w in record if "differs from the batch" in str(w.message)]
    assert len(messages) == 1  # once per new signature, not per batch or epoch
    assert "training batch 2 of epoch 0" in messages[0]
    assert "batch[0] has shape (32, 6, 64) float32, was (32, 4, 64) float32" in messages[0]
    assert trainer.global_step == 10  # it warns and trains on


def test_raise_stops_before_the_batch_is_trained_and_allow_is_silent():
    trainer = quiet_trainer(max_epochs=1, devices=1, recompile="raise")
    with pytest.raises(jl.RecompileError, match=r"training batch 1 of epoch 0 .*batch\[0\]"):
        trainer.fit(Pooled(), _batches([4, 5, 4]))
    assert trainer.global_step <= 1
    quiet = quiet_trainer(max_epochs=1, devices=1, recompile="allow")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        quiet.fit(Pooled(), _batches([4, 5, 4]))
    assert not [w for w in record if "differs from the batch" in str(w.message)]
    assert quiet.global_step == 3


def test_an_unknown_policy_is_named():
    with pytest.raises(ValueError, match=r"recompile='sometimes': use one of"):
        quiet_trainer(recompile="sometimes")


def test_an_evaluation_pass_is_checked_against_its_own_first_batch():
    class PooledEval(Pooled):
        def eval_step(self, variables, batch):
            x, y = batch
            super().eval_step(variables, (x.mean(1), y))

    class OneLoader:  # a list would be several loaders to validate
        def __iter__(self):
            return iter(_batches([3, 3, 5]))

    trainer = quiet_trainer(max_epochs=1, devices=1)
    with pytest.warns(RuntimeWarning) as record:
        trainer.validate(PooledEval(init_variables=None), OneLoader())
    messages = [str(w.message) for w in record if "differs from the batch" in str(w.message)]
    assert len(messages) == 1
    assert "batch of the validation dataloader 2 differs" in messages[0]
    assert "the evaluation step was compiled for" in messages[0]
    assert "batch[0] has shape (32, 5, 64) float32, was (32, 3, 64) float32" in messages[0]


def test_the_guard_names_a_dtype_or_key_change_and_passes_an_equal_batch():
    """The per-batch check compares a cheap key; what it lets through must be
    what the named signature would: the same leaves, shapes and dtypes."""
    from jaxlightning.data.signature import SignatureGuard

    guard = SignatureGuard("raise")
    first = {"x": np.zeros((8, 3), np.float32), "y": np.zeros(8, np.int32)}
    guard.check(first, 0, 0)
    guard.check({"x": np.ones((8, 3), np.float32), "y": np.ones(8, np.int32)}, 0, 1)
    dtype = r"batch\['y'\] has shape \(8,\) float32, was \(8,\) int32"
    with pytest.raises(jl.RecompileError, match=dtype):
        guard.check({"x": np.zeros((8, 3), np.float32), "y": np.zeros(8, np.float32)}, 0, 2)
    # float64 and int64 are float32 and int32 on the device (no jax_enable_x64):
    # the same program, so nothing to report (issue 61: "raise" stopped a fit)
    guard.check({"x": np.zeros((8, 3), np.float64), "y": np.zeros(8, np.int64)}, 0, 4)
    keys = r"structure changed: leaves \[\"\['x'\]\", \"\['z'\]\"\]"
    with pytest.raises(jl.RecompileError, match=keys):
        guard.check({"x": np.zeros((8, 3), np.float32), "z": np.zeros(8, np.int32)}, 0, 3)
