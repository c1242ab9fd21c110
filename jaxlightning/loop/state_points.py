"""Where the fit loop lets the host act on the train state, and who listens.

The fit loop announces each *state point* through one `StatePoints`: the
start of training, a report (a logging interval's or an epoch's last), a use
of the state (a validation, a checkpoint a callback asked for, a stop
signal's save) and the stop signal itself. Features subscribe here, through
the callbacks' `Extensions`, instead of adding branches to the loop:

- ``wants_state_at(step)``: a dispatch of several steps ends at that update
  (`ModelCheckpoint`'s ``every_n_train_steps``);
- ``on_stop_signal(trainer, module)``: a resume point saved when
  SIGTERM/SIGINT stops the fit (`ModelCheckpoint`);
- ``state_guard(trainer)``: a `StateGuard` built when training starts, which
  checks the state at every point and may send it back (`jl.Rollback`).
"""

from __future__ import annotations

from typing import Any

from jaxlightning.callbacks.base import StateGuard
from jaxlightning.loop.hooks import Hooks


class StatePoints:
    """The fit loop's state points and their subscribers.

    Args:
        hooks: the callbacks (their `Extensions` subscribe) and the view they
            receive.
    """

    def __init__(self, hooks: Hooks) -> None:
        self.hooks = hooks
        self.guards: list[StateGuard] = []

    def wants_state_at(self, step: int) -> bool:
        """Whether a subscriber acts on the state after update ``step`` (a
        dispatch of several steps then ends there)."""
        return any(wants(step) for _, wants in self.hooks.extensions.wants_state_at)

    def start(self) -> None:
        """Training starts from the state as it is: the guards are built here."""
        view = self.hooks.view
        self.guards = [make(view) for _, make in self.hooks.extensions.state_guard]
        for guard in self.guards:
            guard.mark_good()

    def before_use(self) -> None:
        """A validation, a checkpoint or a signal's save is about to read the state."""
        for guard in self.guards:
            guard.checked()

    def rolled_back(self, acc: Any) -> bool:
        """At a report, with its fetched accumulators: whether a guard sent the
        state back (the report's values then went with it)."""
        return any(guard.rolled_back(acc) for guard in self.guards)

    def reported(self, loss: float | None) -> None:
        """A report fetched ``loss`` (its interval's mean of what ``loss()``
        returned, reported or not): the state is good."""
        for guard in self.guards:
            guard.mark_good(loss)

    def stop_signal(self, module: Any) -> list[str]:
        """A stop signal ends the fit here: the state is checked, then each
        subscriber saves its resume point; the paths saved."""
        self.before_use()
        paths = []
        for _, save in self.hooks.extensions.on_stop_signal:
            path = save(self.hooks.view, module)
            if path is not None:
                paths.append(path)
        return paths
