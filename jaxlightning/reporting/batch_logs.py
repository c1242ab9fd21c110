"""Values a module logs in its batch hooks, reported as Lightning does.

``self.log`` in ``on_train_batch_start`` or ``on_train_batch_end`` is a host
number, logged per batch. Lightning's rules for these hooks: ``on_step=True,
on_epoch=False`` by default; a step value is the batch's own, in
``callback_metrics`` at once and sent to the loggers at the logging interval
(after the batch's end hooks); an epoch value is the mean over the epoch's
batches weighted by their rows, reported at the epoch's end; with both, the
names get ``_step`` and ``_epoch`` (the plain name holds the latest of the
two). Like the values of traced hooks, step values also go out for an
epoch's last, partial interval.

In an evaluation's batch hooks (``on_validation_batch_end``, ...) the
defaults are ``on_step=False, on_epoch=True``: the loader's row-weighted mean,
reported with the loader's values (named with its ``/dataloader_idx_N``
with several loaders); a step value goes to the loggers only, at the batch's
evaluation step, as the traced hooks' do (`EVAL`).
"""

from __future__ import annotations

import dataclasses

from jaxlightning.reporting.report import Report

HOOKS = frozenset({"on_train_batch_start", "on_train_batch_end"})
EVAL_HOOKS = frozenset(
    f"on_{stage}_batch_{when}" for stage in ("validation", "test") for when in ("start", "end")
)


@dataclasses.dataclass
class _Logged:
    on_step: bool
    on_epoch: bool
    prog_bar: bool
    logger: bool
    total: float = 0.0  # the epoch's row-weighted sum
    rows: int = 0

    def show(self, out: Report, name: str, level: str, value: float, suffix: str = "") -> str:
        """Puts ``value`` of ``level`` (``"step"``, ``"epoch"``) in ``out``'s
        ``callback_metrics`` and bar values; returns its name for the loggers."""
        key = (f"{name}_{level}" if self.on_step and self.on_epoch else name) + suffix
        out.values[key] = out.values[name + suffix] = value
        if self.prog_bar:
            out.bar[key] = value
        return key


class BatchLogs:
    """The batch hooks' logged values of the running epoch (``evaluation``: of
    the running loader of an evaluation, ``suffix`` its loader's)."""

    def __init__(self, evaluation: bool = False, suffix: str = "") -> None:
        self.evaluation, self.suffix = evaluation, suffix
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
        default = not self.evaluation  # per step in training, per epoch in evaluation
        logged = _Logged(
            on_step=default if on_step is None else on_step,
            on_epoch=(not default) if on_epoch is None else on_epoch,
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
            key = logged.show(out, name, "step", value, self.suffix)
            if logged.logger:
                self._pending[key] = value
        if self.evaluation:  # its step values reach the loggers only
            return Report()
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
            key = logged.show(out, name, "epoch", value, self.suffix)
            if logged.logger:
                out.logged[key] = out.results[key] = value
        if completed:
            self._logged = {}
        return out
