"""The train state: everything a step reads and writes, as one pytree."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import optax


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

    @property
    def variables(self) -> dict[str, Any]:
        """The flax variables dict (``params`` plus the other collections)."""
        return {"params": self.params, **self.model_state}

    def apply_gradients(
        self,
        tx: optax.GradientTransformation,
        grads: Any,
        model_state: dict[str, Any] | None = None,
    ) -> TrainState:
        """Returns the state after one optimizer update with ``grads``.

        ``model_state`` replaces the collections it names (the rest are kept).
        """
        updates, opt_state = tx.update(grads, self.opt_state, self.params)
        params = optax.apply_updates(self.params, updates)
        merged = dict(self.model_state)
        merged.update(model_state or {})
        return self.replace(
            step=self.step + 1, params=params, opt_state=opt_state, model_state=merged
        )


def create_train_state(
    variables: dict[str, Any], tx: optax.GradientTransformation, rng: jax.Array
) -> TrainState:
    """Builds the initial state from flax ``variables`` (``setup``'s return value)."""
    if "params" not in variables:
        raise ValueError(
            "setup() must return flax variables with a 'params' collection, got keys "
            f"{sorted(variables)}; return e.g. self.net.init(rng, batch['x'])"
        )
    params = variables["params"]
    model_state = {k: v for k, v in variables.items() if k != "params"}
    return TrainState(
        step=jax.numpy.zeros((), jax.numpy.int32),
        params=params,
        opt_state=tx.init(params),
        model_state=model_state,
        rng=rng,
    )
