"""Several optimizers: parameter groups, and manual optimization (GANs). Traced code.

``configure_optimizers`` may return one optax transformation, or a dict of
them keyed by top-level entries of ``variables["params"]`` (the groups). With
`JaxModule.loss`, a dict updates each group with its own transformation from
the one loss. With `JaxModule.training_step` (manual optimization), the step
asks for updates itself, in order, each from its own loss, through
`Optimizers.step`: a discriminator update, then a generator update that sees
the updated discriminator, all in one compiled program per step.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxlightning.training.loss_scale import INIT_SCALE, LossScaleState, next_scale
from jaxlightning.training.losses import loss_terms, pmean_floats
from jaxlightning.training.precision import for_compute
from jaxlightning.training.state import TrainState, keep_if, optimizer_update

ALL = "*"  # the one group of a single transformation in manual optimization


def walk_closures(
    tx: Any,
    visit: Callable[[Callable[..., Any], dict[str, Any]], bool],
    *,
    through_update: bool = False,
    max_depth: int = 24,
) -> None:
    """Calls ``visit(fn, cells)`` for each function reachable from ``tx``
    through the closures optax builds its transformations from (``chain``,
    ``multi_transform``, ``MultiSteps``, other wrappers), ``cells`` its free
    variables by name; descends into them unless ``visit`` returns True.
    Transformations are entered through their ``init`` (and ``update`` with
    ``through_update``); each object is visited once."""
    seen: set[int] = set()

    def walk(obj: Any, depth: int) -> None:
        if depth > max_depth or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, optax.GradientTransformation):
            walk(obj.init, depth + 1)
            if through_update:
                walk(obj.update, depth + 1)
        elif callable(getattr(obj, "gradient_transformation", None)):  # optax.MultiSteps
            walk(obj.gradient_transformation(), depth + 1)
        elif inspect.ismethod(obj):
            walk(vars(obj.__self__), depth + 1)
        elif isinstance(obj, (tuple, list)):
            for item in obj:
                walk(item, depth + 1)
        elif isinstance(obj, dict):
            for item in obj.values():
                walk(item, depth + 1)
        elif inspect.isfunction(obj) and obj.__closure__:
            cells = {
                name: cell.cell_contents
                for name, cell in zip(obj.__code__.co_freevars, obj.__closure__, strict=True)
                if name not in ("self", "__class__")
            }
            if not visit(obj, cells):
                for value in cells.values():
                    walk(value, depth + 1)

    walk(tx, 0)


def _labels(groups: Mapping[str, Any]) -> Callable[[Any], Any]:
    def label(params: Mapping[str, Any]) -> Any:
        check_groups(groups, params)
        return {key: jax.tree.map(lambda _, key=key: key, value) for key, value in params.items()}

    return label


def check_groups(groups: Mapping[str, Any], params: Mapping[str, Any]) -> None:
    """Every optimizer names a params entry, and every params entry has one."""
    if set(groups) == {ALL}:
        return
    unknown, uncovered = sorted(set(groups) - set(params)), sorted(set(params) - set(groups))
    if unknown or uncovered:
        raise ValueError(
            f"configure_optimizers() returned optimizers for {sorted(groups)}; each key must "
            f"name a top-level entry of variables['params'], which has {sorted(params)}"
            + (f" (no optimizer for {uncovered})" if uncovered else "")
        )


def by_group(groups: Mapping[str, optax.GradientTransformation]) -> optax.GradientTransformation:
    """One transformation updating ``params[key]`` with ``groups[key]``."""
    return optax.multi_transform(dict(groups), _labels(groups))


class Groups(NamedTuple):
    """The transformations of manual optimization; the state holds one optimizer
    state per group (``opt_state[key]``)."""

    txs: dict[str, optax.GradientTransformation]
    loss_scaled: bool = False  # precision="16-mixed": one loss scale in front of them all

    def init(self, params: Mapping[str, Any]) -> Any:
        check_groups(self.txs, params)
        if set(self.txs) == {ALL}:
            states = {ALL: self.txs[ALL].init(params)}
        else:
            states = {key: tx.init(params[key]) for key, tx in self.txs.items()}
        if not self.loss_scaled:
            return states
        scale = jnp.asarray(INIT_SCALE, jnp.float32)
        return LossScaleState(scale, jnp.zeros((), jnp.int32), states)


class Optimizers:
    """What `JaxModule.training_step` receives: the current parameters and a
    `step` per optimizer, applied in the order they are called.

    Inside the traced step; the cross-device averaging is done here, exactly
    over the real rows of the global batch, as for `JaxModule.loss`.

    Attributes:
        state: the train state, updated by each `step`.
    """

    def __init__(
        self,
        groups: Groups,
        state: TrainState,
        mask: jax.Array,
        reduce: Any,
        axis: str,
        precision: str = "32-true",
    ) -> None:
        self._txs = groups.txs
        self._axis = axis
        self._precision = precision
        self.state = state
        self._mask = mask
        self._reduce = reduce  # (tree) -> tree summed over the devices
        self.finite = jnp.asarray(True)
        self.steps_taken: list[str] = []

    @property
    def params(self) -> Any:
        """The parameters as updated by the steps so far."""
        return self.state.params

    @property
    def variables(self) -> dict[str, Any]:
        """``params`` with the other collections (``batch_stats``...), as updated so far."""
        return self.state.variables

    def step(self, fn: Callable[[Any], Any], group: str | None = None) -> jax.Array:
        """One update of ``group``'s parameters (all of them with one optimizer)
        with its optimizer, from the gradient of ``fn(params)``.

        ``fn`` takes the whole current ``params`` dict and returns a loss, as
        `JaxModule.loss` does: a scalar, a per-example vector, or
        ``(loss, updates)`` with mutated collections. Only ``params[group]``
        is differentiated and updated; the Trainer's ``gradient_clip_val``
        clips this group's averaged gradient (a clipping transformation in
        front of the group's optimizer). The optimizer's update gets the loss
        as ``value=`` (for ``optax.contrib.reduce_on_plateau`` and the like).

        Returns:
            The loss, averaged over the real rows of the global batch.
        """
        if group is None:
            if len(self._txs) != 1:
                raise ValueError(
                    f"optimizers.step(fn) needs group= with several optimizers: one of "
                    f"{sorted(self._txs)}"
                )
            group = next(iter(self._txs))
        elif set(self._txs) == {ALL}:
            raise KeyError(
                f"optimizers.step(fn, {group!r}): configure_optimizers() returned a single "
                "optimizer, which updates all the parameters; call optimizers.step(fn) "
                f"without a group. To update only params[{group!r}] with its own "
                "optimizer, return a dict of optimizers keyed by the top-level entries of "
                "variables['params'] from configure_optimizers()"
            )
        if group not in self._txs:
            raise KeyError(f"optimizers.step(group={group!r}): the groups are {sorted(self._txs)}")
        state, everything = self.state, group == ALL
        # 16-mixed: one loss scale (torch's GradScaler), moved after every step
        scaled = isinstance(state.opt_state, LossScaleState)
        states = state.opt_state.inner if scaled else state.opt_state
        scale = state.opt_state.scale if scaled else None

        def objective(sub: Any) -> Any:
            params = sub if everything else {**state.params, group: sub}
            out = fn(for_compute(params, self._precision))
            total, count, updates = loss_terms(out, state.model_state, self._mask)
            return (total if scale is None else total * scale), (total, count, updates)

        own = state.params if everything else state.params[group]
        (_, (total, count, updates)), grads = jax.value_and_grad(objective, has_aux=True)(own)
        grads, total, count, summed = self._reduce((grads, total, count, updates))
        grads = jax.tree.map(lambda g: g / (count if scale is None else count * scale), grads)
        updates = pmean_floats(summed, updates, jax.lax.axis_size(self._axis))
        deltas, opt_state = optimizer_update(
            self._txs[group], grads, states[group], own, value=total / count
        )
        new_own = optax.apply_updates(own, deltas)
        mean = total / count
        finite = jnp.isfinite(mean)
        if scaled:  # an overflowing step leaves this group as it was and halves the scale
            finite = finite & jnp.all(
                jnp.stack([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)])
            )
            new_own, opt_state = keep_if(finite, (new_own, opt_state), (own, states[group]))
        states = {**states, group: opt_state}
        self.state = state.replace(
            params=new_own if everything else {**state.params, group: new_own},
            opt_state=next_scale(state.opt_state._replace(inner=states), finite)
            if scaled
            else states,
            model_state={**state.model_state, **updates},
        )
        self.finite = self.finite & finite
        self.steps_taken.append(group)
        return mean
