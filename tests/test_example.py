"""The main job: examples/digits.py with its default settings."""

import os

import jax

from tests.helpers import load_example


def test_digits_example_reaches_95_percent_on_all_devices(tmp_path, capsys):
    digits = load_example("digits")
    acc = digits.main(
        ["--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar", "false"]
    )
    out = capsys.readouterr().out
    assert acc >= 0.95
    assert f"Training data-parallel on {jax.local_device_count()} cpu device(s)" in out
    assert "simulating 8 CPU devices" in out
    assert f"Final validation accuracy: {acc:.4f}" in out
    logdir = tmp_path / "lightning_logs"
    assert f"tensorboard --logdir {logdir}" in out
    assert os.listdir(logdir / "version_0")
