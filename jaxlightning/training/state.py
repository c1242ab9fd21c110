"""The train state: everything a step reads and writes, as one pytree.

Traced code: its methods run inside the compiled step.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import optax

from jaxlightning.training.loss_scale import next_scale


@flax.struct.dataclass
class TrainState:
    """Step counter, parameters, optimizer state, mutable collections and base key.

    A pure value: methods return a new state and never mutate this one. The
    optimizer itself is not part of the state (it is code, not data); step
    functions close over it, so a state can be saved and restored as plain arrays.

    Attributes:
        step: number of optimizer updates applied so far (int32 scalar).
        params: the ``"params"`` collection of the flax variables.
        opt_state: the optax state of ``params``.
        model_state: every other flax collection (e.g. ``{"batch_stats": ...}``).
        rng: the run's base PRNG key; per-step, per-device keys are derived from it
            on device, so it never changes during training.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: dict[str, Any]
    rng: jax.Array

    def with_params(self, params: Any) -> TrainState:
        """``replace(params=params)``, for the host: a CPU train step calls it
        twice (`ParamsApart`), and ``dataclasses.replace`` costs ~2 us a call
        against ~0.3 for this copy of the fields (a frozen dataclass with no
        ``__post_init__``: nothing else runs at construction)."""
        new = object.__new__(type(self))
        fields = new.__dict__
        fields.update(self.__dict__)
        fields["params"] = params
        return new

    @property
    def variables(self) -> dict[str, Any]:
        """The flax variables dict (``params`` plus the other collections)."""
        return {"params": self.params, **self.model_state}

    def apply_gradients(
        self,
        tx: optax.GradientTransformation,
        grads: Any,
        model_state: dict[str, Any] | None = None,
        value: jax.Array | None = None,
    ) -> TrainState:
        """Returns the state after one optimizer update with ``grads``.

        ``model_state`` replaces the collections it names (the rest are kept).
        ``value``, the loss these gradients are of, goes to the transformations
        that take it (`optimizer_update`).
        """
        updates, opt_state = optimizer_update(tx, grads, self.opt_state, self.params, value)
        params = optax.apply_updates(self.params, updates)
        merged = dict(self.model_state)
        merged.update(model_state or {})
        return self.replace(
            step=self.step + 1, params=params, opt_state=opt_state, model_state=merged
        )


def optimizer_update(
    tx: optax.GradientTransformation,
    grads: Any,
    opt_state: Any,
    params: Any,
    value: jax.Array | None = None,
) -> tuple[Any, Any]:
    """``tx.update`` with ``value=`` (the loss) for transformations that use it
    (``optax.contrib.reduce_on_plateau``); the others ignore it. Without a
    value (accumulated gradients), a transformation that needs one is named."""
    if value is None:
        try:
            return tx.update(grads, opt_state, params)
        except TypeError as exc:
            if "value" not in str(exc):
                raise
            raise TypeError(
                "the optimizer needs the loss (update(..., value=...)), which the Trainer "
                "passes for each update of one batch; with accumulate_grad_batches > 1 it "
                f"does not yet: use accumulate_grad_batches=1. optax said: {exc}"
            ) from exc
    return optax.with_extra_args_support(tx).update(grads, opt_state, params, value=value)


def keep_if(ok: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``ok``, else ``old``, leaf by leaf (bitwise one or the other)."""
    return jax.tree.map(lambda n, o: jax.numpy.where(ok, n, o), new, old)


@flax.struct.dataclass
class AccumulatingState(TrainState):
    """A `TrainState` that sums gradients over micro-batches between updates
    (``accumulate_grad_batches``).

    Attributes:
        grad_sum: the gradient summed over the real rows of the micro-batches
            since the last update (zeros after one).
        rows: how many real rows that sum covers.
        micro: micro-batches since the last update.
    """

    grad_sum: Any
    rows: jax.Array
    micro: jax.Array

    def accumulate(self, grad_sum: Any, rows: jax.Array) -> AccumulatingState:
        """Adds one micro-batch's summed gradient and row count."""
        return self.replace(
            grad_sum=jax.tree.map(jax.numpy.add, self.grad_sum, grad_sum),
            rows=self.rows + rows,
            micro=self.micro + 1,
        )

    def apply_accumulated(
        self,
        tx: optax.GradientTransformation,
        skip_empty: bool = False,
        loss_scaled: bool = False,
    ) -> AccumulatingState:
        """One optimizer update with the mean gradient accumulated so far; starts
        over. With ``skip_empty``, no update when no row was accumulated (every
        micro-batch was left out). With ``loss_scaled`` (``"16-mixed"``) the sum
        is of scaled gradients: divided by the window's scale too, and a window
        whose sum overflowed makes no update and halves the scale (torch's
        ``GradScaler`` with accumulation: one check per optimizer step)."""
        divisor = self.rows * self.opt_state.scale if loss_scaled else self.rows
        grads = jax.tree.map(lambda g: g / divisor, self.grad_sum)
        updated = self.apply_gradients(tx, grads)
        if skip_empty:
            updated = keep_if(self.rows > 0, updated, self)
        if loss_scaled:
            leaves = jax.tree.leaves(grads)
            finite = jax.numpy.all(jax.numpy.stack([jax.numpy.isfinite(g).all() for g in leaves]))
            updated = keep_if(finite, updated, self)
            updated = updated.replace(opt_state=next_scale(updated.opt_state, finite))
        return updated.replace(
            grad_sum=jax.tree.map(jax.numpy.zeros_like, self.grad_sum),
            rows=jax.numpy.zeros_like(self.rows),
            micro=jax.numpy.zeros_like(self.micro),
        )


def create_train_state(
    variables: dict[str, Any],
    tx: optax.GradientTransformation,
    rng: jax.Array,
    accumulate: int = 1,
) -> TrainState:
    """Builds the initial state from flax ``variables`` (``setup``'s return value)."""
    if "params" not in variables:
        raise ValueError(
            "setup() must return flax variables with a 'params' collection, got keys "
            f"{sorted(variables)}; return e.g. self.net.init(rng, batch['x'])"
        )
    params = variables["params"]
    model_state = {k: v for k, v in variables.items() if k != "params"}
    fields = {
        "step": jax.numpy.zeros((), jax.numpy.int32),
        "params": params,
        "opt_state": tx.init(params),
        "model_state": model_state,
        "rng": rng,
    }
    if accumulate == 1:
        return TrainState(**fields)
    zero = jax.numpy.zeros((), jax.numpy.int32)
    grad_sum = jax.tree.map(jax.numpy.zeros_like, params)
    return AccumulatingState(**fields, grad_sum=grad_sum, rows=zero, micro=zero)
