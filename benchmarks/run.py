"""Run the benchmark suite: `python -m benchmarks.run [--quick] [--rounds N]`.

Arms run in groups, each group in its own process with the device count it
needs (1 CPU device, or 8 simulated); within a group every comparison runs its
arms side by side, interleaved over rounds, and reports median ratios. Prints a
table and writes JSON (default: benchmarks/results/latest.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FULL = {
    "steps": 128, "epochs": 4, "fit_epochs": 10, "short_samples": 20000,
    "gpt_layers": 8, "gpt_d_model": 512, "gpt_heads": 8, "gpt_batch": 64, "state_mib": 1024,
}  # fmt: skip
QUICK = {
    "steps": 6, "epochs": 2, "fit_epochs": 2, "short_samples": 512,
    "gpt_layers": 2, "gpt_d_model": 32, "gpt_heads": 4, "gpt_batch": 16, "state_mib": 8,
}  # fmt: skip

GROUPS: dict[str, tuple[int, list[str]]] = {
    # group: (devices, arms)
    "single": (
        1,
        [
            "vs_bare_jit",
            "vs_seeds_pmap",
            "vs_lightning",
            "logging_cost",
            "slow_loader",
            "step_extras",
            "checkpoint_stall",
        ],
    ),
    "multi": (8, ["vs_seeds_pmap", "strategies", "sharded", "sharded_memory"]),
    "startup": (1, ["startup"]),
    "data": (1, ["data_path"]),
    "workers": (1, ["workers"]),
    "lm": (1, ["lm_packing"]),
}

# (result path, target, higher is better)
TARGETS: list[tuple[str, float, bool]] = [
    ("single.vs_bare_jit.batch_128.ratio", 0.90, True),
    ("single.vs_bare_jit.batch_1024.ratio", 0.97, True),
    ("single.vs_bare_jit.batch_128_per_example.ratio", 0.95, True),
    ("single.vs_bare_jit.batch_1024_per_example.ratio", 0.95, True),
    ("single.vs_bare_jit.batch_128_per_example_2_workers.ratio", 0.95, True),
    ("single.vs_lightning.samples_per_s_ratio", 2.0, True),
    ("single.step_extras.ratio", 0.90, True),
    ("single.logging_cost.every_50_vs_off", 0.98, True),
    ("startup.startup.warm_over_cold_first_step", 0.5, False),
    ("startup.startup.cold_fit_over_lightning", 2.0, False),
    ("startup.startup.warm_fit_over_lightning", 1.0, False),
    ("data.data_path.resident_vs_keras", 1.2, True),
    ("data.data_path.resident_vs_lightning", 2.5, True),
    ("data.data_path.resident_vs_bare_resident", 1.05, True),
    ("data.data_path.spe8_vs_keras_spe8", 1.2, True),
    ("data.data_path.spe8_vs_lightning", 2.5, True),
    ("workers.workers.fork_first_step_minus_none_s", 1.0, False),
    ("workers.workers.fork_epoch_over_none", 1.0, False),
    ("lm.lm_packing.long_tail.packed_over_padded", 1.5, True),
    ("lm.lm_packing.long_tail.prepacked_over_bare", 0.95, True),
    ("lm.lm_packing.uniform.prepacked_over_bare", 0.95, True),
    ("multi.sharded_memory.fsdp.vs_data_parallel", 0.40, False),
    ("multi.sharded_memory.fsdp_remat.vs_data_parallel", 0.25, False),
]


def run_group(group: str, size: dict[str, int], rounds: int, arms: list[str]) -> dict:
    from benchmarks import arms as arm_fns

    out = {}
    for name in arms:
        start = time.perf_counter()
        out[name] = getattr(arm_fns, name)(size, rounds)
        out[name]["seconds"] = round(time.perf_counter() - start, 1)
        print(f"  {group}.{name}: {out[name]['seconds']} s", file=sys.stderr, flush=True)
    return out


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            flat.update(_flatten(v, key + "."))
        else:
            flat[key] = v
    return flat


def table(results: dict) -> str:
    flat = _flatten(results["groups"])
    targets = {path: (t, up) for path, t, up in TARGETS}
    lines = [f"{'result':62} {'value':>12}  target"]
    for key, value in flat.items():
        if key.endswith(".seconds"):
            continue
        shown = f"{value:12.4g}" if isinstance(value, float) else f"{value!s:>12}"
        goal = ""
        if key in targets:
            t, up = targets[key]
            met = value >= t if up else value <= t
            goal = f"{'>=' if up else '<='} {t:g} {'met' if met else 'MISSED'}"
        lines.append(f"{key:62} {shown}  {goal}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, one round (a smoke run)")
    p.add_argument("--rounds", type=int)
    p.add_argument("--groups", default=",".join(GROUPS))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "latest.json"))
    p.add_argument("--group", help=argparse.SUPPRESS)  # worker mode
    p.add_argument("--arms", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    size = QUICK if args.quick else FULL
    rounds = args.rounds or (1 if args.quick else 3)

    if args.group:  # a worker: one group, in this process
        result = run_group(args.group, size, rounds, args.arms.split(","))
        Path(args.out).write_text(json.dumps(result))
        return 0

    results: dict[str, Any] = {
        "size": size,
        "rounds": rounds,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "groups": {},
    }
    for group in args.groups.split(","):
        devices, arms = GROUPS[group]
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
        part = Path(args.out).with_suffix(f".{group}.part.json")
        part.parent.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.run",
            "--group",
            group,
            "--arms",
            ",".join(arms),
            "--out",
            str(part),
            "--rounds",
            str(rounds),
        ]
        if args.quick:
            cmd.append("--quick")
        subprocess.run(cmd, cwd=ROOT, env=env, check=True)
        results["groups"][group] = json.loads(part.read_text())
        part.unlink()
    import jax

    results["jax"] = jax.__version__
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(table(results))
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
