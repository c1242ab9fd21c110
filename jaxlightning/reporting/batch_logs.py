"""Values a module logs in its training batch hooks, reported as Lightning does.

``self.log`` in ``on_train_batch_start`` or ``on_train_batch_end`` is a host
number, logged per batch. Lightning's rules for these hooks: ``on_step=True,
on_epoch=False`` by default; a step value is the batch's own, in
``callback_metrics`` at once and sent to the loggers at the logging interval
(after the batch's end hooks); an epoch value is the mean over the epoch's
batches weighted by their rows, reported at the epoch's end; with both, the
names get ``_step`` and ``_epoch`` (the plain name holds the latest of the
two). Like the values of traced hooks, step values also go out for an
epoch's last, partial interval.
"""

from __future__ import annotations

import dataclasses

from jaxlightning.reporting.report import Report

HOOKS = frozenset({"on_train_batch_start", "on_train_batch_end"})


@dataclasses.dataclass
class _Logged:
    on_step: bool
    on_epoch: bool
    prog_bar: bool
    logger: bool
    total: float = 0.0  # the epoch's row-weighted sum
    rows: int = 0

    def show(self, out: Report, plain: str, level: str, value: float) -> str:
        """Puts ``value`` of ``level`` (``"step"``, ``"epoch"``) in ``out``'s
        ``callback_metrics`` and bar values; returns its name for the loggers."""
        key = f"{plain}_{level}" if self.on_step and self.on_epoch else plain
        out.values[key] = out.values[plain] = value
        if self.prog_bar:
            out.bar[key] = value
        return key


class BatchLogs:
    """The training batch hooks' logged values of the running epoch."""

    def __init__(self) -> None:
        self._logged: dict[str, _Logged] = {}
        self._pending: dict[str, float] = {}  # this batch's step values, for the loggers
        self._batch: int | None = None
        self._rows = 0

    def batch(self, batch_idx: int, rows: int) -> None:
        """Batch ``batch_idx`` (``rows`` real rows) runs its hooks; if it is a new
        one, step values are its own from now on."""
        if batch_idx != self._batch:
            self._pending, self._batch, self._rows = {}, batch_idx, rows

    def add(
        self,
        name: str,
        value: float,
        *,
        on_step: bool | None,
        on_epoch: bool | None,
        prog_bar: bool,
        logger: bool,
    ) -> Report:
        """Records a value; returns what shows at once (a step value)."""
        logged = _Logged(
            on_step=True if on_step is None else on_step,
            on_epoch=bool(on_epoch),
            prog_bar=prog_bar,
            logger=logger,
        )
        before = self._logged.get(name)
        if before is not None:
            logged.total, logged.rows = before.total, before.rows
        self._logged[name] = logged
        out = Report()
        if logged.on_epoch:
            logged.total += value * self._rows
            logged.rows += self._rows
        if logged.on_step:
            key = logged.show(out, name, "step", value)
            if logged.logger:
                self._pending[key] = value
        return out

    def step_report(self) -> Report:
        """The batch's step values for the loggers (sent once)."""
        out = Report(logged=self._pending)
        self._pending = {}
        return out

    def epoch_end(self, completed: bool) -> Report:
        """The last batch's step values (if not reported) and the epoch values:
        row-weighted means of what was logged so far (a ``completed`` epoch then
        starts over)."""
        out, self._batch = self.step_report(), None
        for name, logged in self._logged.items():
            if not logged.on_epoch or not logged.rows:
                continue
            value = logged.total / logged.rows
            key = logged.show(out, name, "epoch", value)
            if logged.logger:
                out.logged[key] = value
        if completed:
            self._logged = {}
        return out
