"""Multi-process runs on JAX's own multi-controller runtime (`jax.distributed`).

Every process runs the same script. `initialize` connects them before anything
touches the devices; afterwards ``jax.devices()`` lists every process's devices
and collectives span them all.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

import jax
import numpy as np

# Set by `python -m jaxlightning.launch` (JAX itself reads JAX_COORDINATOR_ADDRESS).
ENV_NUM_PROCESSES = "JAXLIGHTNING_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXLIGHTNING_PROCESS_ID"
ENV_TIMEOUT = "JAXLIGHTNING_INIT_TIMEOUT"


# Launchers whose processes `jax.distributed.initialize()` finds its job from
# (its cluster detection, which has no public query), by the variables it
# reads: SLURM's srun (a job step's tasks) and Open MPI's mpirun.
_CLUSTER_VARIABLES = (
    ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"),
    ("OMPI_MCA_orte_hnp_uri",),
)


def _cluster_detected() -> bool:
    """Whether this process was started by srun or mpirun (see `_CLUSTER_VARIABLES`)."""
    return any(all(name in os.environ for name in names) for names in _CLUSTER_VARIABLES)


def launched() -> bool:
    """Whether this process was started as part of a multi-process job."""
    return bool(os.environ.get("JAX_COORDINATOR_ADDRESS")) or _cluster_detected()


def initialize(num_nodes: int | None = None, *, timeout_s: int | None = None) -> None:
    """Connects this process to the job's others, once; a no-op when alone.

    Args:
        num_nodes: the number of processes expected (one per node, as JAX
            recommends), or ``None`` to take what the environment says.
        timeout_s: how long to wait for the coordinator before failing.

    Raises:
        RuntimeError: with the coordinator address, when it cannot be reached
            in time, when JAX was already used before this call, or when
            ``num_nodes`` disagrees with the job.
    """
    if jax.distributed.is_initialized():
        _check_count(num_nodes)
        return
    if not launched():
        if num_nodes not in (None, 1):
            raise RuntimeError(
                f"Trainer(num_nodes={num_nodes}) but this process was not started as part "
                "of a multi-process job. Start it with `python -m jaxlightning.launch "
                f"--nprocs {num_nodes} SCRIPT`, srun or mpirun, or set "
                f"JAX_COORDINATOR_ADDRESS, {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID}"
            )
        return
    timeout = timeout_s or int(os.environ.get(ENV_TIMEOUT, "300"))
    kwargs: dict[str, Any] = {"initialization_timeout": timeout}
    if os.environ.get(ENV_NUM_PROCESSES):
        kwargs["num_processes"] = int(os.environ[ENV_NUM_PROCESSES])
        kwargs["process_id"] = int(os.environ[ENV_PROCESS_ID])
    # CPU devices need a collectives implementation to talk across processes;
    # the setting concerns the CPU backend only, so it is harmless elsewhere.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    address = os.environ.get("JAX_COORDINATOR_ADDRESS", "(from the cluster environment)")
    if kwargs.get("process_id", 0) != 0 and ":" in address:
        # XLA aborts the whole process when the coordinator never answers; find
        # out first, and fail with an error that can be read and caught.
        _wait_for_coordinator(address, timeout)
    try:
        jax.distributed.initialize(**kwargs)
    except RuntimeError as exc:
        if "must be called before" in str(exc):  # JAX's backends started already
            raise RuntimeError(
                "this process is part of a multi-process job, but JAX was used before the "
                "Trainer could call jax.distributed.initialize(); create the Trainer (or call "
                "jax.distributed.initialize()) before touching jax arrays or devices"
            ) from exc
        raise _join_failed(address, timeout, exc) from exc
    except Exception as exc:
        raise _join_failed(address, timeout, exc) from exc
    _check_count(num_nodes)


def _join_failed(address: str, timeout: int, exc: Exception) -> RuntimeError:
    return RuntimeError(
        f"could not join the multi-process job through coordinator {address} within "
        f"{timeout} s: {exc}. Check that process 0 is running and the address is "
        "reachable from here"
    )


def _wait_for_coordinator(address: str, timeout_s: float) -> None:
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"could not reach the coordinator of the multi-process job at {address} "
                    f"within {timeout_s:g} s ({exc}). Check that process 0 is running and "
                    f"the address is reachable from here; {ENV_TIMEOUT} sets the wait"
                ) from None
            time.sleep(0.2)


def _check_count(num_nodes: int | None) -> None:
    if num_nodes is not None and num_nodes != jax.process_count():
        raise RuntimeError(
            f"Trainer(num_nodes={num_nodes}) but the job has {jax.process_count()} processes; "
            "run one process per node, or leave num_nodes unset"
        )


def is_rank_zero() -> bool:
    return jax.process_index() == 0


# Where a launcher says which process of its machine this is: the project's
# launcher and torchrun (LOCAL_RANK), SLURM (SLURM_LOCALID).
_LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "SLURM_LOCALID")


def local_rank() -> int:
    """This process's index among the job's processes on its machine
    (Lightning's ``local_rank``): what the launcher says, else 0."""
    for name in _LOCAL_RANK_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def broadcast(value: Any) -> Any:
    """Process 0's ``value`` on every process (a no-op when alone)."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return multihost_utils.broadcast_one_to_all(value)


def gather_ints(value: int) -> list[int]:
    """Every process's ``value``, in process order (``[value]`` when alone)."""
    if jax.process_count() == 1:
        return [int(value)]
    from jax.experimental import multihost_utils

    return [int(v) for v in multihost_utils.process_allgather(np.int64(value))]


def gather_json(value: Any) -> list[Any]:
    """Every process's JSON-able ``value``, in process order (``[value]`` when
    alone): one gather of the lengths, one of the padded bytes."""
    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    lengths = gather_ints(len(data))
    padded = np.zeros(max(lengths), np.uint8)
    padded[: len(data)] = data
    rows = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(bytes(row[:n])) for row, n in zip(rows, lengths, strict=True)]


def agree(flag: bool, *, at_sync: bool = True) -> bool:
    """A host-side condition every process acts on at the same step.

    Alone, ``flag`` itself. In a multi-process run, process 0's ``flag`` (by its
    clock, say), asked only where ``at_sync`` (a collective: the callers ask at
    logging intervals); ``False`` elsewhere.
    """
    if jax.process_count() == 1:
        return flag
    return at_sync and bool(broadcast(np.bool_(flag)))


def agree_max(value: int, *, at_sync: bool = True) -> int:
    """The largest of every process's ``value`` (a signal one process received),
    asked only where ``at_sync``; 0 elsewhere. Alone, ``value`` itself."""
    if jax.process_count() == 1:
        return value
    return max(gather_ints(value)) if at_sync else 0


def preemption_sync() -> bool:
    """Whether JAX's preemption service agrees on a stop step in this run: a
    multi-process job whose ``jax.distributed`` started it (JAX's default). It
    takes SIGTERM itself and needs no collective on the step."""
    return (
        jax.process_count() > 1
        and jax.distributed.is_initialized()
        and bool(jax.config.jax_enable_preemption_service)
    )


def reached_preemption_point(step: int) -> bool:
    """Whether every process should stop and save at ``step`` (a number every
    process gives each training step alike, increasing) after a preemption
    notice (SIGTERM) reached any of them: the step after the furthest any
    process had reached, the same on every process."""
    from jax.experimental import multihost_utils

    return multihost_utils.reached_preemption_sync_point(step)


def barrier() -> None:
    """Waits until every process reaches this point (a no-op when alone)."""
    broadcast(np.int32(0))
