"""The benchmark arms. Each returns a dict of results; run.py prints and saves them."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import jax
import numpy as np
import torch
from torch.utils.data import DataLoader

import jaxlightning as jl
from benchmarks import common, lightning_arm


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def vs_bare_jit(size: dict[str, int], rounds: int) -> dict[str, Any]:
    """Arm 1: Trainer.fit vs a bare jax.jit loop, digits-sized MLP, 1 device.

    Over a `TensorDataset` (which the Trainer fetches a batch at a time), over a
    per-example Dataset (which it fetches a row at a time, as the DataLoader
    does: the Trainer's own overhead), and over the per-example Dataset read by
    2 persistent DataLoader workers (loading in other processes).
    """
    out: dict[str, Any] = {}
    rounds = max(rounds, 5) if rounds > 1 else rounds  # ratios near 1 need more rounds
    cases = ((128, False, 0), (1024, False, 0), (128, True, 0), (1024, True, 0), (128, True, 2))
    for batch, per_example, workers in cases:
        x, y = common.data(size["steps"] * batch, 64)
        workers_kw = {"num_workers": workers, "persistent_workers": workers > 0}
        dl = common.loader(x, y, batch, per_example=per_example, **workers_kw)
        res = common.interleave(
            rounds,
            {
                "bare": lambda dl=dl: common.bare_jit_epochs(dl, size["epochs"]),
                "trainer": lambda dl=dl: common.trainer_epochs(dl, size["epochs"], devices=1),
            },
        )
        bare = [common.steady(t) for t, _ in res["bare"]]
        ours = [common.steady(t) for t, _ in res["trainer"]]
        name = f"batch_{batch}{'_per_example' if per_example else ''}"
        out[name + (f"_{workers}_workers" if workers else "")] = {
            "ratio": _median([b / o for b, o in zip(bare, ours, strict=True)]),
            # Fastest round against fastest round: the least disturbed by other load.
            "best_ratio": min(bare) / min(ours),
            "overhead_us_per_step": _median(
                [(o - b) / size["steps"] * 1e6 for b, o in zip(bare, ours, strict=True)]
            ),
            "trainer_samples_per_s": size["steps"] * batch / _median(ours),
            "bare_samples_per_s": size["steps"] * batch / _median(bare),
            "params_max_diff": common.max_diff(res["bare"][0][1], res["trainer"][0][1]),
        }
    return out


def step_extras(size: dict[str, int], rounds: int) -> dict[str, Any]:
    """Arm 9: clipping + accumulation (4 batches) + EMA on, vs a bare jit loop doing
    the same, 1 device, batch 128."""
    batch, k, clip, decay = 128, 4, 1.0, 0.999
    x, y = common.data(size["steps"] * batch, 64)
    dl = common.loader(x, y, batch)
    res = common.interleave(
        max(rounds, 5) if rounds > 1 else rounds,
        {
            "bare": lambda: common.bare_jit_extras_epochs(dl, size["epochs"], k, clip, decay),
            "trainer": lambda: common.trainer_epochs(
                dl,
                size["epochs"],
                callbacks=(jl.callbacks.EMA(decay),),
                devices=1,
                accumulate_grad_batches=k,
                gradient_clip_val=clip,
            ),
        },
    )
    bare = [common.steady(t) for t, _ in res["bare"]]
    ours = [common.steady(t) for t, _ in res["trainer"]]
    return {
        "ratio": _median([b / o for b, o in zip(bare, ours, strict=True)]),
        "best_ratio": min(bare) / min(ours),
        "params_max_diff": common.max_diff(res["bare"][0][1], res["trainer"][0][1]),
    }


def vs_seeds_pmap(size: dict[str, int], rounds: int) -> dict[str, Any]:
    """Arm 2: Trainer.fit vs the seeds' hand-written pmap loop, on all local devices."""
    batch = 128
    x, y = common.data(size["steps"] * batch, 64)
    dl = common.loader(x, y, batch)
    res = common.interleave(
        rounds,
        {
            "seeds": lambda: common.seeds_pmap_epochs(dl, size["epochs"]),
            "trainer": lambda: common.trainer_epochs(dl, size["epochs"]),
        },
    )
    seeds = [common.steady(t) for t, _ in res["seeds"]]
    ours = [common.steady(t) for t, _ in res["trainer"]]
    return {
        "devices": jax.local_device_count(),
        "ratio": _median([s / o for s, o in zip(seeds, ours, strict=True)]),
        "trainer_samples_per_s": size["steps"] * batch / _median(ours),
        "seeds_samples_per_s": size["steps"] * batch / _median(seeds),
        "params_max_diff": common.max_diff(res["seeds"][0][1], res["trainer"][0][1]),
    }


def vs_lightning(size: dict[str, int], rounds: int) -> dict[str, Any]:
    """Arm 3: samples/s and a whole 10-epoch fit with validation, vs PyTorch Lightning."""
    if not lightning_arm.available():
        return {"skipped": "lightning is not installed (pip install -e '.[bench]')"}
    batch, epochs = 128, size["fit_epochs"]
    x, y = common.data(size["steps"] * batch, 64)
    vx, vy = common.data(size["steps"] * batch // 8, 64, seed=1)
    dl, val = common.loader(x, y, batch), common.loader(vx, vy, batch)

    def ours() -> tuple[list[float], float]:
        times = common.EpochTimes()
        with tempfile.TemporaryDirectory() as root:
            start = time.perf_counter()
            trainer = jl.Trainer(
                max_epochs=epochs,
                devices=1,
                enable_progress_bar=False,
                enable_model_summary=False,  # as the Lightning arm
                default_root_dir=root,
                callbacks=[times],
            )
            trainer.fit(common.LitMLP(), dl, val)
            return times.times, time.perf_counter() - start

    def theirs() -> tuple[list[float], float]:
        with tempfile.TemporaryDirectory() as root:
            start = time.perf_counter()
            times = lightning_arm.fit(dl, epochs, root, val)
            return times, time.perf_counter() - start

    res = common.interleave(rounds, {"trainer": ours, "lightning": theirs})
    ours_epoch = [common.steady(t) for t, _ in res["trainer"]]
    pl_epoch = [common.steady(t) for t, _ in res["lightning"]]
    return {
        "samples_per_s_ratio": _median([p / o for p, o in zip(pl_epoch, ours_epoch, strict=True)]),
        "trainer_samples_per_s": size["steps"] * batch / _median(ours_epoch),
        "lightning_samples_per_s": size["steps"] * batch / _median(pl_epoch),
        "fit_wall_s_trainer": _median([w for _, w in res["trainer"]]),
        "fit_wall_s_lightning": _median([w for _, w in res["lightning"]]),
        "fit_wall_ratio": _median(
            [p / o for (_, o), (_, p) in zip(res["trainer"], res["lightning"], strict=True)]
        ),
    }


def logging_cost(size: dict[str, int], rounds: int) -> dict[str, Any]:
    """Arm 5: log_every_n_steps=1 vs 50 vs logging off (TensorBoard on for the first two)."""
    batch = 128
    x, y = common.data(size["steps"] * batch, 64)
    dl = common.loader(x, y, batch)
    roots = {k: tempfile.mkdtemp() for k in ("every_1", "every_50")}

    def arm(every: int | None):
        if every is None:
            return common.trainer_epochs(dl, size["epochs"], devices=1, log_every_n_steps=10**9)
        import jaxlightning as jl

        return common.trainer_epochs(
            dl,
            size["epochs"],
            devices=1,
            log_every_n_steps=every,
            logger=jl.TensorBoardLogger(roots[f"every_{every}"]),
        )

    res = common.interleave(
        rounds,
        {
            "every_1": lambda: arm(1),
            "every_50": lambda: arm(50),
            "off": lambda: arm(None),
        },
    )
    off = [common.steady(t) for t, _ in res["off"]]
    out = {}
    for name in ("every_1", "every_50"):
        t = [common.steady(x) for x, _ in res[name]]
        out[f"{name}_vs_off"] = _median([o / v for o, v in zip(off, t, strict=True)])
        out[f"params_max_diff_{name}"] = common.max_diff(res[name][0][1], res["off"][0][1])
    return out


def strategies(size: dict[str, int], rounds: int) -> dict[str, Any]:
    """Arm 6: pmap vs shard_map, on all local devices and on one."""
    batch = 128
    x, y = common.data(size["steps"] * batch, 64)
    dl = common.loader(x, y, batch)
    out = {}
    for devices in sorted({1, jax.local_device_count()}):
        res = common.interleave(
            rounds,
            {
                s: (
                    lambda s=s, devices=devices: common.trainer_epochs(
                        dl, size["epochs"], devices=devices, strategy=s
                    )
                )
                for s in ("pmap", "shard_map")
            },
        )
        pm = [common.steady(t) for t, _ in res["pmap"]]
        sm = [common.steady(t) for t, _ in res["shard_map"]]
        out[f"devices_{devices}"] = {
            "shard_map_speedup": _median([p / s for p, s in zip(pm, sm, strict=True)]),
            "params_max_diff": common.max_diff(res["pmap"][0][1], res["shard_map"][0][1]),
        }
    return out


def sharded(size: dict[str, int], rounds: int) -> dict[str, Any]:
    """Arm 10: FSDP vs data parallel (shard_map), on all local devices: what
    sharding the state costs per step where it would fit replicated."""
    batch = 128
    x, y = common.data(size["steps"] * batch, 64)
    dl = common.loader(x, y, batch)
    res = common.interleave(
        rounds,
        {
            s: (lambda s=s: common.trainer_epochs(dl, size["epochs"], strategy=s))
            for s in ("shard_map", "fsdp")
        },
    )
    dp = [common.steady(t) for t, _ in res["shard_map"]]
    fsdp = [common.steady(t) for t, _ in res["fsdp"]]
    return {
        "devices": jax.local_device_count(),
        "fsdp_time_ratio": _median([f / d for f, d in zip(fsdp, dp, strict=True)]),
        "params_max_diff": common.max_diff(res["shard_map"][0][1], res["fsdp"][0][1]),
    }


def sharded_memory(size: dict[str, int], rounds: int) -> dict[str, Any]:
    """Arm 10, memory: per-device bytes of the compiled train step of
    `examples/gpt.py` (XLA's buffer assignment, `trainer.train_step_cost()`)
    under data parallel, FSDP per layer (the example's default: the blocks in
    ``nn.scan`` with `jl.fsdp_gathered`) and gathering at the start (unrolled
    blocks), with remat policies, tensor parallel and FSDP x tensor parallel,
    each after two steps; the parameters against data parallel with the same
    blocks and data shards."""
    del rounds  # compiled sizes do not vary between runs
    from tests.helpers import load_example  # the examples' one loader

    gpt = load_example("gpt")
    loader_ = DataLoader(
        torch.from_numpy(gpt.markov_tokens(4 * size["gpt_batch"], 33)), size["gpt_batch"]
    )
    nothing, no_batch = "nothing_saveable", "dots_with_no_batch_dims_saveable"
    cases = {  # name: (strategy, scan, remat policy or None, devices)
        "data_parallel": ("auto", False, None, 8),
        "data_parallel_scan": ("auto", True, None, 8),
        "data_parallel_scan_remat": ("auto", True, nothing, 8),
        "data_parallel_4_scan": ("auto", True, None, 4),
        "fsdp_unrolled": ("fsdp", False, None, 8),
        "fsdp": ("fsdp", True, None, 8),  # the example's default: blocks in nn.scan
        "fsdp_remat": ("fsdp", True, nothing, 8),
        "fsdp_remat_dots_no_batch": ("fsdp", True, no_batch, 8),
        "tensor_parallel": ("tp", False, None, 8),
        "fsdp_x_tp": ("tp", True, None, 8),
        "fsdp_x_tp_remat": ("tp", True, nothing, 8),
    }
    out: dict[str, Any] = {}
    params: dict[str, Any] = {}
    for name, (strategy, scan, policy, devices) in cases.items():
        module = gpt.LitGPT(
            d_model=size["gpt_d_model"], heads=size["gpt_heads"], layers=size["gpt_layers"],
            scan=scan, remat=policy is not None, remat_policy=policy or nothing,
        )  # fmt: skip
        if strategy == "tp":
            strategy = jl.ModelParallelStrategy(data=4, model=2)
        trainer = jl.Trainer(
            max_steps=2, strategy=strategy, devices=devices, enable_progress_bar=False,
            logger=False, enable_checkpointing=False, enable_model_summary=False,
            limit_val_batches=0,
        )  # fmt: skip
        trainer.fit(module, loader_)
        cost = trainer.train_step_cost()
        params[name] = jax.tree.map(np.asarray, trainer.state.params)
        out[name] = {"peak_mib": cost.peak_bytes / 2**20, "state_mib": cost.argument_bytes / 2**20}
    base = out["data_parallel"]["peak_mib"]
    for row in out.values():
        row["vs_data_parallel"] = row["peak_mib"] / base
    like = {
        "data_parallel_scan_remat": "data_parallel_scan",
        "fsdp_unrolled": "data_parallel",
        "fsdp": "data_parallel_scan",
        "fsdp_remat": "data_parallel_scan",
        "fsdp_remat_dots_no_batch": "data_parallel_scan",
        "fsdp_x_tp": "data_parallel_4_scan",
        "fsdp_x_tp_remat": "data_parallel_4_scan",
    }
    for name, reference in like.items():
        out[name]["params_max_diff"] = common.max_diff(params[reference], params[name])
    return out


def slow_loader(size: dict[str, int], rounds: int) -> dict[str, Any]:
    """Arm 7: a DataLoader that takes ~1 ms per batch; prefetching should hide it."""
    from torch.utils.data import default_collate

    # Both collate per example (a custom collate_fn): only the sleep differs.
    def fast_collate(items):
        return default_collate(items)

    def slow_collate(items):
        time.sleep(0.001)
        return default_collate(items)

    batch = 128
    x, y = common.data(size["steps"] * batch, 64)
    fast, slow = common.loader(x, y, batch, fast_collate), common.loader(x, y, batch, slow_collate)
    res = common.interleave(
        rounds,
        {
            "trainer_fast": lambda: common.trainer_epochs(fast, size["epochs"], devices=1),
            "trainer_slow": lambda: common.trainer_epochs(slow, size["epochs"], devices=1),
            "bare_fast": lambda: common.bare_jit_epochs(fast, size["epochs"]),
            "bare_slow": lambda: common.bare_jit_epochs(slow, size["epochs"]),
        },
    )
    t = {k: [common.steady(x) for x, _ in v] for k, v in res.items()}
    return {
        "trainer_slow_over_fast": _median(
            [s / f for s, f in zip(t["trainer_slow"], t["trainer_fast"], strict=True)]
        ),
        "bare_slow_over_fast": _median(
            [s / f for s, f in zip(t["bare_slow"], t["bare_fast"], strict=True)]
        ),
        "trainer_vs_bare_slow": _median(
            [b / o for b, o in zip(t["bare_slow"], t["trainer_slow"], strict=True)]
        ),
        "added_ms_per_step_trainer": _median(
            [
                (s - f) / size["steps"] * 1e3
                for s, f in zip(t["trainer_slow"], t["trainer_fast"], strict=True)
            ]
        ),
    }


def checkpoint_stall(size: dict[str, int], rounds: int) -> dict[str, Any]:
    """Arm 12: how long `CheckpointWriter.save` holds the training thread for a
    host state of ``state_mib`` MiB (the pmap path's), beside the CRC32 pass
    that ran on that thread before the checksums moved to their own."""
    import shutil

    from jaxlightning.io import checkpoint as ck

    rng = np.random.default_rng(0)
    n = size["state_mib"] * 2**20 // 4 // 8
    state = {"params": {f"w{i}": rng.standard_normal(n, dtype=np.float32) for i in range(8)}}
    folder = tempfile.mkdtemp(prefix="jl-bench-stall-")
    saves, crcs = [], []
    try:
        writer = ck.CheckpointWriter(folder)
        for r in range(max(rounds, 3)):
            start = time.perf_counter()
            ck.checksums(state)
            crcs.append(time.perf_counter() - start)
            start = time.perf_counter()
            writer.save(r + 1, state, {"step": r + 1})
            saves.append(time.perf_counter() - start)
            writer.wait()
        writer.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {
        "state_mib": size["state_mib"],
        "save_stall_s": _median(saves),
        "checksum_pass_s": _median(crcs),
        "stall_now_over_before": _median([s / (s + c) for s, c in zip(saves, crcs, strict=True)]),
    }


def _startup(
    framework: str, cache: str | None, samples: int, host: bool = False, *extra: str
) -> dict[str, Any]:
    """One `benchmarks.startup` job in a fresh process (``extra``: its flags)."""
    with tempfile.TemporaryDirectory() as root:
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.startup",
            "--framework",
            framework,
            "--root",
            root,
            "--samples",
            str(samples),
        ]
        if cache:
            cmd += ["--cache", cache]
        if host:
            cmd.append("--host")
        cmd += extra
        # A cold start is one without a cache: not one named by the environment.
        env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
        done = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=600,
            cwd=os.path.dirname(os.path.dirname(__file__)),
            env=env,
        )
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-2000:])
        return json.loads(done.stdout.strip().splitlines()[-1])


def startup(size: dict[str, int], rounds: int) -> dict[str, Any]:
    """Arms 4 and 8: fresh processes; cold, with a warm compilation cache, and Lightning."""
    samples = size["short_samples"]
    cache = tempfile.mkdtemp(prefix="jl-cache-")
    _startup("jl", cache, samples)  # fills the cache
    arms = {
        "cold": lambda: _startup("jl", None, samples),
        "warm": lambda: _startup("jl", cache, samples),
        # the same job with its batches loaded on the host (data_on_device=False)
        "cold_host": lambda: _startup("jl", None, samples, host=True),
    }
    if lightning_arm.available():
        arms["lightning"] = lambda: _startup("lightning", None, samples)
    res = common.interleave(rounds, arms)
    out: dict[str, Any] = {}
    for name, runs in res.items():
        out[f"{name}_first_step_s"] = _median([r["first_step"] for r in runs])
        out[f"{name}_fit_s"] = _median([r["fit"] for r in runs])
    out["cold_compiled_per_fit"] = res["cold"][0]["compiled"]
    out["warm_compiled_per_fit"] = res["warm"][0]["compiled"]
    out["warm_cache_hits_per_fit"] = res["warm"][0]["cache_hits"]
    out["cold_host_compiled_per_fit"] = res["cold_host"][0]["compiled"]
    out["cold_over_cold_host_fit"] = _median(
        [c["fit"] / h["fit"] for c, h in zip(res["cold"], res["cold_host"], strict=True)]
    )
    out["warm_over_cold_first_step"] = _median(
        [w["first_step"] / c["first_step"] for w, c in zip(res["warm"], res["cold"], strict=True)]
    )
    if "lightning" in res:
        for name in ("cold", "warm"):
            out[f"{name}_fit_over_lightning"] = _median(
                [o["fit"] / p["fit"] for o, p in zip(res[name], res["lightning"], strict=True)]
            )
    return out


def workers(size: dict[str, int], rounds: int) -> dict[str, Any]:
    """Arm 13: DataLoader workers, each job a fresh process from its own script
    (a forkserver or spawn worker imports it again). 2 workers started by the
    Trainer's default (fork) and by forkserver (its default before), against
    none, on the host path: rows read by a per-example ``__getitem__`` (where
    workers help) and a TensorDataset gathered whole (where they cannot).
    First batch: seconds to the first finished training step; epoch: the
    steady epoch time (validation included, workers started anew each epoch).
    """
    samples, epochs = size["short_samples"], max(size["epochs"], 3)
    cache = tempfile.mkdtemp(prefix="jl-cache-")

    def job(n: int, context: str | None = None, per_example: bool = True) -> Any:
        flags = ["--epochs", str(epochs), "--workers", str(n)]
        flags += ["--context", context] if context else []
        flags += ["--per-example"] if per_example else []
        return lambda: _startup("jl", cache, samples, True, *flags)

    job(0)()  # fills the compilation cache: every arm then starts warm
    res = common.interleave(
        rounds,
        {
            "none": job(0),
            "fork": job(2),
            "forkserver": job(2, "forkserver"),
            "none_tensor": job(0, per_example=False),
            "fork_tensor": job(2, per_example=False),
        },
    )
    out: dict[str, Any] = {}
    for name, runs in res.items():
        out[f"{name}_first_step_s"] = _median([r["first_step"] for r in runs])
        out[f"{name}_epoch_s"] = _median([common.steady(r["epochs"]) for r in runs])
    for name in ("fork", "forkserver"):
        out[f"{name}_first_step_minus_none_s"] = _median(
            [w["first_step"] - z["first_step"] for w, z in zip(res[name], res["none"], strict=True)]
        )
    for name, base in (("fork", "none"), ("forkserver", "none"), ("fork_tensor", "none_tensor")):
        out[f"{name}_epoch_over_{base}"] = _median(
            [
                common.steady(w["epochs"]) / common.steady(z["epochs"])
                for w, z in zip(res[name], res[base], strict=True)
            ]
        )
    return out


def data_path(size: dict[str, int], rounds: int) -> dict[str, Any]:
    """Issue 23's arm: an MNIST-shaped MLP (784 -> 256 -> 256 -> 10, batch 128, Adam,
    shuffled) on one device, a steady epoch side by side: the Trainer over a
    DataLoader of a TensorDataset with its batches resident on the device (the
    default, "auto": eight steps per dispatch with the default logging
    interval; one step and eight steps per dispatch asked for) and on the host
    path (auto and one step); bare
    jit loops over the DataLoader and over device-resident arrays (the physical
    reference); Keras 3 on JAX over numpy arrays and PyTorch Lightning, where
    installed."""
    batch, epochs = 128, size["epochs"] + 1
    x, y = common.data(size["short_samples"], 784)
    dl = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y)),
        batch_size=batch,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
    )
    arms: dict[str, Any] = {
        "resident": lambda: common.trainer_epochs(dl, epochs, devices=1)[0],
        # eight steps per dispatch; a logging interval of 48 keeps every group whole
        "resident_spe8": lambda: common.trainer_epochs(
            dl, epochs, devices=1, steps_per_execution=8, log_every_n_steps=48
        )[0],
        # one step per dispatch: what "auto" (the default) chooses when a
        # callback acts after each step
        "resident_spe1": lambda: common.trainer_epochs(
            dl, epochs, devices=1, steps_per_execution=1
        )[0],
        "host": lambda: common.trainer_epochs(dl, epochs, devices=1, data_on_device=False)[0],
        "host_spe1": lambda: common.trainer_epochs(
            dl, epochs, devices=1, data_on_device=False, steps_per_execution=1
        )[0],
        "bare_loader": lambda: common.bare_jit_epochs(dl, epochs)[0],
        "bare_resident": lambda: common.bare_resident_epochs(x, y, batch, epochs),
    }
    if common.keras_available():
        arms["keras"] = lambda: common.keras_epochs(x, y, batch, epochs, 1)
        arms["keras_spe8"] = lambda: common.keras_epochs(x, y, batch, epochs, 8)
    if lightning_arm.available():

        def lightning() -> list[float]:
            with tempfile.TemporaryDirectory() as root:
                return lightning_arm.fit(dl, epochs, root)

        arms["lightning"] = lightning
    res = common.interleave(rounds, arms)
    epoch = {name: [common.steady(t) for t in runs] for name, runs in res.items()}
    out: dict[str, Any] = {
        name: {"epoch_s": _median(times), "samples_per_s": len(x) / _median(times)}
        for name, times in epoch.items()
    }

    def ratio(slower: str, faster: str) -> float:
        pairs = zip(epoch[slower], epoch[faster], strict=True)
        return _median([s / f for s, f in pairs])

    out["resident_vs_host"] = ratio("host", "resident")
    out["auto_vs_spe1"] = ratio("resident_spe1", "resident")
    out["host_auto_vs_spe1"] = ratio("host_spe1", "host")
    out["spe1_vs_bare_resident"] = ratio("bare_resident", "resident_spe1")
    out["spe8_vs_spe1"] = ratio("resident", "resident_spe8")
    out["spe8_vs_bare_resident"] = ratio("bare_resident", "resident_spe8")
    out["resident_vs_bare_resident"] = ratio("bare_resident", "resident")
    out["resident_vs_bare_loader"] = ratio("bare_loader", "resident")
    if "keras" in epoch:
        out["resident_vs_keras"] = ratio("keras", "resident")
        out["resident_vs_keras_spe8"] = ratio("keras_spe8", "resident")
        out["spe8_vs_keras_spe8"] = ratio("keras_spe8", "resident_spe8")
    if "lightning" in epoch:
        out["resident_vs_lightning"] = ratio("lightning", "resident")
        out["spe8_vs_lightning"] = ratio("lightning", "resident_spe8")
        # the ceiling of one step per dispatch: the physical reference's ratio
        out["bare_resident_vs_lightning"] = ratio("lightning", "bare_resident")
    return out


def lm_packing(size: dict[str, int], rounds: int) -> dict[str, Any]:
    """Issue 63's arm: packed language-model rows against padded ones and
    against a bare jit loop over the same packed arrays (benchmarks/lm.py)."""
    from benchmarks import lm

    return lm.packing(size, rounds)
