"""Running under SLURM: save and requeue before the time limit, resume on restart.

With ``#SBATCH --signal=USR1@90`` SLURM sends SIGUSR1 90 seconds before the
job's time limit. Under a SLURM batch job (``SLURM_JOB_ID`` set, not an
interactive ``srun bash``) the Trainer treats it as Lightning's
``SLURMEnvironment(auto_requeue=True)`` does: it stops at the next step, saves
a resume point with every `ModelCheckpoint`, requeues the job with
``scontrol requeue $SLURM_JOB_ID`` (process 0) and exits. The requeued job
starts with ``SLURM_RESTART_COUNT`` > 0, and its ``fit`` without a
``ckpt_path`` resumes from ``"last"``. ``JAXLIGHTNING_SLURM_REQUEUE=0`` turns
this off.

Which process is which, and the coordinator, come from SLURM's own variables
through ``jax.distributed``'s cluster detection (`jaxlightning.cluster.distributed`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

REQUEUE_SIGNAL = signal.SIGUSR1


def job_id() -> str | None:
    """The SLURM batch job this process belongs to, if any (interactive jobs,
    whose name is ``bash`` or ``interactive``, are not requeued)."""
    if os.environ.get("JAXLIGHTNING_SLURM_REQUEUE", "1") == "0":
        return None
    job = os.environ.get("SLURM_JOB_ID")
    if not job or os.environ.get("SLURM_JOB_NAME") in ("bash", "interactive"):
        return None
    return os.environ.get("SLURM_ARRAY_JOB_ID", job) + (
        f"_{os.environ['SLURM_ARRAY_TASK_ID']}" if "SLURM_ARRAY_TASK_ID" in os.environ else ""
    )


def restarted() -> bool:
    """Whether this job was requeued (``SLURM_RESTART_COUNT`` > 0)."""
    return int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0 and job_id() is not None


def requeue(job: str) -> str:
    """``scontrol requeue JOB``; returns what to print about it."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return f"SLURM job {job}: no scontrol on PATH, not requeued"
    done = subprocess.run(
        [scontrol, "requeue", job], capture_output=True, text=True, timeout=60, check=False
    )
    if done.returncode:
        return f"SLURM job {job}: `scontrol requeue {job}` failed: {done.stderr.strip()}"
    return f"SLURM job {job} requeued"
