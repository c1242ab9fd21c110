"""Start a multi-process job on this machine.

    python -m jaxlightning.launch --nprocs 2 [--devices-per-proc 4] SCRIPT [ARGS...]

Each process runs ``SCRIPT ARGS`` with the variables `jax.distributed` needs
(a free coordinator port on 127.0.0.1, the process count and its index), CPU
collectives over gloo, and, with ``--devices-per-proc``, that many simulated
CPU devices. Output lines are forwarded with a ``[rank N]`` prefix. If one
process fails, the others are stopped and the launcher exits non-zero; SIGINT
and SIGTERM are passed on to every process.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from jaxlightning.cluster.distributed import ENV_NUM_PROCESSES, ENV_PROCESS_ID


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _forward(stream, rank: int, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(f"[rank {rank}] {line}")
        out.flush()
    stream.close()


def _child_env(rank: int, nprocs: int, port: int, devices: int | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            ENV_NUM_PROCESSES: str(nprocs),
            ENV_PROCESS_ID: str(rank),
            "LOCAL_RANK": str(rank),  # every process of this launcher is on this machine
            "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
            "PYTHONUNBUFFERED": "1",
        }
    )
    if devices is not None:
        flags = env.get("XLA_FLAGS", "")
        flags = " ".join(f for f in flags.split() if "device_count" not in f)
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    return env


def launch(
    script_args: Sequence[str],
    nprocs: int,
    devices_per_proc: int | None = None,
    grace_s: float = 10.0,
) -> int:
    """Runs ``python SCRIPT ARGS`` in ``nprocs`` processes; returns the exit status."""
    port = free_port()
    procs: list[subprocess.Popen[str]] = []
    threads = []
    for rank in range(nprocs):
        proc = subprocess.Popen(
            [sys.executable, *script_args],
            env=_child_env(rank, nprocs, port, devices_per_proc),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # signals reach children only through us
        )
        procs.append(proc)
        print(f"[launch] rank {rank} pid {proc.pid}", flush=True)
        t = threading.Thread(target=_forward, args=(proc.stdout, rank, sys.stdout), daemon=True)
        t.start()
        threads.append(t)

    def pass_on(signum: int, frame: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, pass_on) for s in (signal.SIGINT, signal.SIGTERM)}
    status = 0
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                print(
                    f"[launch] rank {rank} exited with status {code}; stopping the others",
                    flush=True,
                )
                _stop(procs, grace_s)
                status = code if code > 0 else 128 - code
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(0.1)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        for t in threads:
            t.join(timeout=5)
    return status


def _stop(procs: list[subprocess.Popen[str]], grace_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxlightning.launch", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--nprocs", type=int, required=True, help="processes to start")
    parser.add_argument("--devices-per-proc", type=int, help="simulated CPU devices each")
    parser.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds to wait for stopped processes before killing them",
    )
    parser.add_argument("script", help="the Python script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    ns = parser.parse_args(argv)
    if ns.nprocs < 1:
        parser.error("--nprocs must be at least 1")
    return launch([ns.script, *ns.args], ns.nprocs, ns.devices_per_proc, ns.grace)


if __name__ == "__main__":
    sys.exit(main())
