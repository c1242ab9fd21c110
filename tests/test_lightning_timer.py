"""Lightning's Timer tests, translated (``tests/tests_pytorch/callbacks/test_timer.py``).

Each test names the Lightning test it translates and keeps its durations and
expected values; Lightning's BoringModel is the tiny MLP on digits here.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import pytest

import jaxlightning as jl
from jaxlightning.callbacks import monitors
from tests.helpers import LitMLP, digits, loader, quiet_trainer

X, Y = digits(64)


def _fit(trainer: jl.Trainer, **kwargs) -> None:
    trainer.fit(LitMLP(hidden=16), loader(X, Y, 16), loader(X[:16], Y[:16], 16), **kwargs)


def _timer(trainer: jl.Trainer) -> jl.callbacks.Timer:
    (timer,) = [c for c in trainer.callbacks if isinstance(c, jl.callbacks.Timer)]
    return timer


def test_trainer_flag(caplog):
    """test_trainer_flag: max_time adds a Timer, unless one is given."""
    assert _timer(quiet_trainer(max_time={"seconds": 1337})).duration == 1337
    given = jl.callbacks.Timer()
    with caplog.at_level(logging.INFO, logger="jaxlightning"):
        trainer = quiet_trainer(max_time={"seconds": 1337}, callbacks=[given])
    assert _timer(trainer) is given and given.duration is None
    assert "callbacks list already contains a Timer" in caplog.text
    # max_time is still honoured with max_epochs=-1
    trainer = quiet_trainer(max_time={"seconds": 1}, max_epochs=-1)
    assert _timer(trainer).duration == 1
    assert trainer.max_epochs == -1 and trainer.max_steps == -1  # Lightning's values


@pytest.mark.parametrize(
    "duration,expected",
    [
        (None, None),
        ("00:00:00:22", timedelta(seconds=22)),
        ("12:34:56:65", timedelta(days=12, hours=34, minutes=56, seconds=65)),
        (timedelta(weeks=52, milliseconds=1), timedelta(weeks=52, milliseconds=1)),
        ({"weeks": 52, "days": 1}, timedelta(weeks=52, days=1)),
    ],
)
def test_timer_parse_duration(duration, expected):
    """test_timer_parse_duration."""
    remaining = jl.callbacks.Timer(duration=duration).time_remaining()
    assert remaining == (None if expected is None else expected.total_seconds())


def test_timer_interval_choice():
    """test_timer_interval_choice: a zero duration and both intervals are accepted."""
    jl.callbacks.Timer(duration=timedelta(), interval="step")
    jl.callbacks.Timer(duration=timedelta(), interval="epoch")
    with pytest.raises(ValueError, match="Unsupported parameter value"):
        jl.callbacks.Timer(duration=timedelta(), interval="invalid")


def test_timer_time_remaining(monkeypatch):
    """test_timer_time_remaining, with the module's clock set by hand."""
    now = [time.monotonic()]
    start = now[0]
    monkeypatch.setattr(monitors.time, "monotonic", lambda: now[0])
    timer = jl.callbacks.Timer(duration=timedelta(seconds=10))
    assert timer.time_remaining() == 10 and timer.time_elapsed() == 0
    now[0] = start + 60  # not started yet
    assert timer.start_time() is None
    assert timer.time_remaining() == 10 and timer.time_elapsed() == 0
    now[0] = start
    timer.on_train_start(None, None)
    assert timer.start_time() == start
    now[0] = start + 3
    assert round(timer.time_remaining()) == 7 and round(timer.time_elapsed()) == 3


def test_timer_stops_training(caplog):
    """test_timer_stops_training: 100 ms of training, compiling not counted."""
    trainer = quiet_trainer(
        max_epochs=1000, callbacks=[jl.callbacks.Timer(timedelta(milliseconds=100))]
    )
    with caplog.at_level(logging.INFO, logger="jaxlightning"):
        _fit(trainer)
    assert trainer.global_step > 1
    assert trainer.current_epoch < 999
    assert "Time limit reached." in caplog.text and "Signaling Trainer to stop." in caplog.text


@pytest.mark.parametrize("interval", ["step", "epoch"])
def test_timer_zero_duration_stop(interval):
    """test_timer_zero_duration_stop: checked when the fit starts, so nothing trains."""
    timer = jl.callbacks.Timer(duration=timedelta(0), interval=interval)
    trainer = quiet_trainer(max_epochs=3, callbacks=[timer])
    _fit(trainer)
    assert trainer.global_step == 0
    assert trainer.current_epoch == 0


@pytest.mark.parametrize("min_steps,min_epochs", [(None, 2), (3, None), (3, 2)])
def test_timer_duration_min_steps_override(min_steps, min_epochs):
    """test_timer_duration_min_steps_override: min_* hold the Timer's stop back."""
    timer = jl.callbacks.Timer(duration=timedelta(0))
    trainer = quiet_trainer(
        max_epochs=5, callbacks=[timer], min_steps=min_steps, min_epochs=min_epochs
    )
    _fit(trainer)
    if min_epochs:
        assert trainer.current_epoch >= min_epochs
    if min_steps:
        assert trainer.global_step >= min_steps - 1
    assert trainer.current_epoch < 5  # stopped as soon as the minimum allowed
    assert timer.time_elapsed() > 0


def test_timer_resume_training(tmp_path):
    """test_timer_resume_training: a used-up timer restored trains no step."""
    timer = jl.callbacks.Timer(duration=timedelta(milliseconds=200))
    checkpoint = jl.ModelCheckpoint(dirpath=tmp_path, save_top_k=-1)
    trainer = quiet_trainer(max_epochs=100, callbacks=[timer, checkpoint])
    _fit(trainer)
    assert not timer._offset
    assert timer.time_remaining() <= 0
    assert trainer.current_epoch < 99
    saved_global_step = trainer.global_step

    timer = jl.callbacks.Timer(duration=timedelta(milliseconds=200))
    trainer = quiet_trainer(max_epochs=100, callbacks=[timer])
    _fit(trainer, ckpt_path=checkpoint.best_model_path)
    assert timer._offset > 0
    assert trainer.global_step == saved_global_step


def test_timer_track_stages():
    """test_timer_track_stages: train, validate and test are timed apart."""
    timer = jl.callbacks.Timer()
    trainer = quiet_trainer(max_steps=5, callbacks=[timer])
    _fit(trainer)
    assert timer.time_elapsed() == timer.time_elapsed("train") > 0
    assert timer.time_elapsed("validate") > 0
    assert timer.time_elapsed("test") == 0
    trainer.test(LitMLP(hidden=16), loader(X[:16], Y[:16], 16))
    assert timer.time_elapsed("test") > 0
