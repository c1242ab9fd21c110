"""The benchmark suite runs end to end on tiny settings (speed is not tested here)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the full suite only (pytest --full)

ROOT = Path(__file__).resolve().parents[1]


def test_benchmark_suite_runs_on_tiny_settings(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    single, multi = results["groups"]["single"], results["groups"]["multi"]
    # Arms that should agree numerically do (the suite checks its own arms).
    assert single["vs_bare_jit"]["batch_128"]["params_max_diff"] < 1e-4
    # Read by DataLoader workers, the same batches train the same parameters.
    assert single["vs_bare_jit"]["batch_128_per_example_2_workers"]["params_max_diff"] < 1e-4
    assert single["vs_seeds_pmap"]["params_max_diff"] < 1e-5
    assert multi["vs_seeds_pmap"]["devices"] == 8
    assert multi["vs_seeds_pmap"]["params_max_diff"] < 1e-5
    assert multi["strategies"]["devices_8"]["params_max_diff"] < 1e-6
    assert multi["sharded"]["params_max_diff"] < 1e-6  # FSDP: the same numbers
    assert multi["sharded"]["fsdp_time_ratio"] > 0
    memory = multi["sharded_memory"]
    for name in ("fsdp_unrolled", "fsdp", "fsdp_remat", "fsdp_remat_dots_no_batch", "fsdp_x_tp"):
        assert memory[name]["params_max_diff"] < 1e-5
    # Per layer holds less than at the start; remat keeps less still.
    assert memory["fsdp"]["peak_mib"] < memory["fsdp_unrolled"]["peak_mib"]
    assert memory["fsdp_remat"]["peak_mib"] < memory["fsdp"]["peak_mib"]
    assert single["logging_cost"]["params_max_diff_every_1"] == 0
    assert single["step_extras"]["params_max_diff"] < 1e-4  # the same computation
    for ratio in (single["vs_bare_jit"]["batch_128"]["ratio"], multi["vs_seeds_pmap"]["ratio"]):
        assert ratio > 0
    startup = results["groups"]["startup"]["startup"]
    # init, the train step and the eval step, each step gathering its rows from
    # the dataset kept on the device (data_on_device="auto"), as many as with
    # the batches from the host
    assert startup["cold_compiled_per_fit"] == 3
    assert startup["cold_host_compiled_per_fit"] == 3
    assert startup["warm_compiled_per_fit"] == 0  # all from the persistent cache
    assert startup["warm_cache_hits_per_fit"] == 3
    data = results["groups"]["data"]["data_path"]
    assert data["resident_vs_host"] > 0 and data["host"]["epoch_s"] > 0
    assert data["spe8_vs_spe1"] > 0 and data["resident_spe8"]["epoch_s"] > 0
    assert single["vs_lightning"]["lightning_samples_per_s"] > 0
    workers = results["groups"]["workers"]["workers"]
    for arm in ("none", "fork", "forkserver", "none_tensor", "fork_tensor"):
        assert workers[f"{arm}_first_step_s"] > 0 and workers[f"{arm}_epoch_s"] > 0
    assert "single.vs_bare_jit.batch_128.ratio" in done.stdout  # the table
