"""Where the fit loop lets the host act on the train state, and who listens.

The fit loop announces each *state point* through one `StatePoints`: the
start of training, a report (a logging interval's or an epoch's last), a use
of the state (a validation, a checkpoint a callback asked for, a stop
signal's save) and the stop signal itself. Features subscribe here instead
of adding branches to the loop:

- a callback with ``wants_state_at(step) -> bool`` gets the state of exactly
  that update: a dispatch of several steps ends there (`ModelCheckpoint`'s
  ``every_n_train_steps``);
- a callback with ``on_stop_signal(trainer, module) -> str | None`` saves a
  resume point when SIGTERM/SIGINT stops the fit (`ModelCheckpoint`);
- a `StateGuard` checks the state at every point and may send it back
  (`RollbackGuard`, ``on_nonfinite="rollback"``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from jaxlightning.loop.hooks import Hooks


class StateGuard(Protocol):
    """Watches the state at each point; may send it back to an earlier one."""

    def mark_good(self, reported_loss: float | None = None) -> None:
        """The state now (after a report of ``reported_loss``) is good."""

    def rolled_back(self, acc: Any) -> bool:
        """Whether the fetched accumulators ``acc`` sent the state back."""

    def checked(self) -> bool:
        """Checks the state now (fetching what it needs); whether it went back."""


class StatePoints:
    """The fit loop's state points and their subscribers.

    Args:
        hooks: the callbacks (those with ``wants_state_at`` or
            ``on_stop_signal`` subscribe) and the view they receive.
        guards: `StateGuard` s, in order.
    """

    def __init__(self, hooks: Hooks, guards: Sequence[StateGuard] = ()) -> None:
        self.hooks = hooks
        self.guards = list(guards)

    def wants_state_at(self, step: int) -> bool:
        """Whether a subscriber acts on the state after update ``step`` (a
        dispatch of several steps then ends there)."""
        for callback in self.hooks.callbacks:
            wants = getattr(callback, "wants_state_at", None)
            if wants is not None and wants(step):
                return True
        return False

    def start(self) -> None:
        """Training starts from the state as it is."""
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
        """A report published ``loss`` (``train/loss``): the state is good."""
        for guard in self.guards:
            guard.mark_good(loss)

    def stop_signal(self, module: Any) -> list[str]:
        """A stop signal ends the fit here: the state is checked, then each
        subscriber saves its resume point; the paths saved."""
        self.before_use()
        paths = []
        for callback in self.hooks.callbacks:
            save = getattr(callback, "on_stop_signal", None)
            if save is not None:
                path = save(self.hooks.view, module)
                if path is not None:
                    paths.append(path)
        return paths
