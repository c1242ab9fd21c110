"""`EarlyStopping`: stop training when a monitored metric stops improving."""

from __future__ import annotations

import enum
import math
from typing import TYPE_CHECKING, Any

import jax

from jaxlightning.callbacks.base import Callback
from jaxlightning.cluster import distributed
from jaxlightning.metrics.logged import monitored

if TYPE_CHECKING:
    from jaxlightning.callbacks.view import TrainerView
    from jaxlightning.module import JaxModule

# How validation values are named (`val/loss`, `val_loss`, ...): the reporter's stage words.
_VALIDATION_PREFIXES = tuple(f"{w}{s}" for w in ("val", "valid", "validation") for s in "_/")


class EarlyStoppingReason(enum.Enum):
    """Why `EarlyStopping` stopped a fit (Lightning's members and values)."""

    NOT_STOPPED = 0
    STOPPING_THRESHOLD = 1
    DIVERGENCE_THRESHOLD = 2
    PATIENCE_EXHAUSTED = 3
    NON_FINITE_METRIC = 4


class EarlyStopping(Callback):
    """Sets ``trainer.should_stop`` when ``monitor`` has not improved for
    ``patience`` checks, as Lightning's callback of the same name does.

    When it checks: by default (``check_on_train_epoch_end=None``) it decides
    when `fit` starts, as Lightning does: with validation once per epoch
    (``val_check_interval=1.0``, ``check_val_every_n_epoch=1``, the defaults,
    and also when there is no validation at all) at the end of each training
    epoch, after that epoch's validation and after the module's
    ``on_train_epoch_end`` (so values logged there count); otherwise after each
    validation. ``True`` or ``False`` choose the one or the other. Checks happen
    only in `fit`, never in the sanity check, and not with ``fast_dev_run``.
    A stop takes effect before the next step, once ``min_epochs``/``min_steps``
    are reached. Several instances work side by side: any one stops the fit.
    Each one's state (best score, checks without improvement, why it stopped)
    is saved in checkpoints apart from the others', so a resumed run stops
    where an uninterrupted one would.

    A ``monitor`` named as a validation value (``val/...``, ``val_...``) that the
    sanity check's validation did not produce raises there, before any
    training, when ``strict`` (Lightning would raise only at the first check,
    after an epoch of training). A module that logs it only after the sanity
    check needs ``strict=False``.

    Args:
        monitor: a name in ``trainer.callback_metrics``, e.g. ``"val_loss"``.
        min_delta: the least change that counts as an improvement.
        patience: checks without improvement before stopping.
        verbose: print each improvement and why it stops.
        mode: ``"min"`` or ``"max"``.
        strict: raise `RuntimeError` if ``monitor`` is missing at a check (else
            skip the check).
        check_finite: stop when the value is NaN or infinite.
        stopping_threshold: stop as soon as the value is better than this.
        divergence_threshold: stop as soon as the value is worse than this.
        check_on_train_epoch_end: check at training epoch ends (``True``), after
            validations (``False``), or decide from the Trainer (``None``, above).
        log_rank_zero_only: with ``verbose`` in a multi-process run, only
            process 0 prints (else every process, its rank in front).

    Attributes:
        best_score: the best value seen.
        wait_count: checks since it last improved.
        stopped_epoch: the epoch in which it stopped training (0 if it did not).
        stopping_reason: an `EarlyStoppingReason`.
        stopping_reason_message: why it stopped, in words (``None`` if it did not).
    """

    def __init__(
        self,
        monitor: str,
        min_delta: float = 0.0,
        patience: int = 3,
        verbose: bool = False,
        mode: str = "min",
        strict: bool = True,
        check_finite: bool = True,
        stopping_threshold: float | None = None,
        divergence_threshold: float | None = None,
        check_on_train_epoch_end: bool | None = None,
        log_rank_zero_only: bool = False,
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(
                f"EarlyStopping(mode={mode!r}): `mode` can be 'min' or 'max', got {mode}"
            )
        if patience < 0:
            raise ValueError(f"EarlyStopping(patience={patience}): use 0 or more")
        self.monitor, self.mode = monitor, mode
        self.min_delta, self.patience = abs(min_delta), patience
        self.strict, self.check_finite = strict, check_finite
        self.stopping_threshold = stopping_threshold
        self.divergence_threshold = divergence_threshold
        self.check_on_train_epoch_end = check_on_train_epoch_end
        self.verbose, self.log_rank_zero_only = verbose, log_rank_zero_only
        self.best_score = math.inf if mode == "min" else -math.inf
        self.wait_count = 0
        self.stopped_epoch = 0
        self.stopping_reason = EarlyStoppingReason.NOT_STOPPED
        self.stopping_reason_message: str | None = None
        self._at_epoch_end = bool(check_on_train_epoch_end)  # decided in setup("fit")

    @property
    def state_key(self) -> str:
        """Lightning's identifier of its state: the class with ``monitor`` and ``mode``."""
        return type(self).__qualname__ + repr({"monitor": self.monitor, "mode": self.mode})

    # ---------------------------------------------------------------- hooks
    def setup(self, trainer: TrainerView, module: JaxModule, stage: str) -> None:
        if stage == "fit":
            self._at_epoch_end = self._checks_at_epoch_end(trainer)

    def _checks_at_epoch_end(self, trainer: TrainerView) -> bool:
        """Lightning's rule for ``check_on_train_epoch_end=None``: at the epoch's
        end when validation (if any) runs once per epoch, at its end."""
        if self.check_on_train_epoch_end is not None:
            return self.check_on_train_epoch_end
        interval = trainer.val_check_interval
        once = isinstance(interval, float) and interval == 1.0
        return once and trainer.check_val_every_n_epoch == 1

    def on_validation_end(self, trainer: TrainerView, module: JaxModule) -> None:
        if trainer.stage != "fit":
            return
        if trainer.sanity_checking:
            self._check_sanity_values(trainer)
        elif not self._at_epoch_end:
            self._check(trainer)

    def on_train_epoch_end(self, trainer: TrainerView, module: JaxModule) -> None:
        if self._at_epoch_end and trainer.stage == "fit" and trainer.epoch_completed:
            self._check(trainer)

    # ---------------------------------------------------------------- checks
    def _missing(self, trainer: TrainerView) -> str:
        """The error for a ``monitor`` not in ``callback_metrics``."""
        have = ", ".join(f"`{name}`" for name in trainer.callback_metrics) or "(none)"
        return (
            f"Early stopping conditioned on metric `{self.monitor}` which is not available. "
            f"Available metrics: {have}. Monitor one of them, or pass strict=False to skip "
            "the checks that lack it"
        )

    def _check_sanity_values(self, trainer: TrainerView) -> None:
        """Before any training: a validation value the sanity check did not log
        will not be logged by later validations either."""
        monitor = self.monitor
        if not self.strict or trainer.fast_dev_run or not monitor.startswith(_VALIDATION_PREFIXES):
            return
        if monitor not in trainer.callback_metrics:
            raise RuntimeError(
                f"{self._missing(trainer)} (found by the sanity check's validation, before "
                "training; a value logged only after the sanity check also needs strict=False)"
            )

    def _check(self, trainer: TrainerView) -> None:
        if trainer.fast_dev_run:  # a smoke test of the run, not one to judge (Lightning's rule)
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            if self.strict:
                raise RuntimeError(self._missing(trainer))
            if self.verbose:
                self._say(self._missing(trainer))
            return
        message = self.decide(monitored(value, f"EarlyStopping(monitor={self.monitor!r})"))
        # every process stops if any one decides to (values logged on the host may differ)
        if distributed.agree_max(int(bool(message))):
            self.stopped_epoch = trainer.current_epoch
            trainer.should_stop = True

    def decide(self, value: float) -> str:
        """Updates the state with a new ``value``; returns why to stop ("" to go on).

        Sets `stopping_reason` and `stopping_reason_message` when it says stop.
        """
        reason, message = self._judge(value)
        if reason is EarlyStoppingReason.NOT_STOPPED:
            if message:
                self._say(message)
            return ""
        self.stopping_reason, self.stopping_reason_message = reason, message
        self._say(message)
        return message

    def _better(self, value: float, than: float) -> bool:
        return value < than if self.mode == "min" else value > than

    def _judge(self, value: float) -> tuple[EarlyStoppingReason, str]:
        """The reason to stop at ``value`` (or `NOT_STOPPED`), with a message;
        counts a check without improvement."""
        name, best = self.monitor, self.best_score
        sign = "<" if self.mode == "min" else ">"
        if self.check_finite and not math.isfinite(value):
            return EarlyStoppingReason.NON_FINITE_METRIC, (
                f"Monitored metric {name} = {value} is not finite; the best was {best:.3f}"
            )
        if self.stopping_threshold is not None and self._better(value, self.stopping_threshold):
            return EarlyStoppingReason.STOPPING_THRESHOLD, (
                f"Stopping threshold reached: {name} = {value:.6g} {sign} {self.stopping_threshold}"
            )
        if self.divergence_threshold is not None and self._better(self.divergence_threshold, value):
            return EarlyStoppingReason.DIVERGENCE_THRESHOLD, (
                f"Divergence threshold reached: {name} = {value:.6g} is past "
                f"{self.divergence_threshold}"
            )
        shift = -self.min_delta if self.mode == "min" else self.min_delta
        if self._better(value, best + shift):
            self.best_score, self.wait_count = value, 0
            gain = f" by {abs(best - value):.3f}" if math.isfinite(best) else ""
            return EarlyStoppingReason.NOT_STOPPED, (
                f"Metric {name} improved{gain}; new best score {value:.3f}"
            )
        self.wait_count += 1
        if self.wait_count >= self.patience:
            return EarlyStoppingReason.PATIENCE_EXHAUSTED, (
                f"Monitored metric {name} did not improve by more than {self.min_delta} in the "
                f"last {self.wait_count} checks; best score {best:.3f}"
            )
        return EarlyStoppingReason.NOT_STOPPED, ""

    def _say(self, message: str) -> None:
        """Prints ``message`` with ``verbose`` (with the rank in multi-process runs)."""
        if not self.verbose:
            return
        if jax.process_count() == 1:
            print(f"EarlyStopping: {message}", flush=True)
        elif distributed.is_rank_zero() or not self.log_rank_zero_only:
            print(f"[rank: {jax.process_index()}] EarlyStopping: {message}", flush=True)

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "best_score": self.best_score,
            "wait_count": self.wait_count,
            "stopped_epoch": self.stopped_epoch,
            "stopping_reason": self.stopping_reason.value,
            "stopping_reason_message": self.stopping_reason_message,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores `state_dict`'s values (a record without the reason: not stopped)."""
        self.best_score = float(state["best_score"])
        self.wait_count = int(state["wait_count"])
        self.stopped_epoch = int(state["stopped_epoch"])
        self.stopping_reason = EarlyStoppingReason(
            state.get("stopping_reason", EarlyStoppingReason.NOT_STOPPED.value)
        )
        self.stopping_reason_message = state.get("stopping_reason_message")
