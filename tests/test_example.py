"""The main job: examples/digits.py with its default settings."""

import importlib.util
import os
import sys
from pathlib import Path

import jax

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "digits.py"


def test_digits_example_reaches_95_percent_on_all_devices(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("digits_example", EXAMPLE)
    digits = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = digits  # flax modules are dataclasses: they need it
    spec.loader.exec_module(digits)
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
