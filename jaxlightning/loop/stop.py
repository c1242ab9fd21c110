"""The stop policy: when a fit stops, agreed by every process at one step.

Limits (``max_steps``, ``max_epochs``), ``trainer.should_stop`` (held back by
``min_epochs``/``min_steps``; `Timer`, which ``max_time`` adds, asks through it)
and SIGTERM/SIGINT. In a multi-process run every process must stop at the same
step, so host-side conditions (SIGINT on one process) are agreed through
`jaxlightning.cluster.distributed` at logging intervals; SIGTERM (a preemption notice)
through JAX's preemption service at the next step.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

from jaxlightning.cluster import distributed, slurm
from jaxlightning.cluster.rank_zero import rank_zero_info
from jaxlightning.loop.signals import StopRequest
from jaxlightning.progress import Progress
from jaxlightning.schedule import Schedule


class StopPolicy:
    """Answers "stop now?" for the fit loop.

    Attributes:
        should_stop: a stop requested by a callback or the module (`EarlyStopping`,
            `Timer`); takes effect once ``min_epochs`` and ``min_steps`` are reached.
        signum: the stop signal every process acts on (0: none).
    """

    def __init__(self, schedule: Schedule, progress: Progress) -> None:
        self.schedule = schedule
        self.progress = progress
        self.should_stop = False
        self.signum = 0
        self._request = StopRequest()
        self._steps = 0  # train steps polled in this fit: the preemption step ids
        self._preemption = False  # JAX's preemption service takes SIGTERM (this fit)
        self._held_back = False  # told that min_epochs/min_steps hold a stop back

    def reset(self) -> None:
        """A new fit: nothing requested yet."""
        self.should_stop = self._held_back = False
        self.signum = 0
        self._steps = 0

    @contextmanager
    def watching_signals(self) -> Iterator[None]:
        """While active, SIGTERM/SIGINT request a stop at the next step instead of
        killing. Where JAX's preemption service runs (several processes) SIGTERM
        is left to it: every process learns of it and stops at the same step,
        the next one after the signal (`poll_signal`)."""
        self._preemption = preemption = distributed.preemption_sync()
        self._request.signals = (signal.SIGINT,) if preemption else StopRequest.SIGNALS
        self._request.requeue_signal = slurm.REQUEUE_SIGNAL if slurm.job_id() else None
        self._request.forward_to_sigterm = preemption
        with self._request:
            yield

    @property
    def received_sigterm(self) -> bool:
        """This process received SIGTERM (during a fit of this Trainer)."""
        return self._request.received_sigterm or self.signum == signal.SIGTERM

    @property
    def requeue(self) -> bool:
        """SLURM's requeue signal reached this process: requeue after saving."""
        return self._request.requeue

    def step_limit_reached(self) -> bool:
        return self.schedule.step_limit_reached(self.progress.global_step)

    def poll_signal(self, at_sync: bool) -> None:
        """Takes in a signal received since the last step, once per train step
        (alone: at once; across processes: SIGTERM and SIGINT, which is handed
        to it as SIGTERM, at the preemption service's agreed step, without a
        collective; the process that got SIGINT reports it as such)."""
        self._steps += 1
        if self._preemption and distributed.reached_preemption_point(self._steps):
            self.signum = self._request.signum or signal.SIGTERM
            return
        self.signum = distributed.agree_max(self._request.signum or 0, at_sync=at_sync)

    def before_batch(self) -> bool:
        """Whether the epoch stops before its next batch (and the fit with it)."""
        if self.signum or self.step_limit_reached() or self.stopping():
            self.should_stop = True
            return True
        return False

    def stopping(self) -> bool:
        """Whether a requested stop takes effect now: ``should_stop`` waits for
        ``min_epochs``/``min_steps``."""
        if not self.should_stop:
            return False
        # current_epoch counts completed epochs (it moves on once one completes)
        if self.schedule.may_stop(self.progress.current_epoch, self.progress.global_step):
            return True
        if not self._held_back:  # said once, as Lightning says it
            self._held_back = True
            rank_zero_info(
                "Trainer was signaled to stop but the required "
                f"`min_epochs={self.schedule.min_epochs}` or "
                f"`min_steps={self.schedule.min_steps}` has not been met. Training will "
                "continue..."
            )
        return False

    def exit_for_signal(self, saved: list[str]) -> NoReturn:
        """Says what the stop signal's save left (``saved``: the checkpoint
        paths written for it), requeues a SLURM job that asked for it, and exits
        with the signal's status."""
        signum, step = self.signum, self.progress.global_step
        name = signal.Signals(signum).name
        if not distributed.is_rank_zero():
            pass
        elif saved:
            print(
                f"Received {name} at step {step}: saved {saved[0]}. Resume with "
                "trainer.fit(model, ..., ckpt_path='last') (or that path).",
                flush=True,
            )
        else:
            print(f"Received {name} at step {step}: no ModelCheckpoint, nothing saved.", flush=True)
        job = slurm.job_id()
        if self.requeue and job is not None and distributed.is_rank_zero():
            print(slurm.requeue(job), flush=True)
        raise SystemExit(128 + signum)
