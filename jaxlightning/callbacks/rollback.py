"""`Trainer(on_nonfinite="rollback")`: go back to the last good state.

A long run on real data meets a bad batch: its loss spikes or turns NaN and
the parameters follow. Under ``"rollback"`` the fit loop keeps a copy of the
train state on the devices from the last point it checked and found good (each
report, each validation or step-counted checkpoint, each epoch's end). When a
check finds a non-finite loss, or a loss spike by the `Rollback` policy's rule,
the state goes back to that copy, the batches trained on since are skipped (the
loop reads on from where it is), the learning rate is optionally lowered, and
training goes on: ``global_step`` counts good updates only, so step-keyed
schedules and dropout keys continue from the restored step. A check is a sync
the loop makes there anyway; no step pays for it.

This module holds the whole feature: the host-side policy (`Rollback`: the
spike rule, the bound on retries, the events, the transformation that lowers
the rate) and its `RollbackGuard`, the `StateGuard` the fit loop consults at
each state point, which reaches the state only through ``trainer.edit``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import optax

from jaxlightning.callbacks.base import Callback
from jaxlightning.cluster import distributed
from jaxlightning.metrics.logged import host_value
from jaxlightning.training.losses import NonFiniteLossError
from jaxlightning.training.scales import RollbackScaleState, scale_updates
from jaxlightning.training.step import LOSS_MAX

if TYPE_CHECKING:
    from jaxlightning.callbacks.view import TrainerView

ROLLBACKS = "train/rollbacks"


class Rollback(Callback):
    """The policy of ``Trainer(on_nonfinite=Rollback(...))`` (``"rollback"``:
    the defaults).

    A check fails when a loss since the last good point was not finite, or when
    `is_spike` says the largest step loss since then (``train/loss_max``, logged
    under this policy) is a spike against the losses reported before.

    Args:
        spike_factor: a step loss above ``spike_factor`` times the median of the
            last ``window`` reported losses is a spike (``None``: only
            non-finite losses roll back).
        window: how many reported (interval mean) losses the median is over.
        min_history: no spike is called before this many reports.
        max_retries: rollbacks in a row (without a good check between) before
            the fit gives up with `NonFiniteLossError`.
        lr_factor: each rollback multiplies the learning rate by this (applied
            as a scale of the updates, exact for SGD, Adam and every optimizer
            whose update is proportional to its rate); 1 keeps it.

    Attributes:
        events: one dict per rollback (``step`` where it was found, ``to_step``,
            ``reason``, ``batches_skipped``, ``epoch``, ``batch``,
            ``lr_scale``), also in every checkpoint's record.
        lr_scale: the product of the rollbacks' ``lr_factor`` so far.
    """

    def __init__(
        self,
        spike_factor: float | None = 5.0,
        window: int = 20,
        min_history: int = 5,
        max_retries: int = 3,
        lr_factor: float = 1.0,
    ) -> None:
        if spike_factor is not None and not (
            isinstance(spike_factor, (int, float)) and spike_factor > 1
        ):
            raise ValueError(f"Rollback(spike_factor={spike_factor!r}): use a number > 1 or None")
        for name, value, low in (
            ("window", window, 1),
            ("min_history", min_history, 1),
            ("max_retries", max_retries, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"Rollback({name}={value!r}): use an int >= {low}")
        if not isinstance(lr_factor, (int, float)) or not 0 < lr_factor <= 1:
            raise ValueError(f"Rollback(lr_factor={lr_factor!r}): use a number in (0, 1]")
        self.spike_factor = None if spike_factor is None else float(spike_factor)
        self.window = window
        self.min_history = min_history
        self.max_retries = max_retries
        self.lr_factor = float(lr_factor)
        self.history: list[float] = []  # reported losses of good intervals
        self.events: list[dict[str, Any]] = []
        self.lr_scale = 1.0
        self.retries = 0  # rollbacks since the last good check

    # ------------------------------------------------------------ the rule
    def is_spike(self, loss: float, history: list[float]) -> bool:
        """Whether ``loss`` (the largest step loss since the last good point)
        is a spike after the reported losses ``history`` (oldest first).
        Override for another rule."""
        if self.spike_factor is None or len(history) < self.min_history:
            return False
        median = float(np.median(history[-self.window :]))
        return median > 0 and loss > self.spike_factor * median

    def verdict(self, first_nonfinite: int, loss_max: float | None) -> str | None:
        """Why the state since the last good point is bad, or ``None``."""
        if first_nonfinite:
            return "a non-finite loss"
        if loss_max is None:
            return None
        if not math.isfinite(loss_max):
            return f"a non-finite loss ({loss_max})"
        if self.is_spike(loss_max, self.history):
            median = float(np.median(self.history[-self.window :]))
            return f"a loss spike ({loss_max:.6g} > {self.spike_factor:g} x median {median:.6g})"
        return None

    def good(self, reported_loss: float | None) -> None:
        """A check passed; ``reported_loss``: the interval's mean, at a report."""
        self.retries = 0
        if reported_loss is not None and math.isfinite(reported_loss):
            self.history = [*self.history, reported_loss][-self.window :]

    # ------------------------------------------- the optimizer and the state
    def transform_optimizer(self, tx: optax.GradientTransformation) -> Any:
        if self.lr_factor == 1.0:
            return tx
        return optax.chain(tx, scale_updates(RollbackScaleState))

    def state_guard(self, trainer: TrainerView) -> RollbackGuard:
        """The guard that applies this policy in a fit (see `StateGuard`)."""
        return RollbackGuard(self, trainer)

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": list(self.history),
            "events": [dict(e) for e in self.events],
            "lr_scale": self.lr_scale,
            "retries": self.retries,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = [float(v) for v in state.get("history", [])]
        self.events = [dict(e) for e in state.get("events", [])]
        self.lr_scale = float(state.get("lr_scale", 1.0))
        self.retries = int(state.get("retries", 0))


class RollbackGuard:
    """Keeps the last good point of a fit and goes back to it.

    The fit loop calls `checked` wherever it acts on the state (a report, a
    validation or step-counted checkpoint, an epoch's end, a signal's save):
    the accumulators it fetches there say whether a step since the last good
    point had a non-finite loss or a spike; if so the state goes back,
    otherwise the point becomes the last good one.

    Args:
        policy: the rule, the retries and the events.
        trainer: the running fit's view; its ``edit`` keeps and restores points.
    """

    def __init__(self, policy: Rollback, trainer: TrainerView) -> None:
        self.policy = policy
        self.trainer = trainer
        self._good: Any = None  # trainer.edit.save_point()
        self._good_step = 0
        self._trained_at_good = 0  # batches trained at the good point

    def mark_good(self, reported_loss: float | None = None) -> None:
        """The state now is good: keep a copy of it (``reported_loss``: the
        mean loss a report just published, for the spike rule's history)."""
        edit = self.trainer.edit
        trained = edit.batches_trained()
        if self._good is None or trained > self._trained_at_good:
            self.policy.good(reported_loss)  # trained since: a rollback streak ends
        self._good, self._good_step = edit.save_point(), self.trainer.global_step
        self._trained_at_good = trained

    def rolled_back(self, acc: Any) -> bool:
        """Goes back to the last good point if the fetched accumulators ``acc``
        show a bad step since it; whether it did."""
        loss_max = host_value(acc.metrics[LOSS_MAX]) if LOSS_MAX in acc.metrics else None
        bad = int(acc.first_nonfinite)
        reason = self.policy.verdict(bad, loss_max)
        if reason is None:
            return False
        if bad:
            step, batch = self.trainer.edit.locate(bad)
            reason += f" at step {step} (epoch {self.trainer.current_epoch}, batch {batch})"
        self._go_back(reason)
        return True

    def checked(self) -> bool:
        """Checks the state now (a sync): goes back if it is bad, else marks it
        good; whether it went back."""
        if self.rolled_back(self.trainer.edit.fetch_metrics()):
            return True
        self.mark_good()
        return False

    def _go_back(self, reason: str) -> None:
        policy, edit = self.policy, self.trainer.edit
        found, step = self.trainer.global_step, self._good_step
        policy.retries += 1
        if policy.retries > policy.max_retries:
            raise NonFiniteLossError(
                f"on_nonfinite='rollback': {reason}, found at step {found}, after "
                f"{policy.max_retries} rollbacks in a row to step {step}; giving up. Earlier "
                f"rollbacks: {policy.events[-policy.max_retries :]}. Lower the learning rate "
                "(Rollback(lr_factor=...)), clip gradients or check the data"
            )
        epoch, batch = edit.go_back(self._good)
        trained = edit.batches_trained()
        skipped, self._trained_at_good = trained - self._trained_at_good, trained
        if policy.lr_factor != 1.0:
            policy.lr_scale *= policy.lr_factor
            edit.set_optimizer_state(RollbackScaleState, scale=policy.lr_scale)
        policy.events.append(
            {
                "step": found,
                "to_step": step,
                "reason": reason,
                "batches_skipped": skipped,
                "epoch": epoch,
                "batch": batch,
                "lr_scale": policy.lr_scale,
            }
        )
        edit.publish(ROLLBACKS, float(len(policy.events)))
        if distributed.is_rank_zero():
            print(
                f"Rollback: {reason} (found at step {found}); back to step {step}, the "
                f"{skipped} batches since skipped"
                + (f", learning rate x{policy.lr_scale:g}" if policy.lr_factor != 1.0 else "")
                + f" (retry {policy.retries} of {policy.max_retries}).",
                flush=True,
            )
