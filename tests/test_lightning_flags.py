"""Trainer flags as Lightning's own tests expect them (translated from
tests/tests_pytorch/: trainer/test_trainer.py, trainer/flags/test_val_check_interval.py,
loops/test_training_loop.py), with Lightning's expected values."""

import datetime
import itertools
import logging

import jax
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import jaxlightning as jl
from jaxlightning.loop.val_check import ValCheck
from tests.helpers import LitMLP, digits, init_mlp, loader, quiet_trainer

X, Y = digits(80)
VX, VY = digits(16, 500)


class Endless(IterableDataset):
    """Digits examples one by one, ``count`` of them (no ``__len__``)."""

    def __init__(self, count):
        self.count = count

    def __iter__(self):
        for i in range(self.count):
            j = i % len(X)
            yield torch.from_numpy(X[j]), torch.tensor(Y[j])


class Record(jl.Callback):
    """Records when validations and batches happen."""

    def __init__(self):
        self.train_batches = 0
        self.validations = []  # (total batches so far, current_epoch, global_step)
        self.train_starts = 0

    def on_train_start(self, trainer, module):
        self.train_starts += 1

    def on_train_batch_end(self, trainer, module, batch_idx):
        self.train_batches += 1

    def on_validation_start(self, trainer, module):
        if not trainer.sanity_checking:
            self.validations.append(
                (self.train_batches, trainer.current_epoch, trainer.global_step)
            )


# ------------------------------------------------------------------ limits
@pytest.mark.parametrize("limit", [0, 0.0])
def test_limit_train_batches_zero_turns_training_off(limit):
    # trainer/test_trainer.py::test_disabled_training
    variables = init_mlp()
    record = Record()
    trainer = quiet_trainer(
        max_epochs=2, limit_train_batches=limit, limit_val_batches=0.2, callbacks=[record]
    )
    module = LitMLP(init_variables=variables)
    trainer.fit(module, loader(X, Y, 16), loader(VX, VY, 8))
    assert trainer.current_epoch == 0 and trainer.global_step == 0
    assert record.train_batches == 0 and record.train_starts == 0
    assert "train/loss" not in trainer.callback_metrics  # no step ran
    for a, b in zip(jax.tree.leaves(variables), jax.tree.leaves(module.variables), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fast_dev_run_trains_despite_limit_train_batches_zero():
    # trainer/test_trainer.py::test_disabled_training (second half)
    variables = init_mlp()
    trainer = quiet_trainer(max_epochs=2, limit_train_batches=0.0, fast_dev_run=True)
    module = LitMLP(init_variables=variables)
    trainer.fit(module, loader(X, Y, 16), loader(VX, VY, 8))
    assert trainer.current_epoch == 1 and trainer.global_step == 1
    changed = [
        not np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(variables), jax.tree.leaves(module.variables), strict=True)
    ]
    assert all(changed)


@pytest.mark.parametrize("fast_dev_run", [1, 4])
def test_fast_dev_run_keeps_checkpoint_and_early_stopping_callbacks_idle(tmp_path, fast_dev_run):
    # trainer/flags/test_fast_dev_run.py::test_callbacks_and_logger_not_called_with_fastdevrun
    checkpoint = jl.ModelCheckpoint(monitor="acc", save_top_k=-1, dirpath=tmp_path / "ckpt")
    stopping = jl.EarlyStopping(monitor="acc", patience=0)
    trainer = quiet_trainer(
        max_epochs=3, fast_dev_run=fast_dev_run, callbacks=[checkpoint, stopping]
    )
    assert trainer.checkpoint_callback is checkpoint  # kept, as in Lightning
    trainer.fit(LitMLP(), loader(X, Y, 8), loader(VX, VY, 8))
    assert trainer.global_step == fast_dev_run
    assert checkpoint.best_k_models == {} and checkpoint.best_model_path == ""
    assert not (tmp_path / "ckpt").exists()  # nothing written, nothing opened
    assert stopping.wait_count == 0 and stopping.stopped_epoch == 0


@pytest.mark.parametrize(("value", "expected"), [(0.0, 0), (2.0, 2), (float("inf"), float("inf"))])
def test_num_sanity_val_steps_accepts_floats(value, expected):
    # trainer/flags: num_sanity_val_steps=-1 reads back inf; Lightning takes a float too
    assert quiet_trainer(num_sanity_val_steps=value).num_sanity_val_steps == expected


# -------------------------------------------------------- val_check_interval
@pytest.mark.parametrize("use_infinite_dataset", [False, True])
@pytest.mark.parametrize("accumulate_grad_batches", [1, 2])
def test_val_check_interval_counts_batches_across_epochs(
    use_infinite_dataset, accumulate_grad_batches
):
    # trainer/flags/test_val_check_interval.py::
    #   test_validation_check_interval_exceed_data_length_correct
    data_samples_train, max_epochs = 4, 3
    max_steps = data_samples_train * max_epochs
    max_opt_steps = max_steps // accumulate_grad_batches
    if use_infinite_dataset:
        train = DataLoader(Endless(max_steps + 100), batch_size=1)
    else:
        train = loader(X[:data_samples_train], Y[:data_samples_train], 1)
    record = Record()
    trainer = quiet_trainer(
        limit_val_batches=1,
        max_steps=max_opt_steps,
        val_check_interval=3,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        accumulate_grad_batches=accumulate_grad_batches,
        callbacks=[record],
    )
    trainer.fit(LitMLP(), train, loader(VX, VY, 8))
    assert trainer.current_epoch == (1 if use_infinite_dataset else max_epochs)
    assert trainer.global_step == max_opt_steps
    assert [batches for batches, _, _ in record.validations] == [3, 6, 9, 12]


def test_a_fraction_of_an_epoch_of_unknown_length_is_refused():
    # loops/fit_loop.py's setup_data (Lightning): "When using an IterableDataset
    # for `train_dataloader`, `Trainer(val_check_interval)` must be `1.0` or an
    # int" (it was accepted silently and validated at the epoch's end; issue 61)
    trainer = quiet_trainer(max_steps=2, val_check_interval=0.5)
    with pytest.raises(ValueError, match=r"must be `1.0` or an int \(got 0.5\)"):
        trainer.fit(LitMLP(), DataLoader(Endless(8), batch_size=2), loader(VX, VY, 8))


@pytest.mark.parametrize("interval", ["00:00:00:02", {"seconds": 2}, datetime.timedelta(seconds=2)])
def test_val_check_interval_as_a_duration(interval, monkeypatch):
    # trainer/flags/test_val_check_interval.py::test_time_based_val_check_interval:
    # a clock that moves 2 s per reading; 5 steps -> 5 validations
    ticks = itertools.count(0, 2)
    monkeypatch.setattr(ValCheck, "_clock", lambda self: next(ticks))
    record = Record()
    trainer = quiet_trainer(
        max_epochs=1, max_steps=5, limit_val_batches=1, val_check_interval=interval,
        callbacks=[record],
    )  # fmt: skip
    trainer.fit(LitMLP(), loader(X, Y, 8), loader(VX, VY, 8))
    assert len(record.validations) == 5


def test_val_check_interval_duration_waits_for_its_time(monkeypatch):
    # one reading per second: a 3 s interval validates after batches 3 and 6
    ticks = itertools.count(0, 1)
    monkeypatch.setattr(ValCheck, "_clock", lambda self: next(ticks))
    record = Record()
    trainer = quiet_trainer(
        max_epochs=1, limit_train_batches=7, limit_val_batches=1,
        val_check_interval={"seconds": 3}, num_sanity_val_steps=0, callbacks=[record],
    )  # fmt: skip
    trainer.fit(LitMLP(), loader(X, Y, 8), loader(VX, VY, 8))
    # readings: 0 at the start, one after each batch, one when a validation ends:
    # batch 3 reads 3 (due; the validation ends at 4), batch 6 reads 7 (due again)
    assert [batches for batches, _, _ in record.validations] == [3, 6]


def test_val_check_interval_reads_back():
    assert quiet_trainer(val_check_interval=0.25).val_check_interval == 0.25


# ----------------------------------------------------------- stopping
def test_should_stop_mid_epoch_validates_and_advances_the_epoch():
    # loops/test_training_loop.py::test_should_stop_mid_epoch
    class StopAt4(jl.Callback):
        def on_train_batch_start(self, trainer, module, batch_idx):
            if batch_idx == 4:
                trainer.should_stop = True

    record = Record()
    trainer = quiet_trainer(
        max_epochs=1, limit_train_batches=10, limit_val_batches=1, callbacks=[StopAt4(), record]
    )
    trainer.fit(LitMLP(), loader(X, Y, 8), loader(VX, VY, 8))
    assert trainer.current_epoch == 1
    assert trainer.global_step == 5
    assert [(epoch, step) for _, epoch, step in record.validations] == [(0, 5)]


def test_min_epochs_holds_a_stop_back_and_says_so(caplog):
    # loops/test_training_loop.py::test_fit_loop_done_log_messages
    class StopAlways(jl.Callback):
        def on_train_epoch_end(self, trainer, module):
            trainer.should_stop = True

    logger = logging.getLogger("jaxlightning")
    logger.addHandler(caplog.handler)
    try:
        trainer = quiet_trainer(max_epochs=5, min_epochs=3, callbacks=[StopAlways()])
        trainer.fit(LitMLP(), loader(X, Y, 16))
    finally:
        logger.removeHandler(caplog.handler)
    assert trainer.current_epoch == 3
    assert "`min_epochs=3` or `min_steps=0` has not been met. Training will continue" in caplog.text


# ------------------------------------------------------------ progress bar
@pytest.mark.parametrize("max_steps", [7, 20])
def test_progress_bar_total_of_a_loader_without_length_is_max_steps(max_steps):
    # loops/test_training_loop.py::test_tqdm_total_steps_with_iterator_no_length
    trainer = jl.Trainer(
        max_steps=max_steps, max_epochs=-1, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_model_summary=False,
    )  # fmt: skip
    bar = trainer.progress_bar_callback
    trainer.fit(LitMLP(), DataLoader(Endless(10_000), batch_size=4))
    assert bar.train_progress_bar.total == max_steps


@pytest.mark.parametrize("max_steps", [10, 15])
def test_progress_bar_total_is_bounded_by_max_steps(max_steps):
    # loops/test_training_loop.py::test_progress_bar_steps (100 examples, batches of 4)
    trainer = jl.Trainer(
        max_steps=max_steps, max_epochs=-1, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_model_summary=False,
    )  # fmt: skip
    bar = trainer.progress_bar_callback
    trainer.fit(LitMLP(), DataLoader(Endless(100), batch_size=4))
    assert bar.train_progress_bar.total == max_steps


def test_val_check_interval_beyond_the_epoch_with_validation_off():
    # loops/test_training_loop.py::test_val_check_interval_with_limit_val_batches_zero
    trainer = quiet_trainer(max_epochs=1, limit_train_batches=5, val_check_interval=10,
                            limit_val_batches=0)  # fmt: skip
    trainer.fit(LitMLP(), loader(X, Y, 8), loader(VX, VY, 8))
    assert trainer.global_step == 5


def test_trainer_defaults_from_pl_trainer_environment_variables(monkeypatch):
    # trainer/flags/test_env_vars.py::test_passing_env_variables_only and
    # ::test_passing_env_variables_defaults (an argument passed wins)
    monkeypatch.setenv("PL_TRAINER_LOGGER", "False")
    monkeypatch.setenv("PL_TRAINER_MAX_STEPS", "7")
    monkeypatch.setenv("PL_TRAINER_ACCELERATOR", "cpu")  # not a literal: the string
    trainer = jl.Trainer(enable_progress_bar=False)
    assert trainer.logger is None and trainer.max_steps == 7
    assert trainer.args.accelerator == "cpu"
    monkeypatch.setenv("PL_TRAINER_LOGGER", "True")
    trainer = jl.Trainer(logger=False, max_steps=42)
    assert trainer.logger is None and trainer.max_steps == 42
