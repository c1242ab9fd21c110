"""`Tuner.scale_batch_size`: the largest batch whose compiled train step fits a
device's memory, found by compiling candidates (never running them)."""

import pytest

import jaxlightning as jl
from jaxlightning import checks
from tests.helpers import LitMLP, digits, load_example, loader, quiet_trainer


def _peak(trainer, module, train, rows):
    """XLA's bytes of the step at ``rows`` (the same analysis the tuner reads)."""
    tx = checks.fit_optimizer(module, False, trainer._program.options, trainer.callbacks)
    example = trainer._pipeline.example_batch(train)
    return trainer._program.cost_at(module, tx, example, rows).peak_bytes


def test_power_and_binsearch_find_the_fitting_boundary_and_set_the_batch_size():
    trainer = quiet_trainer(devices=2, max_steps=1)
    module = LitMLP(hidden=64)
    module.batch_size = 16  # where Lightning's finder writes its result
    train = loader(*digits(64), 16)
    budget = _peak(trainer, module, train, 256)
    assert _peak(trainer, module, train, 512) > budget  # the step grows with the batch

    found = jl.Tuner(trainer).scale_batch_size(module, train, max_bytes=budget)
    assert found == 256 and module.batch_size == 256  # 2, 4, ..., 256 fit; 512 not
    assert not trainer._program.started  # nothing ran, no state was built

    found = jl.Tuner(trainer).scale_batch_size(
        module, train, mode="binsearch", max_bytes=budget, init_val=3
    )
    # the largest size (a multiple of the 2 devices) that fits: the next does not
    assert found % 2 == 0 and found >= 256
    assert _peak(trainer, module, train, found) <= budget
    assert _peak(trainer, module, train, found + 2) > budget
    trainer.fit(module, loader(*digits(64), found))  # and it trains
    assert trainer.global_step == 1


def test_what_cannot_be_tuned_is_named():
    trainer = quiet_trainer(devices=2)
    train = loader(*digits(64), 16)
    with pytest.raises(ValueError, match="report no memory limit: pass .*max_bytes"):
        jl.Tuner(trainer).scale_batch_size(LitMLP(), train)
    with pytest.raises(ValueError, match="even a batch of init_val=2 does not fit"):
        jl.Tuner(trainer).scale_batch_size(LitMLP(), train, max_bytes=1000)
    with pytest.raises(ValueError, match='mode must be "power" or "binsearch"'):
        jl.Tuner(trainer).scale_batch_size(LitMLP(), train, mode="linear", max_bytes=10**9)
    pmap = quiet_trainer(devices=2, strategy="pmap")
    with pytest.raises(RuntimeError, match="no memory analysis .* 'pmap' strategy"):
        jl.Tuner(pmap).scale_batch_size(LitMLP(), train, max_bytes=10**9)


def test_a_datamodule_gets_the_size_and_configure_optimizers_sees_the_trainer():
    """The GPT example under FSDP: its configure_optimizers sizes a schedule by
    trainer.estimated_stepping_batches, its DataModule holds batch_size."""
    gpt = load_example("gpt")
    trainer = quiet_trainer(strategy="fsdp", max_steps=10)
    datamodule = gpt.MarkovTokens(batch_size=8)
    found = jl.Tuner(trainer).scale_batch_size(
        gpt.LitGPT(), datamodule=datamodule, init_val=8, max_trials=3, max_bytes=2**40
    )
    assert found == 32 == datamodule.batch_size  # 8, 16, 32: the trials ran out
