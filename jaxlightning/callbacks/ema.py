"""`EMA`: an exponential moving average of the parameters, kept on the devices."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import optax

from jaxlightning.callbacks.base import Callback
from jaxlightning.training.loss_scale import LossScaleState

if TYPE_CHECKING:
    from jaxlightning.callbacks.view import TrainerView
    from jaxlightning.module import JaxModule


class EmaState(NamedTuple):
    """The averaged parameters (part of the optimizer state, so checkpointed)."""

    ema: Any


def params_ema(decay: float) -> optax.GradientTransformation:
    """A transformation that passes updates through and keeps, in its state,
    ``ema = decay * ema + (1 - decay) * params_after_update`` (starting at the
    initial parameters). Put last in a chain, it sees the final updates."""

    def init(params: Any) -> EmaState:
        return EmaState(ema=jax.tree.map(lambda p: p.copy(), params))

    def update(updates: Any, state: EmaState, params: Any = None) -> tuple[Any, EmaState]:
        if params is None:
            raise ValueError("params_ema needs the parameters in update()")
        new = optax.apply_updates(params, updates)
        ema = jax.tree.map(lambda e, p: decay * e + (1.0 - decay) * p, state.ema, new)
        return updates, EmaState(ema=ema)

    return optax.GradientTransformation(init, update)


class EMA(Callback):
    """Keeps an exponential moving average of the parameters, updated on the
    devices inside each train step (no host work), saved in checkpoints with the
    optimizer state, and used for validation.

    Args:
        decay: the average's decay per optimizer update (e.g. 0.999).
        validate_with_ema: evaluate with the averaged parameters during `fit`.
        apply_at_end: at the end of `fit`, give the module the averaged
            parameters (for ``test`` and ``predict``); the raw ones stay in
            ``trainer.state``.

    Attributes:
        ema_variables: the averaged variables after `fit` (host arrays).
    """

    def __init__(
        self, decay: float = 0.999, validate_with_ema: bool = True, apply_at_end: bool = False
    ) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA(decay={decay}): use a number in (0, 1)")
        self.decay = decay
        self.validate_with_ema = validate_with_ema
        self.apply_at_end = apply_at_end
        self.ema_variables: dict[str, Any] | None = None

    def transform_optimizer(self, tx: optax.GradientTransformation) -> Any:
        return optax.chain(tx, params_ema(self.decay))

    @staticmethod
    def _ema_params(opt_state: Any) -> Any:
        if isinstance(opt_state, LossScaleState):  # precision="16-mixed" wraps the chain
            opt_state = opt_state.inner
        return opt_state[-1].ema

    def evaluation_variables(self, trainer: TrainerView, state: Any) -> dict[str, Any]:
        if not self.validate_with_ema or trainer.stage != "fit":
            return state.variables
        return {**state.variables, "params": self._ema_params(state.opt_state)}

    def on_fit_end(self, trainer: TrainerView, module: JaxModule) -> None:
        state = trainer.state
        self.ema_variables = jax.device_get(
            {**state.variables, "params": self._ema_params(state.opt_state)}
        )
        if self.apply_at_end:
            module.variables = self.ema_variables
