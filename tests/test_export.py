"""JaxModule.export: predict_step and its variables in one file, run without the module."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import jaxlightning as jl
from tests.helpers import LitMLP, digits, loader, quiet_trainer


@pytest.mark.slow
def test_an_export_runs_in_a_fresh_process_without_the_module_as_predict(tmp_path):
    x, y = digits(90)
    module = LitMLP()
    quiet_trainer(max_epochs=1, devices=2).fit(module, loader(x[:64], y[:64], 16))
    predicted = quiet_trainer(devices=2).predict(module, loader(x, y, 16), concatenate=True)
    expected = predicted["logits"]
    path = module.export(tmp_path / "mlp.jlx", (x[:16], y[:16]))

    # Another batch size than the example's, in a process that never imports
    # the tests' module class (only jaxlightning to read the file).
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    script = textwrap.dedent(
        f"""
        import numpy as np, jaxlightning as jl
        predict = jl.load_exported({str(path)!r})
        x, y = np.load({str(tmp_path / "x.npy")!r}), np.load({str(tmp_path / "y.npy")!r})
        np.save({str(tmp_path / "out.npy")!r}, np.asarray(predict((x, y))["logits"]))
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), expected, rtol=1e-5, atol=1e-6)


def test_export_errors_name_the_problem(tmp_path):
    with pytest.raises(RuntimeError, match="has no weights yet"):
        LitMLP().export(tmp_path / "a.jlx", (np.zeros((4, 64), np.float32),))
    module = LitMLP()
    module.variables = LitMLP().net.init(jax.random.PRNGKey(0), np.zeros((1, 64), np.float32))
    with pytest.raises(ValueError, match=r"one leading row axis.*\[\(4, 64\), \(3,\)\]"):
        module.export(tmp_path / "a.jlx", (np.zeros((4, 64), np.float32), np.zeros(3)))
    (tmp_path / "junk").write_bytes(b"\x80")
    with pytest.raises(ValueError, match="not a file written by JaxModule.export"):
        jl.load_exported(tmp_path / "junk")
    # the three probes of issue 61: msgpack's own error, reshape advice for a
    # wrong feature width, and silence about a missing predict_step
    (tmp_path / "text").write_bytes(b"12 not an export")
    with pytest.raises(ValueError, match="not a file written by JaxModule.export"):
        jl.load_exported(tmp_path / "text")
    with pytest.raises(ValueError, match=r"fails on the example batch itself.*\(4, 32\)") as info:
        module.export(tmp_path / "a.jlx", (np.zeros((4, 32), np.float32), np.zeros(4)))
    assert "reshape" not in str(info.value)

    class NoPredict(LitMLP):
        predict_step = jl.JaxModule.predict_step

    bare = NoPredict()
    bare.variables = module.variables
    with pytest.raises(NotImplementedError, match="predict_step.*which it does not define"):
        bare.export(tmp_path / "b.jlx", (np.zeros((4, 64), np.float32),))
