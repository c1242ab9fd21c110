"""ModelSummary, Timer, ThroughputMonitor and the jax profiler callback."""

import glob

import pytest

import jaxlightning as jl
from tests.helpers import LitMLP, digits, loader, quiet_trainer


def test_model_summary_is_on_by_default_and_lists_the_parameters(tmp_path, capsys):
    trainer = jl.Trainer(
        max_steps=1, default_root_dir=tmp_path, logger=False, enable_progress_bar=False
    )
    trainer.fit(LitMLP(hidden=16), loader(*digits(16), 8))
    out = capsys.readouterr().out
    assert "| Dense_0/kernel | (64, 16) | float32 | 1,024 |" in out
    assert "Total: 1,482" in out  # 64*16+16 + 16*16+16 + 16*10+10
    quiet = jl.Trainer(
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path / "q",
    )
    quiet.fit(LitMLP(hidden=16), loader(*digits(16), 8))
    assert "Total:" not in capsys.readouterr().out


def test_timer_measures_stages_and_stops_after_its_duration():
    timer = jl.callbacks.Timer(duration={"microseconds": 1})
    trainer = quiet_trainer(max_epochs=3, callbacks=[timer])
    trainer.fit(LitMLP(), loader(*digits(64), 8))
    assert trainer.global_step == 1  # time is up after the first step
    assert timer.time_elapsed("fit") > 0 and timer.time_remaining() == 0.0
    trainer.validate(LitMLP(), loader(*digits(16), 8))
    assert timer.time_elapsed("validate") > 0


def test_throughput_monitor_logs_rates_and_compile_time():
    trainer = quiet_trainer(
        max_epochs=1, log_every_n_steps=2, callbacks=[jl.callbacks.ThroughputMonitor()]
    )
    trainer.fit(LitMLP(), loader(*digits(64), 8))
    m = trainer.callback_metrics
    assert m["throughput/samples_per_sec"] > 0 and m["throughput/step_time"] > 0
    assert m["throughput/compile_time"] > 0  # the train step compiled in this fit
    assert trainer.train_samples_seen == 64


def test_jax_profiler_writes_a_trace_tensorboard_reads(tmp_path):
    trainer = jl.Trainer(
        max_steps=6,
        profiler="jax",
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(LitMLP(), loader(*digits(64), 8))
    traces = glob.glob(f"{trainer.log_dir}/plugins/profile/*/*.xplane.pb")
    assert traces, glob.glob(f"{tmp_path}/**", recursive=True)
    with pytest.raises(ValueError, match="profiler='torch'"):
        jl.Trainer(profiler="torch")
