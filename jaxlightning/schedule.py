"""When things happen in a fit: validation timing, batch limits, stop conditions.

Pure Python and host-side, asked by the loop ("validate now? how many batches?
may it stop?"), so each rule is unit-tested without JAX and the loop stays a
short story. Lightning's argument names and meanings.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import re
from typing import Any

_DURATION = re.compile(r"(\d+):(\d{1,2}):(\d{1,2}):(\d{1,2})")


def is_duration(value: Any) -> bool:
    """Whether ``value`` is written as a duration (a ``timedelta``, a dict of its
    keywords, or ``"DD:HH:MM:SS"``) rather than a number."""
    return isinstance(value, (datetime.timedelta, dict, str))


def parse_max_time(
    value: Any, name: str = "max_time", minimum: float | None = None
) -> float | None:
    """``max_time`` (or another duration, ``name``) in seconds: ``"DD:HH:MM:SS"``,
    a dict of `datetime.timedelta` keywords, a ``timedelta``, or ``None``.
    Positive, or at least ``minimum`` where one is given."""
    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, dict):
        try:
            seconds = datetime.timedelta(**value).total_seconds()
        except TypeError as exc:
            raise ValueError(f"{name}={value!r}: {exc}") from None
    elif isinstance(value, str) and (match := _DURATION.fullmatch(value.strip())):
        days, hours, minutes, secs = (int(g) for g in match.groups())
        seconds = datetime.timedelta(days, secs, minutes=minutes, hours=hours).total_seconds()
    else:
        raise ValueError(
            f"{name}={value!r}: use 'DD:HH:MM:SS', a dict such as {{'hours': 1}}, or a "
            "datetime.timedelta"
        )
    if minimum is None and seconds <= 0:
        raise ValueError(f"{name}={value!r}: must be positive")
    if minimum is not None and seconds < minimum:
        raise ValueError(f"{name}={value!r}: must be at least {minimum} seconds")
    return seconds


def limited(name: str, available: int | None, limit: int | float | None) -> int | None:
    """How many of ``available`` batches a ``limit_*_batches`` value allows.

    An int is a count, a float in [0, 1] a fraction of the loader's length;
    ``None`` (or 1.0) allows them all. ``None`` comes back when the count is
    unknown (a loader without a length and no int limit).
    """
    if limit is None or (isinstance(limit, float) and limit == 1.0):
        return available
    if isinstance(limit, float):
        if available is None:
            raise ValueError(
                f"{name}={limit}: a fraction needs a loader with a length; give a count instead"
            )
        return int(available * limit)
    return limit if available is None else min(limit, available)


def check_limit(name: str, value: Any) -> int | float | None:
    """A ``limit_*_batches`` or ``overfit_batches`` value, checked."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}={value!r}: use a batch count (int) or a fraction (float)")
    if isinstance(value, float) and not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}={value}: a fraction must be in [0, 1]")
    if isinstance(value, int) and value < 0:
        raise ValueError(f"{name}={value}: a count must be >= 0")
    return value


@dataclasses.dataclass
class Schedule:
    """The Trainer's answers to "when": validation, limits and stopping.

    Attributes:
        max_epochs: ``None`` for no epoch limit.
        max_steps: ``-1`` for no step limit.
        min_epochs, min_steps: a stop requested earlier (``should_stop``,
            `EarlyStopping`) waits until both are reached.
        val_check_interval: float: validate every this fraction of an epoch's
            batches; int: every this many training batches (per epoch, or across
            epochs with ``check_val_every_n_epoch=None``), counted in batches,
            not optimizer updates, as in Lightning.
        val_check_seconds: validate whenever this much training time has
            passed since the last validation (Lightning 2.6's duration form of
            ``val_check_interval``); the batch rule is then off.
        check_val_every_n_epoch: validate in every this-many-th epoch (``None``:
            count batches across epochs, see above).
        limit_train_batches, limit_val_batches, limit_test_batches,
        limit_predict_batches: counts or fractions of each loader.
    """

    max_epochs: int | None = None
    max_steps: int = -1
    min_epochs: int = 0
    min_steps: int = 0
    val_check_interval: int | float = 1.0
    val_check_seconds: float | None = None
    check_val_every_n_epoch: int | None = 1
    limit_train_batches: int | float | None = None
    limit_val_batches: int | float | None = None
    limit_test_batches: int | float | None = None
    limit_predict_batches: int | float | None = None

    def __post_init__(self) -> None:
        v = self.val_check_interval
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise ValueError(f"val_check_interval={v!r}: use a fraction in (0, 1] or a count")
        if isinstance(v, float) and v > 1.0:
            raise ValueError(f"val_check_interval={v}: a fraction must be in (0, 1]")
        timed = self.val_check_seconds is not None
        if self.check_val_every_n_epoch is None and not isinstance(v, int) and not timed:
            raise ValueError(
                "check_val_every_n_epoch=None needs an int val_check_interval (validate every "
                "N training batches across epochs) or a duration"
            )
        if self.max_epochs is not None and self.min_epochs > self.max_epochs:
            raise ValueError(f"min_epochs={self.min_epochs} > max_epochs={self.max_epochs}")

    @classmethod
    def from_trainer_args(
        cls,
        *,
        limits: dict[str, Any],
        overfit_batches: Any,
        fast_dev_run: int,
        val_check_interval: int | float | None,
        **rules: Any,
    ) -> Schedule:
        """The schedule of the Trainer's arguments: ``limits`` (``limit_*_batches``
        by name) checked; ``overfit_batches`` limits training and validation to
        the first batches; ``fast_dev_run=n`` runs ``n`` batches of everything
        (one epoch, validation at its end)."""
        limits = {name: check_limit(name, value) for name, value in limits.items()}
        overfit = check_limit("overfit_batches", overfit_batches) or None
        if overfit is not None:  # the first batches, unshuffled, for training and validation
            limits["limit_train_batches"] = limits["limit_val_batches"] = overfit
        if fast_dev_run:
            rules.update(max_epochs=1, max_steps=fast_dev_run)
            val_check_interval = 1.0
            limits = dict.fromkeys(limits, fast_dev_run)
        interval = 1.0 if val_check_interval is None else val_check_interval
        seconds = None
        if is_duration(interval):
            seconds = parse_max_time(interval, "val_check_interval")
            interval = 1.0
        return cls(**rules, val_check_interval=interval, val_check_seconds=seconds, **limits)

    # ------------------------------------------------------------- batches
    def batches(self, stage: str, available: int | None) -> int | None:
        """Batches of a ``stage`` loader with ``available`` batches to run."""
        limit = {
            "train": self.limit_train_batches,
            "validation": self.limit_val_batches,
            "test": self.limit_test_batches,
            "predict": self.limit_predict_batches,
        }[stage]
        name = "limit_val_batches" if stage == "validation" else f"limit_{stage}_batches"
        return limited(name, available, limit)

    # ---------------------------------------------------------- validation
    def _every(self, epoch_batches: int | None) -> int | None:
        """Batches between validations within an epoch (``None``: at its end)."""
        v = self.val_check_interval
        if isinstance(v, int):
            if epoch_batches is not None and v > epoch_batches and self.check_val_every_n_epoch:
                raise ValueError(
                    f"val_check_interval={v} is more than the {epoch_batches} training batches "
                    "of an epoch; lower it, or set check_val_every_n_epoch=None to count "
                    "batches across epochs"
                )
            return v
        if epoch_batches is None:
            return None  # a fraction of an unknown length: once, at the end
        return max(1, int(epoch_batches * v))

    def _epoch_validates(self, epoch: int) -> bool:
        n = self.check_val_every_n_epoch
        return n is None or (epoch + 1) % n == 0

    def validate_after_batch(
        self, epoch: int, done: int, epoch_batches: int | None, total_batches: int
    ) -> bool:
        """Validate after the ``done``-th batch of ``epoch`` (1-based), the
        ``total_batches``-th of the fit? (By batches; a duration decides by time.)"""
        if self.val_check_seconds is not None:
            return False
        if self.check_val_every_n_epoch is None:
            return total_batches % self.val_check_interval == 0
        if not self._epoch_validates(epoch):
            return False
        every = self._every(epoch_batches)
        return every is not None and done % every == 0

    def validate_at_epoch_end(self, epoch: int, epoch_batches: int | None) -> bool:
        """Validate at the end of ``epoch`` when the batch rule could not say
        (a loader of unknown length with a fractional interval)?"""
        if self.check_val_every_n_epoch is None or not self._epoch_validates(epoch):
            return False
        if self.val_check_seconds is not None:
            return False
        return epoch_batches is None and isinstance(self.val_check_interval, float)

    def validates_in(self, epoch: int) -> bool:
        """Whether ``epoch`` may validate at all (``check_val_every_n_epoch``)."""
        return self._epoch_validates(epoch)

    # ------------------------------------------------------------ stopping
    def step_limit_reached(self, global_step: int) -> bool:
        return self.max_steps >= 0 and global_step >= self.max_steps

    def may_stop(self, epochs_done: int, global_step: int) -> bool:
        """Whether a requested stop may take effect (``min_epochs``/``min_steps``)."""
        return epochs_done >= self.min_epochs and global_step >= self.min_steps

    def estimated_steps(self, epoch_batches: int | None) -> float:
        """Optimizer steps the fit will take (``inf`` when unbounded)."""
        by_epochs = (
            math.inf
            if self.max_epochs is None or epoch_batches is None
            else self.max_epochs * epoch_batches
        )
        by_steps = math.inf if self.max_steps < 0 else self.max_steps
        return min(by_epochs, by_steps)
