"""Multi-process runs: 2 processes x 4 CPU devices over gloo, started by the launcher."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import jaxlightning as jl
from jaxlightning.io.checkpoint import complete_checkpoints, read_meta, restore_variables
from tests import run_multihost
from tests.helpers import (
    LitMLP,
    digits,
    init_mlp,
    loader,
    max_abs_diff,
    np_cross_entropy,
    np_logits,
)

pytestmark = pytest.mark.slow  # the full suite only (pytest --full)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "tests" / "run_multihost.py")


def launch(*args, **popen):
    cmd = [
        sys.executable,
        "-m",
        "jaxlightning.launch",
        "--nprocs",
        "2",
        "--devices-per-proc",
        "4",
        SCRIPT,
        *map(str, args),
    ]
    env = {**os.environ, "XLA_FLAGS": ""}
    if popen:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, **popen)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("two")
    result = launch("--root", root, "--out", root / "result.npz")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "[rank 0] DONE rank=0 step=4" in result.stdout
    assert "[rank 1] DONE rank=1 step=4" in result.stdout
    with np.load(root / "result.npz") as f:
        return root, dict(f)


@pytest.fixture(scope="module")
def two_process_fsdp_run(tmp_path_factory):
    """FSDP over 2 processes, of the MLP written in Flax NNX, two steps per
    dispatch (one run covers the three)."""
    root = tmp_path_factory.mktemp("two_fsdp")
    result = launch(
        "--root", root, "--out", root / "result.npz", "--strategy", "fsdp", "--nnx",
        "--steps-per-execution", 2,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:]
    assert "[rank 1] DONE rank=1 step=4" in result.stdout
    with np.load(root / "result.npz") as f:
        return root, dict(f)


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("one")
    run_multihost.main(["--root", str(root), "--out", str(root / "result.npz")])
    with np.load(root / "result.npz") as f:
        return root, dict(f)


def test_two_processes_of_four_devices_equal_one_process_of_eight(two_process_run, one_process_run):
    _, two = two_process_run
    _, one = one_process_run
    assert (int(two["processes"]), int(two["devices"])) == (2, 8)
    assert (int(one["processes"]), int(one["devices"])) == (1, 8)
    params = [k for k in one if k.startswith("[")]
    assert len(params) == 6
    for k in params:
        np.testing.assert_allclose(two[k], one[k], atol=1e-6, err_msg=k)


def test_nnx_fsdp_over_two_processes_of_four_devices_equals_linen_data_parallel_on_one(
    two_process_fsdp_run, one_process_run
):
    root, fsdp = two_process_fsdp_run
    _, one = one_process_run
    assert (int(fsdp["processes"]), int(fsdp["devices"])) == (2, 8)
    for k in (k for k in one if k.startswith("[")):
        np.testing.assert_allclose(fsdp[k], one[k], atol=1e-6, err_msg=k)
    assert fsdp["val_acc"] == one["val_acc"]
    np.testing.assert_allclose(fsdp["val_loss"], one["val_loss"], atol=1e-6)
    np.testing.assert_allclose(fsdp["logits"], one["logits"], atol=1e-5)
    # Each process wrote its own shards of one checkpoint, complete and restorable.
    ckpts = complete_checkpoints(root / "lightning_logs/version_0/checkpoints")
    assert [Path(p).name for p in ckpts] == ["4"]
    restored = restore_variables(ckpts[0])
    np.testing.assert_allclose(
        restored["params"]["Dense_0"]["kernel"], one["['Dense_0']['kernel']"], atol=1e-6
    )


def test_validation_is_exact_across_processes(two_process_run, one_process_run):
    _, two = two_process_run
    _, one = one_process_run
    assert two["val_acc"] == one["val_acc"]  # every example counted once
    x, y = digits(45, offset=1000)
    params = {}
    for k, v in two.items():
        m = re.fullmatch(r"\['(\w+)'\]\['(\w+)'\]", k)
        if m:
            params.setdefault(m.group(1), {})[m.group(2)] = v
    logits = np_logits(params, x)
    assert float(two["val_loss"]) == pytest.approx(np_cross_entropy(logits, y).mean(), abs=1e-6)
    assert float(two["val_acc"]) == pytest.approx((logits.argmax(-1) == y).mean(), abs=1e-7)
    assert two["logits"].shape == (45, 10)  # predict: one row per example, in order
    np.testing.assert_allclose(two["logits"], logits, atol=1e-4)


def test_one_run_directory_and_one_set_of_checkpoints(two_process_run):
    root, _ = two_process_run
    assert sorted(os.listdir(root)) == ["lightning_logs", "result.npz"]
    assert os.listdir(root / "lightning_logs") == ["version_0"]
    names = [
        Path(p).name for p in complete_checkpoints(root / "lightning_logs/version_0/checkpoints")
    ]
    assert names == ["4"]


def test_two_process_checkpoint_resumes_in_one_process(two_process_run):
    root, _ = two_process_run
    ckpt = complete_checkpoints(root / "lightning_logs/version_0/checkpoints")[-1]
    x, y = digits(200)

    def fit(ckpt_path=None):
        trainer = jl.Trainer(
            max_epochs=2, logger=False, enable_progress_bar=False, enable_checkpointing=False
        )
        model = LitMLP(lr=1e-2, init_variables=init_mlp())
        trainer.fit(model, loader(x, y, 64), ckpt_path=ckpt_path)
        return trainer

    resumed, straight = fit(ckpt), fit()
    assert resumed.global_step == straight.global_step == 8
    assert max_abs_diff(resumed.state.params, straight.state.params) < 1e-5
    assert max_abs_diff(resumed.state.opt_state, straight.state.opt_state) < 1e-5


def test_killing_one_process_stops_the_other_and_fails(tmp_path):
    proc = launch(
        "--root",
        tmp_path,
        "--epochs",
        "100",
        "--sleep-per-step",
        "0.3",
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    pids, lines = {}, []
    for line in proc.stdout:
        lines.append(line)
        if m := re.match(r"\[launch\] rank (\d) pid (\d+)", line):
            pids[int(m.group(1))] = int(m.group(2))
        if line.startswith("[rank 1] step 2"):
            break
    assert len(pids) == 2, "".join(lines)
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    out, _ = proc.communicate(timeout=60)
    assert time.monotonic() - start < 60
    assert proc.returncode != 0
    assert "rank 1 exited with status -9; stopping the others" in out
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)


@pytest.mark.parametrize("sent", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_sigterm_to_one_process_saves_every_process_at_the_next_step(tmp_path, sent):
    """JAX's preemption service spreads the notice: every process stops at the
    same step right after the signal, not at the next logging interval (50
    steps away), and the checkpoint resumes in one process as an uninterrupted
    run trains. SIGINT (Ctrl-C) is handed to the service as SIGTERM: the same
    step on every process (it was agreed only at logging intervals)."""
    proc = launch(
        "--root", tmp_path, "--epochs", "100", "--sleep-per-step", "0.6", "--log-every", "50",
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    pids, lines, signalled_at = {}, [], None
    for line in proc.stdout:
        lines.append(line)
        if m := re.match(r"\[launch\] rank (\d) pid (\d+)", line):
            pids[int(m.group(1))] = int(m.group(2))
        if m := re.match(r"\[rank 1\] step (\d+)", line):
            signalled_at = int(m.group(1))
            if signalled_at >= 5:  # mid-epoch (4 steps an epoch)
                os.kill(pids[1], sent)  # one process only
                break
    out, _ = proc.communicate(timeout=120)
    out = "".join(lines) + out
    assert proc.returncode in (128 + signal.SIGTERM, 128 + sent), out[-3000:]
    saved = re.search(r"\[rank 0\] Received SIGTERM at step (\d+): saved", out)
    assert saved, out[-3000:]
    step = int(saved.group(1))
    assert signalled_at < step <= signalled_at + 3  # the old code: step 50
    steps_seen = {int(n) for n in re.findall(r"\[rank 1\] step (\d+)", out)}
    assert max(steps_seen) == step  # rank 1 stopped there too

    ckpt = complete_checkpoints(tmp_path / "lightning_logs/version_0/checkpoints")[-1]
    assert Path(ckpt).name == str(step)
    x, y = digits(200)

    def fit(ckpt_path=None):
        trainer = jl.Trainer(
            max_epochs=4, logger=False, enable_progress_bar=False, enable_checkpointing=False
        )
        trainer.fit(
            LitMLP(lr=1e-2, init_variables=init_mlp()), loader(x, y, 64), ckpt_path=ckpt_path
        )
        return trainer

    resumed, straight = fit(ckpt), fit()
    assert resumed.global_step == straight.global_step == 16
    assert max_abs_diff(resumed.state.params, straight.state.params) < 1e-5


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory):
    """One process, global batch 32, one shuffled epoch read through a Dataset
    that notes the indices it is asked for, checkpoints every 2 steps: the
    uninterrupted run the resumed ones are held to."""
    root = tmp_path_factory.mktemp("recorded")
    run_multihost.main(
        ["--root", str(root), "--batch", "32", "--shuffle", "--save-every", "2",
         "--record", str(root / "seen")]
    )  # fmt: skip
    with open(root / "seen.rank0.json") as f:
        record = json.load(f)
    assert record["global_step"] == 7  # 6 batches of 32 and one of 8
    assert sorted(record["seen"]) == list(range(200))
    return root, record["seen"]


def _seen(prefix, ranks):
    out = []
    for r in range(ranks):
        with open(f"{prefix}.rank{r}.json") as f:
            out.append(json.load(f))
    return out


def test_resume_on_another_process_count_goes_on_at_the_next_example(recorded_run, tmp_path):
    """1 process (global batch 32) -> 2 processes (2 x 32) -> 1 process (32):
    every run starts at the example the one before stopped at, and together
    they read the epoch exactly as the uninterrupted run did."""
    one, order = recorded_run
    ckpt = one / "lightning_logs/version_0/checkpoints/2"
    assert read_meta(ckpt)["progress"]["batching"] == {"processes": 1, "batch_size": 32}
    two = tmp_path / "two"
    result = launch(
        "--root", two, "--batch", 64, "--shuffle", "--save-every", 2, "--record", two / "seen",
        "--ckpt-path", ckpt,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:]
    ranks = _seen(two / "seen", 2)
    # 64 examples in: global batches 1, 2, 3 of 64 (the last holds 8), steps 3-5.
    assert [r["global_step"] for r in ranks] == [5, 5]
    for j, start in enumerate(range(64, 200, 64)):
        batch = [i for r in ranks for i in r["seen"][32 * j : 32 * (j + 1)]]
        assert sorted(batch) == sorted(order[start : start + 64]), j
    assert sorted(ranks[0]["seen"] + ranks[1]["seen"]) == sorted(order[64:])

    ckpt = two / "lightning_logs/version_0/checkpoints/4"  # 192 examples in
    assert read_meta(ckpt)["progress"]["batching"] == {"processes": 2, "batch_size": 32}
    three = tmp_path / "three"
    run_multihost.main(
        ["--root", str(three), "--batch", "32", "--shuffle", "--record", str(three / "seen"),
         "--ckpt-path", str(ckpt)]
    )  # fmt: skip
    (last,) = _seen(three / "seen", 1)
    assert last["seen"] == order[192:]
    assert last["global_step"] == 5


def test_resume_at_a_position_no_batch_of_the_new_size_starts_at_is_refused(recorded_run):
    one, _ = recorded_run
    ckpt = one / "lightning_logs/version_0/checkpoints/2"  # 64 examples in
    x, y = digits(200)
    trainer = jl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False)
    model = LitMLP(lr=1e-2, init_variables=init_mlp())
    with pytest.raises(ValueError, match=r"after 64 examples .* 1 x 48 = 48, which does not"):
        trainer.fit(model, loader(x, y, 48, shuffle=True), ckpt_path=ckpt)


def test_grain_sharded_by_process_resumes_mid_epoch_from_each_process_state(tmp_path):
    """A grain DataLoader sharded by process: each process's iterator state is
    saved with the checkpoint (step 2, mid-epoch), and a resumed fit trains as
    the uninterrupted one did."""
    result = launch("--root", tmp_path, "--out", tmp_path / "r.npz", "--grain", "--epochs", 2)
    assert result.returncode == 0, result.stdout[-3000:]
    # 100 examples a process: 3 batches of 32 and one of 4 per epoch
    assert "[rank 1] DONE rank=1 step=8" in result.stdout
    ckpt = tmp_path / "straight/lightning_logs/version_0/checkpoints/2"
    states = read_meta(ckpt)["progress"]["data_state"]
    assert len(states) == 2 and states[0] != states[1]  # each process's own shard
    with np.load(tmp_path / "r.npz") as f:
        runs = dict(f)
    keys = [k[len("straight") :] for k in runs if k.startswith("straight")]
    assert len(keys) == 6
    for k in keys:
        np.testing.assert_array_equal(runs["resumed" + k], runs["straight" + k], err_msg=k)


def test_grain_one_order_cut_by_process_resumes_on_another_process_count(tmp_path):
    """1 -> 2 and 2 -> 1 processes on a grain DataLoader that cuts one global
    order by process: each resumed run reads exactly the records the
    uninterrupted run had left (from the saved position, none read twice), and
    trains to its params."""
    import grain

    sampler = grain.samplers.IndexSampler(num_records=200, shuffle=True, seed=0, num_epochs=1)
    order = [int(sampler[i].record_key) for i in range(200)]  # grain's own order
    ckpt = "lightning_logs/version_0/checkpoints/2"  # 2 global batches of 64: 128 records in
    one, two, three = tmp_path / "one", tmp_path / "two", tmp_path / "three"
    run_multihost.main(
        ["--root", str(one), "--out", str(one / "r.npz"), "--grain-global",
         "--record", str(one / "seen")]
    )  # fmt: skip
    (straight,) = _seen(one / "seen.straight", 1)
    assert straight["seen"] == order and straight["global_step"] == 4  # 64, 64, 64, 8
    result = launch(
        "--root", two, "--out", two / "r.npz", "--grain-global", "--record", two / "seen",
        "--fits", "straight,resumed", "--ckpt-path", one / "straight" / ckpt,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:]
    for name, start in (("straight", 0), ("resumed", 128)):
        ranks = _seen(two / f"seen.{name}", 2)
        for p, rank in enumerate(ranks):  # process p reads the order's positions p, p+2, ...
            assert rank["seen"] == order[start + p : 200 : 2], (name, p)
            assert rank["global_step"] == 4
    later = read_meta(two / "resumed" / "lightning_logs/version_0/checkpoints/4")["progress"]
    assert len(later["data_state"]) == 2  # it saves its own processes' states
    with np.load(one / "r.npz") as a, np.load(two / "r.npz") as b:
        runs = {**{f"one{k}": v for k, v in a.items()}, **{f"two{k}": v for k, v in b.items()}}
    keys = [k[len("onestraight") :] for k in runs if k.startswith("onestraight")]
    assert len(keys) == 6
    for k in keys:  # 2 x 4 devices = 1 x 8, as for a torch DataLoader
        for other in ("twostraight", "tworesumed"):
            np.testing.assert_allclose(runs[other + k], runs["onestraight" + k], atol=1e-6)

    # 2 -> 1 with another global batch (32): batch 4 of this run's epoch is next.
    run_multihost.main(
        ["--root", str(three), "--out", str(three / "r.npz"), "--grain-global", "--batch", "32",
         "--record", str(three / "seen"), "--fits", "resumed",
         "--ckpt-path", str(two / "straight" / ckpt)]
    )  # fmt: skip
    (resumed,) = _seen(three / "seen.resumed", 1)
    assert resumed["seen"] == order[128:] and resumed["global_step"] == 5  # + 32, 32, 8
    at = read_meta(three / "resumed" / "lightning_logs/version_0/checkpoints/4")["progress"]
    assert (at["epoch"], at["batch"]) == (0, 6)  # 192 records in, in batches of 32


def _alone(code, **env):
    """Runs ``code`` in a fresh process set up as rank 1 of a 2-process job."""
    from jaxlightning.launch import free_port

    env = {
        **os.environ,
        "XLA_FLAGS": "",
        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}",
        "JAXLIGHTNING_NUM_PROCESSES": "2",
        "JAXLIGHTNING_PROCESS_ID": "1",
        **env,
    }
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_unreachable_coordinator_fails_with_address_not_a_hang():
    start = time.monotonic()
    done = _alone("import jaxlightning as jl; jl.Trainer()", JAXLIGHTNING_INIT_TIMEOUT="2")
    assert time.monotonic() - start < 60
    assert done.returncode == 1
    assert re.search(
        r"RuntimeError: could not reach the coordinator of the multi-process job "
        r"at 127\.0\.0\.1:\d+ within 2 s",
        done.stderr,
    ), done.stderr[-2000:]


def test_using_jax_before_the_trainer_in_a_job_is_explained():
    # As process 0, which does not wait for a coordinator: JAX's own check
    # (its backends already started) fails before anything connects.
    code = "import jax.numpy as jnp, jaxlightning as jl; jnp.ones(2) + 1; jl.Trainer()"
    done = _alone(code, JAXLIGHTNING_PROCESS_ID="0")
    assert done.returncode == 1
    assert "JAX was used before the Trainer could call jax.distributed.initialize()" in (
        done.stderr
    ), done.stderr[-2000:]


def test_tensor_parallel_gpt_over_two_processes_equals_one_process(tmp_path):
    """The GPT example under ModelParallelStrategy(model=2): each process's 4
    devices form 2 model groups, the data axis spans the processes. Per-process
    batches of 16 over 2 processes are one process's batches of 32."""
    common = [
        "--trainer.strategy=jaxlightning.ModelParallelStrategy",
        "--trainer.strategy.model=2",
        "--trainer.max_steps=8",
        "--trainer.val_check_interval=8",  # a validation, so the checkpoint check comes
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--model.d_model=32",
        "--model.layers=1",
        # Processes interleave the examples (process r takes every 2nd from r), so
        # rows meet other devices' dropout keys than in one process: no dropout.
        "--model.dropout=0",
    ]
    script = str(ROOT / "examples" / "gpt.py")
    two = subprocess.run(
        [sys.executable, "-m", "jaxlightning.launch", "--nprocs", "2", "--devices-per-proc", "4",
         script, *common, "--data.batch_size=16", f"--trainer.default_root_dir={tmp_path / 'two'}"],
        cwd=ROOT, env={**os.environ, "XLA_FLAGS": ""}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert two.returncode == 0, two.stdout[-3000:]
    one = subprocess.run(
        [sys.executable, script, *common, "--data.batch_size=32",
         f"--trainer.default_root_dir={tmp_path / 'one'}"],
        cwd=ROOT, env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]

    def final_loss(out):
        return float(re.search(r"Final validation loss: ([\d.]+)", out).group(1))

    assert (
        "[rank 0] Training with ModelParallelStrategy(mesh={'batch': 4, 'model': 2})" in two.stdout
    )
    assert final_loss(two.stdout) == pytest.approx(final_loss(one.stdout), abs=2e-4)
    assert complete_checkpoints(tmp_path / "two" / "lightning_logs" / "version_0" / "checkpoints")
