"""Trainer controls (validation timing, limits, fast_dev_run, overfit_batches,
sanity steps, max_time, min_epochs/min_steps), counted as they run."""

import datetime
import math
import os
import warnings

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import jaxlightning as jl
from jaxlightning.schedule import Schedule, limited, parse_max_time
from tests.helpers import LitMLP, digits, init_mlp, loader, max_abs_diff, quiet_trainer


class Count(jl.Callback):
    def __init__(self):
        self.val_ends, self.val_batches, self.test_batches = [], 0, 0

    def on_validation_end(self, trainer, module):
        if not trainer.sanity_checking:  # the sanity check's validation runs its hooks too
            self.val_ends.append(trainer.global_step)

    def on_validation_batch_end(self, trainer, module, batch_idx):
        self.val_batches += 1

    def on_test_batch_end(self, trainer, module, batch_idx):
        self.test_batches += 1


class CountingBatches:
    """A re-iterable loader that counts the batches drawn from it."""

    def __init__(self, x, y, batch_size):
        rows = range(0, len(x), batch_size)
        self.batches = [(x[i : i + batch_size], y[i : i + batch_size]) for i in rows]
        self.batch_size, self.drawn = batch_size, 0

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        for batch in self.batches:
            self.drawn += 1
            yield batch


def _fit(max_epochs=2, n=64, batch=8, val=None, **kw):
    count = Count()
    trainer = quiet_trainer(max_epochs=max_epochs, callbacks=[count], **kw)
    x, y = digits(n)
    trainer.fit(LitMLP(), loader(x, y, batch), val if val is not None else loader(x, y, 16))
    return trainer, count


# ------------------------------------------------------------------ the rules
def test_schedule_rules_without_jax():
    quarter = Schedule(val_check_interval=0.25)
    assert [d for d in range(1, 9) if quarter.validate_after_batch(0, d, 8, d)] == [2, 4, 6, 8]
    every3 = Schedule(val_check_interval=3, check_val_every_n_epoch=None)
    assert [s for s in range(1, 13) if every3.validate_after_batch(0, 1, 4, s)] == [3, 6, 9, 12]
    second = Schedule(check_val_every_n_epoch=2)
    assert not second.validate_after_batch(0, 8, 8, 8) and second.validate_after_batch(1, 8, 8, 16)
    assert limited("limit_train_batches", 10, 0.25) == 2 and limited("x", 10, 3) == 3
    assert limited("x", None, 4) == 4 and limited("x", 7, None) == 7
    assert parse_max_time("01:02:03:04") == 93784
    assert parse_max_time({"minutes": 2}) == 120 == parse_max_time(datetime.timedelta(minutes=2))
    assert Schedule(min_epochs=2, min_steps=5).may_stop(2, 5)
    assert not Schedule(min_epochs=2).may_stop(1, 100)
    assert Schedule(max_epochs=3).estimated_steps(10) == 30
    assert Schedule(max_epochs=3, max_steps=7).estimated_steps(10) == 7
    assert Schedule(max_steps=-1).estimated_steps(10) == math.inf
    with pytest.raises(ValueError, match="val_check_interval=12 is more than the 8"):
        Schedule(val_check_interval=12).validate_after_batch(0, 1, 8, 1)
    with pytest.raises(ValueError, match=r"max_time='1h'"):
        parse_max_time("1h")


# ------------------------------------------------------- validation timing
def test_progress_counts_updates_of_accumulated_micro_batches_without_jax():
    from jaxlightning.progress import Progress

    p = Progress(accumulate=3)
    p.start_epoch(skip=0)
    done = [p.count_micro_batch() for _ in range(7)]  # an epoch of 7 micro-batches
    assert done == [False, False, True, False, False, True, False]
    assert (p.global_step, p.micro) == (2, 1)
    assert p.end_partial_update() and (p.global_step, p.micro) == (3, 0)  # the leftover one
    assert not p.end_partial_update()
    assert p.updates_in(7) == 3 and p.updates_in(6) == 2
    # the device numbers batches update * 3 + micro, 1-based: number 8 is the
    # third update's micro-batch, batch 7 of the epoch (which began at number 1)
    assert p.where(8) == (3, 7)
    p.start_epoch(skip=0)  # the next epoch's batch 0 is number 10
    assert p.epoch_offset == 9 and p.where(10) == (4, 0)
    assert p.batches_until(max_steps=5) == 6


def test_val_check_interval_fraction_validates_four_times_per_epoch(tmp_path):
    x, y = digits(64)  # 8 batches per epoch
    count = Count()
    trainer = jl.Trainer(
        max_epochs=2,
        val_check_interval=0.25,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        callbacks=[count],
        stage_prefix=True,
    )
    trainer.fit(LitMLP(), loader(x, y, 8), loader(x, y, 32))
    assert count.val_ends == [2, 4, 6, 8, 10, 12, 14, 16]
    events = EventAccumulator(trainer.log_dir)
    events.Reload()
    # every one logged, at Lightning's 0-based step of the last update
    assert [e.step for e in events.Scalars("val/acc")] == [s - 1 for s in count.val_ends]


def test_val_check_interval_in_steps_across_epochs():
    trainer, count = _fit(max_epochs=3, val_check_interval=3, check_val_every_n_epoch=None)
    assert count.val_ends == [3, 6, 9, 12, 15, 18, 21, 24]


# ------------------------------------------------------------------ limits
@pytest.mark.parametrize(("limit", "per_epoch"), [(3, 3), (0.5, 4)])
def test_limit_train_batches(limit, per_epoch):
    trainer, _ = _fit(limit_train_batches=limit)
    assert trainer.global_step == 2 * per_epoch and trainer.current_epoch == 2


def test_limit_val_test_and_predict_batches():
    trainer, count = _fit(limit_val_batches=2, num_sanity_val_steps=0)
    assert count.val_batches == 2 * 2  # two validations of two batches
    x, y = digits(64)
    model = LitMLP()
    tester = quiet_trainer(limit_test_batches=3, limit_predict_batches=0.25, callbacks=[count])
    tester.test(model, loader(x, y, 8))
    assert count.test_batches == 3
    predicted = tester.predict(model, loader(x, y, 8), concatenate=True)
    assert predicted["logits"].shape == (16, 10)  # 2 batches


def test_num_sanity_val_steps_draws_that_many_batches_before_training():
    x, y = digits(64)
    val = CountingBatches(x, y, 8)
    quiet_trainer(max_steps=1, num_sanity_val_steps=3).fit(LitMLP(), loader(x, y, 8), val)
    assert val.drawn == 3  # the sanity check only: training stopped before any validation
    untouched = CountingBatches(x, y, 8)
    quiet_trainer(max_steps=1, num_sanity_val_steps=0).fit(LitMLP(), loader(x, y, 8), untouched)
    assert untouched.drawn == 0


def test_fast_dev_run_runs_a_few_batches_and_keeps_nothing(tmp_path):
    x, y = digits(64)
    count = Count()
    checkpoint = jl.ModelCheckpoint(every_n_train_steps=1)
    trainer = jl.Trainer(
        fast_dev_run=2,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        callbacks=[count, checkpoint],
    )
    trainer.fit(LitMLP(), loader(x, y, 8), loader(x, y, 8))
    assert trainer.global_step == 2 and count.val_batches == 2 and count.val_ends == [2]
    # the checkpoint callback stays, as in Lightning, and skips every check
    assert trainer.logger is None and trainer.checkpoint_callback is checkpoint
    assert os.listdir(tmp_path) == []  # no logs, no checkpoints
    assert jl.Trainer(fast_dev_run=True, logger=False).max_steps == 1


def test_overfit_batches_trains_on_the_same_first_batches_unshuffled():
    x, y = digits(64)

    def fit(**kw):
        module = LitMLP(init_variables=init_mlp())
        quiet_trainer(max_epochs=3, **kw).fit(module, loader(x, y, 8, shuffle=True))
        return module.variables

    overfit = fit(overfit_batches=2)
    x2, y2 = x[:16], y[:16]  # the first two batches, in order
    plain = LitMLP(init_variables=init_mlp())
    quiet_trainer(max_epochs=3).fit(plain, loader(x2, y2, 8))
    assert max_abs_diff(overfit, plain.variables) < 1e-6


# ---------------------------------------------------------------- stopping
def test_max_time_stops_and_checkpoints(tmp_path):
    trainer = quiet_trainer(
        max_epochs=5,
        max_time={"microseconds": 1},
        default_root_dir=tmp_path,
        enable_checkpointing=True,
    )
    x, y = digits(64)
    trainer.fit(LitMLP(), loader(x, y, 8))
    assert trainer.global_step == 1  # time is up after the first step
    assert os.listdir(tmp_path / "checkpoints") == ["1"]


class StopAt(jl.Callback):
    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, module, batch_idx):
        if trainer.global_step == self.step:
            trainer.should_stop = True


def test_min_epochs_and_min_steps_hold_back_a_stop():
    x, y = digits(64)  # 8 steps per epoch
    held = quiet_trainer(max_epochs=5, min_epochs=2, callbacks=[StopAt(1)])
    held.fit(LitMLP(), loader(x, y, 8))
    assert held.global_step == 16 and held.current_epoch == 2
    steps = quiet_trainer(max_epochs=5, min_steps=11, callbacks=[StopAt(1)])
    steps.fit(LitMLP(), loader(x, y, 8))
    assert steps.global_step == 11


def test_estimated_stepping_batches_sizes_a_schedule():
    seen = []

    class Scheduled(LitMLP):
        def configure_optimizers(self):
            total = self.trainer.estimated_stepping_batches
            seen.append(total)
            return optax_adam_with_schedule(total)

    x, y = digits(64)
    quiet_trainer(max_epochs=3, limit_train_batches=5).fit(Scheduled(), loader(x, y, 8))
    quiet_trainer(max_epochs=3, max_steps=4).fit(Scheduled(), loader(x, y, 8))
    assert seen == [15, 4]


def optax_adam_with_schedule(total):
    import optax

    return optax.adam(optax.linear_schedule(1e-3, 0.0, int(total)))


# Lightning: tests/tests_pytorch/trainer/flags/test_min_max_epochs.py
#   ::test_max_epochs_not_set_warning
def test_max_epochs_not_set_warning():
    class StopAtOnce(jl.Callback):
        def on_train_batch_end(self, trainer, module, batch_idx):
            trainer.should_stop = True

    match = "`max_epochs` was not set. Setting it to 1000 epochs."
    trainer = quiet_trainer(max_epochs=None, limit_train_batches=1, callbacks=[StopAtOnce()])
    with pytest.warns(UserWarning, match=match):
        trainer.fit(LitMLP(), loader(*digits(32), 16))
    assert trainer.max_epochs == 1000
    assert trainer.current_epoch == 1
    for fast in (True, 1):  # fast_dev_run sets its own limits: no warning
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=match)
            quiet_trainer(fast_dev_run=fast).fit(LitMLP(), loader(*digits(32), 16))


# Lightning: tests/tests_pytorch/trainer/test_trainer.py::test_num_sanity_val_steps(_neg_one)
def test_num_sanity_val_steps_reads_back_and_minus_one_is_inf():
    assert quiet_trainer(num_sanity_val_steps=4).num_sanity_val_steps == 4
    assert quiet_trainer(num_sanity_val_steps=-1).num_sanity_val_steps == float("inf")
    assert quiet_trainer(val_check_interval=0.25).val_check_interval == 0.25


# Lightning: tests/tests_pytorch/trainer/flags/test_fast_dev_run.py
#   ::test_callbacks_and_logger_not_called_with_fastdevrun (EarlyStopping's part)
def test_fast_dev_run_skips_early_stopping():
    stopper = jl.EarlyStopping(monitor="never_logged")  # strict: would raise when checked
    trainer = quiet_trainer(fast_dev_run=2, callbacks=[stopper])
    x, y = digits(64)
    trainer.fit(LitMLP(), loader(x, y, 16), loader(x, y, 16))
    assert trainer.global_step == 2 and not trainer.should_stop
