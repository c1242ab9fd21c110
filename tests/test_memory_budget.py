"""The memory doctor (issue 42, item 2): one device's memory during the train
step from XLA's analysis of the compiled step, split by what it holds, and a
fit that would not fit stopped before its first step with the fix that does.

Checked against the trained state's own arrays (numpy's byte counts) and the
fit's own compiled step (`Trainer.train_step_cost`, a separate compile from the
Tuner's, which compiles from shapes)."""

import gc

import jax
import numpy as np
import pytest

import jaxlightning as jl
from tests.helpers import LitMLP, digits, loader, quiet_trainer


def _nbytes(tree) -> int:
    return sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(tree))


def _on_first_device(tree) -> int:
    """Bytes the first device holds of ``tree``'s placed arrays."""
    return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree))


@pytest.mark.parametrize("strategy", ["auto", "fsdp"])
def test_the_budget_adds_up_to_xlas_report_and_the_state_arrays(strategy):
    x, y = digits(512)
    train = loader(x, y, 256)
    # the host path: its step takes the batch as the Tuner's does (a resident
    # dataset's step gathers it: the test below)
    trainer = quiet_trainer(max_steps=1, strategy=strategy, data_on_device=False)
    found = jl.Tuner(trainer).memory_budget(LitMLP(hidden=64), train)
    trainer.fit(LitMLP(hidden=64), train)

    # Parameters and optimizer state per device: what the first device holds
    # of the trained state's arrays (under FSDP a share of the larger leaves).
    state = trainer.state
    if strategy == "fsdp":
        assert found.params < _nbytes(state.params) / 4
    else:
        assert found.params == _nbytes(state.params) == 4 * (2 * 64 * 65 + 65 * 10)
    assert found.params == _on_first_device(state.params)
    assert found.optimizer == _on_first_device(state.opt_state)
    # One device's 32 rows of 64 float32 features and their int32 labels.
    assert found.batch == 256 // 8 * (64 * 4 + 4)

    # The rows add up to what XLA reserves for the fit's own compiled step.
    cost = trainer.train_step_cost()
    reserved = cost.argument_bytes + cost.output_bytes - cost.alias_bytes + cost.temp_bytes
    assert sum(n for _, n in found.rows()) == pytest.approx(reserved, rel=0.01)
    assert found.peak == pytest.approx(cost.peak_bytes, rel=0.01)
    assert found.limit is None and found.fits  # the CPU reports no memory: nothing checked
    assert "peak" in found.table() and "parameters" in found.table()


def test_a_resident_fits_step_counts_the_dataset_it_gathers_from():
    x, y = digits(512)
    costs = {}
    for on_device in (False, True):
        trainer = quiet_trainer(max_steps=1, devices=2, data_on_device=on_device)
        trainer.fit(LitMLP(hidden=64), loader(x, y, 256))
        assert trainer.data_path == ("device" if on_device else "host")
        costs[on_device] = trainer.train_step_cost()
    # The same state and accumulators; in place of one device's batch shard
    # (128 rows of 64 float32 features and an int32 label), the whole dataset
    # on each device and the shard's int32 row indices; and the rows' int32
    # epochs, which the host path's program drops as unused (this module never
    # reads current_epoch) and the gather's optimization barrier keeps.
    shard = 128 * (64 * 4 + 4)
    dataset = 512 * (64 * 4 + 4)
    added = costs[True].argument_bytes - costs[False].argument_bytes
    assert added == dataset + 128 * 4 - shard + 128 * 4
    assert costs[True].flops == pytest.approx(costs[False].flops, rel=0.01)


class Steps(jl.Callback):
    def __init__(self):
        self.batches = 0

    def on_train_batch_start(self, trainer, module, batch_idx):
        self.batches += 1


def test_a_fit_that_would_not_fit_stops_before_its_first_step_with_the_fix():
    x, y = digits()  # 1797 rows: batches of 1024 hold far more activations than weights
    found = jl.Tuner(quiet_trainer()).memory_budget(LitMLP(), loader(x, y, 1024))
    # a simulated device one byte too small for the step and the dataset's
    # copy kept beside it (the default for a TensorDataset: `data_on_device`)
    assert found.resident == 1797 * (64 * 4 + 4)
    limit = found.total - 1

    steps = Steps()  # (under "auto" the fit would take the host path: the test below)
    trainer = quiet_trainer(
        max_epochs=1, device_memory=limit, callbacks=[steps], data_on_device=True
    )
    with pytest.raises(jl.MemoryBudgetError) as err:
        trainer.fit(LitMLP(), loader(x, y, 1024))
    message = str(err.value)
    assert "LitMLP's train step needs more memory than a device holds" in message
    assert "over by 1 B" in message
    fix = "batch_size 512 (global) with accumulate_grad_batches=2"
    assert fix in message and steps.batches == 0 and trainer.global_step == 0

    # The fixes, as the Tuner ranks them against the same limit (by XLA's peak
    # under each, with the dataset's copy: the smaller batch with accumulation,
    # FSDP on the 8 devices; and the step alone, the batches from the host),
    # fit: a fit with any one's settings and the same simulated memory trains.
    # (Their order here is a matter of about a kilobyte: on CPU the data-
    # parallel step holds the old and the new parameters at once, see
    # Strategy._compile_step, and this model's parameters are 13.5 KiB.)
    tuner = jl.Tuner(quiet_trainer())
    ranked = tuner.memory_budget(LitMLP(), loader(x, y, 1024), device_memory=limit)
    assert not ranked.fits
    whats = sorted(f.what.split(",")[0] for f in ranked.fixes)
    assert whats == [fix, "data_on_device=False", "strategy='fsdp'"]
    peaks = [f.peak_bytes for f in ranked.fixes]
    assert peaks == sorted(peaks) and peaks[-1] <= limit < ranked.total
    fixed = quiet_trainer(max_epochs=1, device_memory=limit, accumulate_grad_batches=2)
    fixed.fit(LitMLP(), loader(x, y, 512))
    assert fixed.global_step == 2  # 4 batches of 512 (the last 261 rows), 2 per update
    sharded = quiet_trainer(max_epochs=1, device_memory=limit, strategy="fsdp")
    sharded.fit(LitMLP(), loader(x, y, 1024))
    assert sharded.global_step == 2
    host = quiet_trainer(max_epochs=1, device_memory=limit, data_on_device=False)
    host.fit(LitMLP(), loader(x, y, 1024))
    assert host.global_step == 2 and host.data_path == "host"


def test_the_dataset_kept_on_the_device_counts_against_its_memory():
    # A step that fits alone, but not beside the dataset's copy: a fit that
    # insists on the copy (data_on_device=True) stops with the dataset's row
    # and the fix that leaves the data on the host; under "auto" the fit says
    # so and takes that fix itself, training as the host path does. The
    # Tuner's batch-size search leaves room for the copy.
    x, y = digits(1024)
    train = loader(x, y, 64)
    dataset = 1024 * (64 * 4 + 4)
    found = jl.Tuner(quiet_trainer(devices=1)).memory_budget(LitMLP(hidden=32), train)
    assert found.resident == dataset and found.total == found.peak + dataset
    limit = found.peak + dataset // 2
    steps = Steps()
    insisting = quiet_trainer(
        devices=1, max_epochs=1, device_memory=limit, callbacks=[steps], data_on_device=True
    )
    with pytest.raises(jl.MemoryBudgetError) as err:
        insisting.fit(LitMLP(hidden=32), train)
    message = str(err.value)
    assert "dataset kept on the device" in message and "peak with the dataset" in message
    assert "data_on_device=False" in message and steps.batches == 0
    host = quiet_trainer(devices=1, max_epochs=1, device_memory=limit, data_on_device=False)
    host.fit(LitMLP(hidden=32), train)
    assert host.global_step == 16
    del insisting, err  # (its copy of the dataset)
    auto = quiet_trainer(devices=1, max_epochs=1, device_memory=limit, callbacks=[steps])
    with pytest.warns(UserWarning, match=r"does not fit beside LitMLP's train step .*host"):
        auto.fit(LitMLP(hidden=32), train)
    assert auto.data_path == "host" and auto.global_step == 16 and steps.batches == 16
    gc.collect()  # the copy it made first is let go
    assert not [a for a in jax.live_arrays() if a.shape == x.shape], "a dataset copy lives"
    pairs = zip(jax.tree.leaves(auto.state.params), jax.tree.leaves(host.state.params), strict=True)
    for a, b in pairs:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # Batches of 64 fit beside the copy by a byte less than they need: the
    # search stops at 32, as the host path's does in the memory left beside it.
    budget = found.total - 1
    on_device, on_host = (
        jl.Tuner(quiet_trainer(devices=1, data_on_device=d)).scale_batch_size(
            LitMLP(hidden=32), train, max_bytes=m, init_val=32
        )
        for d, m in (("auto", budget), (False, budget - dataset))
    )
    assert on_device == on_host == 32


def test_device_memory_is_checked_by_name():
    with pytest.raises(ValueError, match=r"device_memory=0: expected an int >= 1"):
        jl.Trainer(device_memory=0)
