"""The optimizer a fit's train step uses, assembled from what the module's
``configure_optimizers`` returns.

One optax transformation, a dict of them by top-level params entry, or
Lightning's dict form with a ``jl.ReduceLROnPlateau`` (followed here by
`scales.scale_updates`, whose scale the plateau's stepper writes); then the
Trainer's gradient clipping, the transformations callbacks add (EMA, a
rollback's rate scale) and loss scaling for float16.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optax

from jaxlightning.training import contract
from jaxlightning.training.loss_scale import with_loss_scale
from jaxlightning.training.optimizers import ALL, Groups, by_group
from jaxlightning.training.scales import PlateauScaleState, scale_updates
from jaxlightning.training.step import StepOptions


def optimizer(module: Any, *, manual: bool = False) -> tuple[Any, Any]:
    """What ``module.configure_optimizers()`` returns, as the train step uses it,
    and the plateau scheduler it asks for (`lightning_config`).

    One optax transformation, or a dict of them by top-level params entry
    (`optimizers.by_group` for `JaxModule.loss`; `optimizers.Groups` for
    manual optimization, which gets a single transformation as one group).
    """
    with contract.in_hook(module, "configure_optimizers"):
        config = module.configure_optimizers()
    config, plateau = lightning_config(config, manual)
    tx = _optimizer(config, manual)
    if module.lora is not None:
        if manual:
            raise ValueError(
                f"{type(module).__name__} has LoRA adapters and trains by manual optimization; "
                "adapters are trained through loss(): define loss() instead of training_step"
            )
        tx = module.lora.frozen_base(tx)
    if plateau is not None:
        tx = optax.chain(tx, scale_updates(PlateauScaleState))
    return tx, plateau


def lightning_config(config: Any, manual: bool) -> tuple[Any, Any]:
    """``(optimizer, (scheduler, monitor) or None)`` from Lightning's dict form
    ``{"optimizer": tx, "lr_scheduler": {"scheduler": ..., "monitor": ...}}``
    (anything else is returned as it is, with ``None``)."""
    if not (isinstance(config, Mapping) and "optimizer" in config):
        return config, None
    unknown = sorted(set(config) - {"optimizer", "lr_scheduler", "monitor"})
    if unknown:
        raise ValueError(
            f"configure_optimizers() returned a dict with 'optimizer' and {unknown}; Lightning's "
            "form takes 'optimizer', 'lr_scheduler' and 'monitor'"
        )
    scheduler = config.get("lr_scheduler")
    if scheduler is None:
        return config["optimizer"], None
    settings = dict(scheduler) if isinstance(scheduler, Mapping) else {"scheduler": scheduler}
    monitor = settings.get("monitor", config.get("monitor"))
    if not callable(getattr(settings.get("scheduler"), "stepper", None)):
        raise TypeError(
            f"lr_scheduler {type(settings.get('scheduler')).__name__} is not supported: give "
            "the optimizer an optax schedule (optax.adam(optax.cosine_decay_schedule(...))); "
            "the dict form takes a jl.ReduceLROnPlateau, driven by a monitored metric"
        )
    if manual:
        raise ValueError(
            "an lr_scheduler with manual optimization (training_step) is not supported"
        )
    if not isinstance(monitor, str):
        raise ValueError(
            "jl.ReduceLROnPlateau needs a metric to monitor: {'scheduler': ..., 'monitor': "
            "'val_loss'} (a name in trainer.callback_metrics)"
        )
    if settings.get("interval", "epoch") != "epoch" or settings.get("frequency", 1) != 1:
        raise ValueError(
            "jl.ReduceLROnPlateau is stepped after every training epoch; 'interval' other than "
            "'epoch' and 'frequency' other than 1 are not supported"
        )
    return config["optimizer"], (settings["scheduler"], monitor)


def _optimizer(config: Any, manual: bool) -> Any:
    if isinstance(config, Mapping) and config:
        for key, tx in config.items():
            if not isinstance(_transformation(tx), optax.GradientTransformation):
                raise TypeError(
                    f"configure_optimizers() returned {type(tx).__name__} for {key!r}; the "
                    "dict's values must be optax transformations"
                )
        txs = {key: _transformation(tx) for key, tx in config.items()}
        return Groups(txs) if manual else by_group(txs)
    tx = _transformation(config)
    if isinstance(tx, optax.GradientTransformation):
        return Groups({ALL: tx}) if manual else tx
    hint = ""
    if isinstance(config, (tuple, list)):
        hint = (
            " (for several optimizers return a dict {params_key: transformation}, keyed "
            "by top-level entries of variables['params'])"
        )
    raise TypeError(
        f"configure_optimizers() returned {type(config).__name__}; return an optax "
        f"GradientTransformation such as optax.adam(1e-3){hint}"
    )


def _transformation(tx: Any) -> Any:
    if isinstance(tx, optax.GradientTransformation):
        return tx
    as_transform = getattr(tx, "gradient_transformation", None)
    return as_transform() if callable(as_transform) else tx  # optax.MultiSteps


def _leaves_alone(transform: Any, tx: Any) -> bool:
    """Whether a callback's ``transform_optimizer`` returns ``tx`` unchanged
    (a `Rollback` that lowers no rate, say)."""
    try:
        return transform(tx) is tx
    except Exception:
        return False


def fit_optimizer(
    module: Any,
    manual: bool,
    options: StepOptions,
    transforms: Sequence[tuple[Any, Callable[[Any], Any]]] = (),
) -> tuple[Any, Any]:
    """The optimizer the train step uses: ``configure_optimizers``', behind the
    Trainer's gradient clipping, transformed by ``transforms`` (each callback
    that lives in the optimizer, EMA say, with its ``transform_optimizer``, in
    order); and the plateau scheduler it asked for, with the name it monitors
    (or ``None``)."""
    tx, plateau = optimizer(module, manual=manual)
    tx = options.with_clipping(tx)
    for owner, transform in transforms:
        if manual and not _leaves_alone(transform, tx):
            raise ValueError(
                f"{type(owner).__name__} changes the optimizer, which manual "
                "optimization (training_step) does not support"
            )
        if not manual:
            tx = transform(tx)
    if options.loss_scaled:  # manual: one scale in front of every group's optimizer
        tx = tx._replace(loss_scaled=True) if manual else with_loss_scale(tx)
    return tx, plateau
