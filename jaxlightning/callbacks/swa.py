"""`StochasticWeightAveraging`: Lightning's SWA callback, on the devices.

The averaged parameters, the rate schedule's values and the bookkeeping live in
the optimizer state, in a transformation the callback appends to the user's
optimizer (`swa_transform`): they are updated inside the train step and saved
in checkpoints with the rest of the state, so a run resumes bit-exactly. The
host writes a few scalars into that state at each SWA epoch's start (through
`StateEdits.set_optimizer_state`), so nothing recompiles.

Lightning's schedule (its ``StochasticWeightAveraging`` with torch's ``SWALR``):
with ``swa_start = max(swa_epoch_start - 1, 0)`` (0-based; a float start is
``int(max_epochs * f)``) and ``swa_end = max_epochs - 1`` (with no epoch
limit, ``max_epochs=-1``: none, and the fit's end, by ``max_steps`` or a stop,
is where the average is taken),

- the average takes the parameters as they are at the start of every epoch
  ``swa_start..swa_end`` (``avg += (p - avg) / (n + 1)``; a copy when
  ``n == 0``); the last epoch's own updates are therefore not in it;
- from ``swa_start`` on, the optimizer's rate is replaced (its schedule
  stops): in SWA epoch ``k`` it is ``swa_lr * a(t) + lr0 * (1 - a(t))``, with
  ``t = min(1, k / max(1, annealing_epochs))`` (``t = 1`` throughout for
  ``annealing_epochs=0``), ``a(t) = (1 - cos(pi t)) / 2`` or ``t``, and ``lr0``
  the optimizer's rate when SWA starts;
- when training ends after ``swa_end``, the model takes the average, and a
  model with BatchNorm statistics (a ``batch_stats`` collection) has them
  recomputed by one forward pass over the training data (torch's
  ``update_bn``: the mean over batches of each batch's statistics).

The rate is replaced by scaling the optimizer's updates by ``rate /
base_rate(count)``, where ``base_rate`` is the optimizer's own rate (constant
or schedule) found in the optax transformation. That is the rate's role in
SGD, Adam, AdamW, RMSprop and every optimizer whose update is proportional to
it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxlightning.callbacks.base import Callback
from jaxlightning.training.loss_scale import LossScaleState
from jaxlightning.training.optimizers import walk_closures

if TYPE_CHECKING:
    from jaxlightning.callbacks.view import TrainerView
    from jaxlightning.module import JaxModule
    from jaxlightning.training.state import TrainState


class SwaState(NamedTuple):
    """What `swa_transform` keeps. The host writes ``active``, ``alpha``,
    ``swa_lr`` and ``average_epoch``; the step moves the rest."""

    count: jax.Array  # updates so far (the optimizer's own schedule's count)
    active: jax.Array  # whether the SWA rate replaces the optimizer's
    alpha: jax.Array  # a(t) of this epoch
    swa_lr: jax.Array
    initial_lr: jax.Array  # lr0: the optimizer's rate at the first SWA update
    started: jax.Array  # whether initial_lr has been taken
    average_epoch: jax.Array  # the epoch whose starting parameters to average in
    averaged_epoch: jax.Array  # the last epoch averaged in (-1: none)
    n_averaged: jax.Array
    average: Any


def _default_avg(average: Any, params: Any, n: jax.Array) -> Any:
    return jax.tree.map(lambda a, p: a + (p - a) / (n + 1).astype(a.dtype), average, params)


def swa_transform(
    base_rate: Callable[[jax.Array], jax.Array],
    avg_fn: Callable[[Any, Any, jax.Array], Any] | None = None,
) -> optax.GradientTransformation:
    """Put last in a chain: scales the updates to the SWA rate while
    ``active`` and averages the parameters (before the update) into its state
    at the first update after the host asked for a new epoch's average.

    Args:
        base_rate: the optimizer's rate at an update count (`base_learning_rate`).
        avg_fn: ``(average, params, n_averaged) -> average`` (traced); default
            the running mean.
    """
    avg = avg_fn or _default_avg

    def init(params: Any) -> SwaState:
        f32, i32 = jnp.float32, jnp.int32
        return SwaState(
            count=jnp.zeros((), i32),
            active=jnp.zeros((), bool),
            alpha=jnp.zeros((), f32),
            swa_lr=jnp.zeros((), f32),
            initial_lr=jnp.zeros((), f32),
            started=jnp.zeros((), bool),
            average_epoch=jnp.full((), -1, i32),
            averaged_epoch=jnp.full((), -1, i32),
            n_averaged=jnp.zeros((), i32),
            average=jax.tree.map(jnp.copy, params),
        )

    def update(updates: Any, state: SwaState, params: Any = None) -> tuple[Any, SwaState]:
        if params is None:
            raise ValueError("the SWA transformation needs the parameters in update()")
        base = jnp.asarray(base_rate(state.count), jnp.float32)
        take = state.active & ~state.started
        initial = jnp.where(take, base, state.initial_lr)
        rate = state.swa_lr * state.alpha + initial * (1 - state.alpha)
        ratio = jnp.where(state.active & (base != 0), rate / jnp.where(base == 0, 1, base), 1)
        updates = jax.tree.map(lambda u: u * ratio.astype(u.dtype), updates)

        due = state.average_epoch > state.averaged_epoch
        first = state.n_averaged == 0
        merged = avg(state.average, params, state.n_averaged)
        average = jax.tree.map(
            lambda a, p, m: jnp.where(due, jnp.where(first, p, m), a).astype(a.dtype),
            state.average,
            params,
            merged,
        )
        return updates, state._replace(
            count=optax.safe_increment(state.count),
            initial_lr=initial,
            started=state.started | state.active,
            averaged_epoch=jnp.where(due, state.average_epoch, state.averaged_epoch),
            n_averaged=state.n_averaged + due.astype(jnp.int32),
            average=average,
        )

    return optax.GradientTransformation(init, update)


# ------------------------------------------------- the optimizer's own rate
def base_learning_rate(tx: Any) -> Callable[[jax.Array], jax.Array] | None:
    """The learning rate ``tx`` applies at an update count, read from the
    closures optax builds its aliases from (``optax.scale_by_learning_rate``:
    a constant or a schedule; ``optax.inject_hyperparams``' ``learning_rate``).
    ``None`` when there is not exactly one."""
    found: list[Callable[[jax.Array], jax.Array]] = []

    def constant(value: Any) -> Callable[[jax.Array], jax.Array]:
        return lambda count: jnp.asarray(value, jnp.float32)

    def visit(fn: Any, cells: dict[str, Any]) -> bool:
        if "inner_factory" in cells and ("sched_hps" in cells or "numeric_hps" in cells):
            rate = {**cells.get("numeric_hps", {}), **cells.get("sched_hps", {})}
            if "learning_rate" in rate:
                lr = rate["learning_rate"]
                found.append(lr if callable(lr) else constant(lr))
            return True
        if set(cells) == {"m", "learning_rate"} and callable(cells["learning_rate"]):
            found.append(cells["learning_rate"])  # scale_by_learning_rate's schedule
            return True
        if fn.__name__ == "update_fn" and set(cells) == {"step_size"}:
            step = cells["step_size"]  # scale(-learning_rate)
            if np.ndim(step) == 0 and float(step) < 0:
                found.append(constant(-float(step)))
            return True
        return False

    walk_closures(tx, visit, through_update=True)
    unique = {id(f): f for f in found}
    return next(iter(unique.values())) if len(unique) == 1 else None


# ----------------------------------------------------------------- callback
class StochasticWeightAveraging(Callback):
    """Lightning's ``StochasticWeightAveraging``: averages the parameters of
    the last epochs and trains them at a constant (annealed-to) rate; see the
    module's docstring for the schedule.

    Args:
        swa_lrs: the rate SWA anneals to (Lightning's per-group list: one
            number here; every group shares the optimizer's rate).
        swa_epoch_start: the epoch (1-based int) or the share of
            ``max_epochs`` (float in (0, 1]) at which SWA starts.
        annealing_epochs: epochs from the optimizer's rate to ``swa_lrs``.
        annealing_strategy: ``"cos"`` or ``"linear"``.
        avg_fn: ``(average, params, n_averaged) -> average``, traced; default
            the running mean (``torch.optim.swa_utils.AveragedModel``'s).

    Attributes:
        n_averaged: how many epochs' parameters the average holds (after `fit`).
    """

    def __init__(
        self,
        swa_lrs: float,
        swa_epoch_start: int | float = 0.8,
        annealing_epochs: int = 10,
        annealing_strategy: str = "cos",
        avg_fn: Callable[[Any, Any, jax.Array], Any] | None = None,
    ) -> None:
        if isinstance(swa_lrs, (list, tuple)):
            if len(set(swa_lrs)) != 1:
                raise ValueError(
                    f"StochasticWeightAveraging(swa_lrs={list(swa_lrs)}): one rate per parameter "
                    "group is not supported (an optax optimizer has one rate); pass one number"
                )
            swa_lrs = swa_lrs[0]
        if not isinstance(swa_lrs, (int, float)) or swa_lrs <= 0:
            raise ValueError(
                f"StochasticWeightAveraging(swa_lrs={swa_lrs!r}): use a positive number"
            )
        integer = isinstance(swa_epoch_start, int) and not isinstance(swa_epoch_start, bool)
        if not (
            (integer and swa_epoch_start >= 1)
            or (isinstance(swa_epoch_start, float) and 0 < swa_epoch_start <= 1)
        ):
            raise ValueError(
                f"StochasticWeightAveraging(swa_epoch_start={swa_epoch_start!r}): use an "
                "int >= 1 (an epoch, 1-based) or a float in (0, 1] (a share of max_epochs)"
            )
        if not isinstance(annealing_epochs, int) or annealing_epochs < 0:
            raise ValueError(
                f"StochasticWeightAveraging(annealing_epochs={annealing_epochs!r}): use an int >= 0"
            )
        if annealing_strategy not in ("cos", "linear"):
            raise ValueError(
                f"StochasticWeightAveraging(annealing_strategy={annealing_strategy!r}): use "
                "'cos' or 'linear'"
            )
        self.swa_lrs = float(swa_lrs)
        self.swa_epoch_start = swa_epoch_start
        self.annealing_epochs = annealing_epochs
        self.annealing_strategy = annealing_strategy
        self.avg_fn = avg_fn
        self.n_averaged = 0
        self._start: int | None = None  # 0-based
        self._end: int | None = None

    # ------------------------------------------------------------ schedule
    @property
    def swa_start(self) -> int:
        """The first SWA epoch (0-based), once `fit` knows ``max_epochs``."""
        if self._start is None:
            raise RuntimeError("swa_start is known once fit starts")
        return self._start

    @property
    def swa_end(self) -> float:
        """The last SWA epoch (0-based): ``max_epochs - 1`` (``inf``: no epoch limit)."""
        if self._end is None:
            raise RuntimeError("swa_end is known once fit starts")
        return self._end

    def alpha(self, epoch: int) -> float:
        """a(t) of ``epoch`` (an SWA epoch): how far the rate has moved from the
        optimizer's to ``swa_lrs``."""
        k = epoch - self.swa_start
        t = 1.0 if self.annealing_epochs == 0 else min(1.0, k / max(1, self.annealing_epochs))
        if self.annealing_strategy == "linear":
            return t
        return (1.0 - math.cos(math.pi * t)) / 2.0

    # --------------------------------------------------------------- hooks
    def transform_optimizer(self, tx: optax.GradientTransformation) -> Any:
        rate = base_learning_rate(tx)
        if rate is None:
            raise ValueError(
                "StochasticWeightAveraging replaces the optimizer's learning rate, and could "
                "not find exactly one in it: build the optimizer with an optax alias and one "
                "rate (optax.sgd(0.1), optax.adam(schedule), optax.inject_hyperparams(...)"
                "(learning_rate=...))"
            )
        return optax.chain(tx, swa_transform(rate, self.avg_fn))

    def on_fit_start(self, trainer: TrainerView, module: JaxModule) -> None:
        max_epochs = trainer.max_epochs  # -1: no epoch limit
        start = self.swa_epoch_start
        if isinstance(start, float):
            if max_epochs < 0:
                raise ValueError(
                    f"StochasticWeightAveraging(swa_epoch_start={start}) is a share of "
                    "max_epochs, and this fit has no epoch limit (max_epochs=-1): give the "
                    "epoch SWA starts at as an int"
                )
            start = int(max_epochs * start)
        # Without an epoch limit SWA runs from its start to the fit's end (max_steps,
        # a stop), where the average is taken.
        self._start = max(start - 1, 0)
        self._end = max_epochs - 1 if max_epochs >= 0 else math.inf

    def on_train_epoch_start(self, trainer: TrainerView, module: JaxModule) -> None:
        epoch = trainer.current_epoch
        if self.swa_start <= epoch <= self.swa_end:
            trainer.edit.set_optimizer_state(
                SwaState,
                active=True,
                alpha=self.alpha(epoch),
                swa_lr=self.swa_lrs,
                average_epoch=epoch,
            )

    def on_train_end(self, trainer: TrainerView, module: JaxModule) -> None:
        if self.swa_end == math.inf:  # no epoch limit: the fit's end ends SWA
            if trainer.current_epoch <= self.swa_start:  # it never started
                return
        elif trainer.current_epoch <= self.swa_end:  # stopped before the last epoch
            return
        trainer.edit.map_state(_take_average)
        state = trainer.state
        assert state is not None
        self.n_averaged = int(np.asarray(jax.device_get(_swa_state(state.opt_state).n_averaged)))
        if "batch_stats" in state.model_state:
            trainer.edit.recompute_batch_statistics()

    def state_dict(self) -> dict[str, Any]:
        return {"n_averaged": self.n_averaged}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n_averaged = int(state.get("n_averaged", 0))


def _swa_state(opt_state: Any) -> SwaState:
    if isinstance(opt_state, LossScaleState):  # precision="16-mixed" wraps the chain
        opt_state = opt_state.inner
    found = [
        n
        for n in jax.tree.leaves(opt_state, is_leaf=lambda n: isinstance(n, SwaState))
        if isinstance(n, SwaState)
    ]
    if len(found) != 1:
        raise RuntimeError(f"expected one SwaState in the optimizer state, found {len(found)}")
    return found[0]


def _take_average(state: TrainState) -> TrainState:
    """The train state with the SWA average as its parameters."""
    swa = _swa_state(state.opt_state)
    params = jax.tree.map(
        lambda a, p: jnp.where(swa.n_averaged > 0, a, p).astype(p.dtype),
        swa.average,
        state.params,
    )
    return state.replace(params=params)
