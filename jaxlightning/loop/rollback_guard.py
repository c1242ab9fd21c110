"""The fit loop's part of ``on_nonfinite="rollback"``: the last good state,
the checks against it, and going back to it (the policy is
`jaxlightning.callbacks.rollback.Rollback`)."""

from __future__ import annotations

from typing import Any

from jaxlightning.callbacks.rollback import Rollback, RollbackScaleState
from jaxlightning.cluster import distributed
from jaxlightning.loop.held_state import HeldState, NonFiniteLossError
from jaxlightning.loop.progress import Progress
from jaxlightning.loop.report import Report
from jaxlightning.loop.reporter import Reporter
from jaxlightning.metrics.logged import host_value
from jaxlightning.training.step import LOSS_MAX

ROLLBACKS = "train/rollbacks"


class RollbackGuard:
    """Keeps the last good point of a fit and goes back to it.

    The fit loop calls `checked` wherever it acts on the state (a report, a
    validation or step-counted checkpoint, an epoch's end, a signal's save):
    the accumulators it fetches there say whether a step since the last good
    point had a non-finite loss or a spike; if so the state goes back,
    otherwise the point becomes the last good one.

    Args:
        policy: the rule, the retries and the events.
        held: the state (its copies are the good points).
        progress: rewound on a rollback (``global_step``; not the data position).
        reporter: gets ``train/rollbacks``.
    """

    def __init__(
        self, policy: Rollback, held: HeldState, progress: Progress, reporter: Reporter
    ) -> None:
        self.policy = policy
        self.held = held
        self.progress = progress
        self.reporter = reporter
        self._good: Any = None  # (snapshot, global_step, micro)
        self._trained_at_good = 0  # progress.total_batches at the good point

    def mark_good(self, reported_loss: float | None = None) -> None:
        """The state now is good: keep a copy of it (``reported_loss``: the
        mean loss a report just published, for the spike rule's history)."""
        progress = self.progress
        if self._good is None or progress.total_batches > self._trained_at_good:
            self.policy.good(reported_loss)  # trained since: a rollback streak ends
        self._good = (self.held.snapshot(), progress.global_step, progress.micro)
        self._trained_at_good = progress.total_batches

    def rolled_back(self, acc: Any) -> bool:
        """Goes back to the last good point if the fetched accumulators ``acc``
        show a bad step since it; whether it did."""
        loss_max = host_value(acc.metrics[LOSS_MAX]) if LOSS_MAX in acc.metrics else None
        bad = int(acc.first_nonfinite)
        reason = self.policy.verdict(bad, loss_max)
        if reason is None:
            return False
        if bad:
            step, batch = self.progress.where(bad)
            reason += f" at step {step} (epoch {self.progress.current_epoch}, batch {batch})"
        self._go_back(reason)
        return True

    def checked(self) -> bool:
        """Checks the state now (a sync): goes back if it is bad, else marks it
        good; whether it went back."""
        if self.rolled_back(self.held.fetch_metrics()):
            return True
        self.mark_good()
        return False

    def _go_back(self, reason: str) -> None:
        policy, progress = self.policy, self.progress
        snapshot, step, micro = self._good
        found = progress.global_step
        policy.retries += 1
        if policy.retries > policy.max_retries:
            raise NonFiniteLossError(
                f"on_nonfinite='rollback': {reason}, found at step {found}, after "
                f"{policy.max_retries} rollbacks in a row to step {step}; giving up. Earlier "
                f"rollbacks: {policy.events[-policy.max_retries :]}. Lower the learning rate "
                "(Rollback(lr_factor=...)), clip gradients or check the data"
            )
        self.held.restore(snapshot)
        skipped = progress.total_batches - self._trained_at_good
        self._trained_at_good = progress.total_batches  # the batches since are not in it
        progress.global_step, progress.micro = step, micro
        epoch, batch = progress.position
        done = batch if epoch == progress.current_epoch else 0
        progress.epoch_offset = step * progress.accumulate + micro - done
        if policy.lr_factor != 1.0:
            policy.lr_scale *= policy.lr_factor
            self.held.set_optimizer_state(RollbackScaleState, scale=policy.lr_scale)
        policy.events.append(
            {
                "step": found,
                "to_step": step,
                "reason": reason,
                "batches_skipped": skipped,
                "epoch": progress.current_epoch,
                "batch": done,
                "lr_scale": policy.lr_scale,
            }
        )
        count = float(len(policy.events))
        self.reporter.publish(Report(values={ROLLBACKS: count}, logged={ROLLBACKS: count}))
        if distributed.is_rank_zero():
            print(
                f"Rollback: {reason} (found at step {found}); back to step {step}, the "
                f"{skipped} batches since skipped"
                + (f", learning rate x{policy.lr_scale:g}" if policy.lr_factor != 1.0 else "")
                + f" (retry {policy.retries} of {policy.max_retries}).",
                flush=True,
            )
