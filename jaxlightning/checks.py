"""Up-front checks of what the user hands the Trainer, with messages that name it.

Each check runs on the host before anything is traced or compiled, so a bad
argument, loader or optimizer fails at once with the argument's name instead of
deep inside JAX (or, worse, after an epoch of training).
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

from jaxlightning.module import JaxModule
from jaxlightning.strategies.shard_map import ShardMapStrategy
from jaxlightning.training import contract
from jaxlightning.training.nnx import is_nnx
from jaxlightning.training.step import StepOptions


def int_arg(name: str, value: Any, *, minimum: int, hint: str = "") -> int:
    """``value`` when it is an int (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r}: expected an int{hint}")
    if value < minimum:
        raise ValueError(f"{name}={value!r}: expected an int >= {minimum}{hint}")
    return value


def steps_per_execution(value: Any, strategy: Any) -> int | str:
    """``steps_per_execution``, checked against the strategy (``"auto"``: as it is)."""
    if isinstance(value, str) and value == "auto":
        return value
    k = int_arg("steps_per_execution", value, minimum=1, hint=' or "auto"')
    if k == 1:
        return k
    if not isinstance(strategy, ShardMapStrategy):
        raise ValueError(
            f"steps_per_execution={k} needs a strategy whose batches are global arrays "
            f"(shard_map, fsdp, ModelParallelStrategy); the {strategy.name!r} strategy "
            "runs one step per dispatch: pass strategy='auto' or steps_per_execution=1"
        )
    return k


def device_memory(value: Any) -> int | None:
    """``device_memory``: bytes, or ``None`` for what the device reports."""
    if value is None:
        return None
    return int_arg("device_memory", value, minimum=1, hint=" (bytes per device) or None")


def fast_dev_run(value: Any) -> int:
    """``fast_dev_run`` as a batch count (0: off)."""
    if value is True:
        return 1
    if value is False:
        return 0
    return int_arg("fast_dev_run", value, minimum=0, hint=" or a bool")


def epoch_limit(max_epochs: Any, max_steps: Any) -> tuple[int | None, int]:
    """``(max_epochs, max_steps)`` as the loop uses them, Lightning's rules applied.

    ``max_epochs=-1`` means no epoch limit; with neither limit given, 1000 epochs.
    Returns ``None`` for no epoch limit and ``-1`` for no step limit.
    """
    max_steps = int_arg("max_steps", max_steps, minimum=-1, hint=" (-1: no step limit)")
    if max_epochs is None:
        return (1000 if max_steps == -1 else None), max_steps
    max_epochs = int_arg("max_epochs", max_epochs, minimum=-1, hint=" (-1: no epoch limit)")
    return (None if max_epochs == -1 else max_epochs), max_steps


def step_options(
    clip_val: Any,
    clip_algorithm: Any,
    log_grad_norm: Any,
    accumulate: Any = 1,
    on_nonfinite: Any = "raise",
    *,
    log_loss: Any = False,
    step_values: Any = "last",
) -> StepOptions:
    """The train step's options, checked."""
    if step_values not in ("last", "interval"):
        raise ValueError(
            f"step_values={step_values!r}: use 'last' (each report shows its step's own "
            "value, Lightning's) or 'interval' (the reduction over the logging interval)"
        )
    if on_nonfinite not in ("raise", "skip", "rollback"):
        raise ValueError(
            f"on_nonfinite={on_nonfinite!r}: use 'raise' (stop at the next report), 'skip' "
            "(leave out each update whose loss or gradient is not finite) or 'rollback' "
            "(or jl.Rollback(...): go back to the last good state and skip the batches since)"
        )
    accumulate = int_arg("accumulate_grad_batches", accumulate, minimum=1)
    if accumulate > 1 and log_grad_norm:
        raise ValueError(
            "log_grad_norm with accumulate_grad_batches > 1 is not supported yet; "
            "turn one of them off"
        )
    if clip_val is not None:
        if isinstance(clip_val, bool) or not isinstance(clip_val, (int, float)) or clip_val <= 0:
            raise ValueError(f"gradient_clip_val={clip_val!r}: use a positive number or None")
        clip_val = float(clip_val)
    if clip_algorithm not in ("norm", "value"):
        raise ValueError(f"gradient_clip_algorithm={clip_algorithm!r}: use 'norm' or 'value'")
    return StepOptions(
        clip_val,
        clip_algorithm,
        bool(log_grad_norm),
        accumulate,
        on_nonfinite=on_nonfinite,
        log_loss=bool(log_loss),
        step_values=step_values,
    )


def val_check_fraction(interval: Any, epoch_batches: int | None, val: Any) -> None:
    """Refuses a fractional ``val_check_interval`` (other than 1.0) with a
    training loader of unknown length, Lightning's rule: a fraction of an
    epoch needs its length."""
    if val is None or epoch_batches is not None:
        return
    if isinstance(interval, float) and interval != 1.0:
        raise ValueError(
            "When using an IterableDataset for `train_dataloader`, "
            f"`Trainer(val_check_interval)` must be `1.0` or an int (got {interval}): the "
            "training loader has no length, so a fraction of its epoch is unknown. An int "
            "k checks validation every k training batches"
        )


def reiterable(loader: Any, name: str, *, passes: str) -> None:
    """Refuses a one-shot iterator (a generator, say) where it is read ``passes``."""
    if isinstance(loader, Iterator):
        raise TypeError(
            f"{name} is a {type(loader).__name__}, which can be iterated only once, but "
            f"the Trainer reads it {passes}. Pass something that can be iterated again: "
            "a DataLoader, a list of batches, or an object whose __iter__ starts over"
        )


# Lightning hooks a ported module may still define, and what to do here instead.
_LIGHTNING_ONLY = {
    "training_epoch_end": "use a Callback with on_train_epoch_end(trainer, module)",
    "validation_epoch_end": "use a Callback with on_validation_end(trainer, module)",
    "on_before_backward": "there is no backward pass to hook: transform gradients with optax",
    "on_after_backward": "there is no backward pass to hook: transform gradients with optax",
    "on_before_optimizer_step": "transform gradients with optax (e.g. optax.chain)",
    "on_before_zero_grad": "there are no gradients to zero: each step computes them afresh",
    "configure_gradient_clipping": "use optax.clip_by_global_norm in configure_optimizers",
    "lr_scheduler_step": "pass an optax schedule as the optimizer's learning rate",
    "prepare_data": "prepare data before calling fit",
}


_checked_classes: weakref.WeakSet[type] = weakref.WeakSet()


def lightning_signatures(module: Any, hooks: tuple[str, ...]) -> None:
    """Refuses traced hooks still written with Lightning's ``(batch, batch_idx)``."""
    for hook in hooks:
        method = getattr(type(module), hook, None)
        if method is None or hook not in _TRACED_SIGNATURES:
            continue
        params = [p for p in inspect.signature(method).parameters if p != "self"]
        if params[:1] == ["batch"]:
            name, written = type(module).__name__, f"{hook}({', '.join(params)})"
            if hook == "training_step":  # Lightning's automatic step: our loss()
                raise TypeError(
                    f"{name}.{written} has PyTorch Lightning's signature. Lightning's "
                    "training_step that returns the loss is loss(self, variables, batch, "
                    "rngs) here: rename it, and apply the model to the flax variables it "
                    "receives (self.net.apply(variables, x, rngs=rngs)); it is traced once "
                    "(no batch_idx). training_step(self, optimizers, batch, rngs) is "
                    "manual optimization (Lightning's automatic_optimization=False)"
                )
            raise TypeError(
                f"{name}.{written} has PyTorch Lightning's signature; here it is "
                f"{hook}({_TRACED_SIGNATURES[hook]}): it receives the flax variables and "
                "one device's shard of the batch, and is traced once (no batch_idx)"
            )


_TRACED_SIGNATURES = {
    "loss": "self, variables, batch, rngs",
    "training_step": "self, optimizers, batch, rngs",
    "eval_step": "self, variables, batch",
    "validation_step": "self, variables, batch",
    "test_step": "self, variables, batch",
    "predict_step": "self, variables, batch",
}


def lightning_hooks(module: Any) -> None:
    """Warns, once per class, for each Lightning hook the Trainer would not call."""
    cls = type(module)
    if cls in _checked_classes:
        return
    _checked_classes.add(cls)
    for hook, instead in _LIGHTNING_ONLY.items():
        if callable(getattr(cls, hook, None)):
            warnings.warn(
                f"{cls.__name__}.{hook}() is a PyTorch Lightning hook that jaxlightning "
                f"does not call; {instead}",
                stacklevel=4,
            )


_BATCH_HOOKS = tuple(
    f"on_{stage}_batch_{when}"
    for stage in ("train", "validation", "test", "predict")
    for when in ("start", "end")
)


def batch_hook_signatures(module: Any) -> None:
    """Refuses a module batch hook written with Lightning's arguments: here the
    hook gets ``batch_idx`` only (the batch is on the devices, the outputs in
    the compiled step)."""
    for hook in _BATCH_HOOKS:
        method = getattr(type(module), hook, None)
        if method is None or not contract.overrides(module, hook):
            continue
        params = [p for p in inspect.signature(method).parameters if p != "self"]
        if len(params) != 1:
            raise TypeError(
                f"{type(module).__name__}.{hook}({', '.join(params)}): here the hook is "
                f"{hook}(self, batch_idx). The batch lives on the devices and the outputs "
                "in the compiled step: log what you need with self.log in loss/eval_step"
            )


def _jax_module(module: Any) -> None:
    """Refuses a module that is no `JaxModule` or skipped ``super().__init__()``."""
    if not isinstance(module, JaxModule):
        raise TypeError(f"expected a jaxlightning.JaxModule, got {type(module).__name__}")
    if not hasattr(module, "_log_sink"):
        raise TypeError(f"{type(module).__name__}.__init__ must call super().__init__() first")


def sanity_steps(value: Any) -> int:
    """``num_sanity_val_steps`` as a count (-1: all): an int, -1 or ``inf`` for
    all, or a whole float (``0.0``), as Lightning accepts."""
    if isinstance(value, float) and not isinstance(value, bool):
        if value == float("inf"):
            return -1
        if value.is_integer():
            value = int(value)
    return int_arg("num_sanity_val_steps", value, minimum=-1, hint=" (-1 or inf: all batches)")


def module_hooks(module: Any, *hooks: str) -> None:
    """Refuses a module that is no `JaxModule`, skipped ``super().__init__()`` or
    lacks a hook the Trainer needs; warns for Lightning-only hooks."""
    _jax_module(module)
    for hook in hooks:
        if not contract.overrides(module, hook):
            why = (
                " (its setup(stage) is Lightning's set-up hook, so the variables come "
                "from configure_model(self, rng, batch), e.g. "
                "`return self.net.init(rng, batch[0])`)"
                if hook == "configure_model"
                else ""
            )
            raise NotImplementedError(
                f"{type(module).__name__} does not define {hook}(){why}; the Trainer "
                f"needs it here. See JaxModule.{hook} for its signature"
            )
    lightning_signatures(module, hooks)
    batch_hook_signatures(module)
    lightning_hooks(module)


def evaluation_hook(module: Any, stage: str, hook: str) -> None:
    """Refuses a `validate`/`test` (``stage``: ``"validation"``, ``"test"``) of a
    module with neither the stage's step nor ``eval_step``, naming the stage's
    step as Lightning does (``test()`` of a module with only
    ``validation_step`` named ``eval_step``)."""
    _jax_module(module)
    if contract.overrides(module, hook):
        return
    step, call = {"validation": ("validation_step", "validate"), "test": ("test_step", "test")}[
        stage
    ]
    raise NotImplementedError(
        f"No `{step}()` method defined to run `Trainer.{call}`: {type(module).__name__} "
        f"defines neither {step}(self, variables, batch) nor eval_step(self, variables, "
        "batch), which serves validation and test alike"
    )


def _required_args(method: Any) -> list[str]:
    """The arguments after ``self`` that a call must pass."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = list(inspect.signature(method).parameters.values())[1:]
    return [p.name for p in params if p.kind in kinds and p.default is inspect.Parameter.empty]


def nnx_model(module: Any) -> None:
    """Refuses an NNX model the Trainer would not find (held elsewhere than
    ``self.model``, without a ``setup``), and the linen signature of `loss` on a
    module that trains an NNX model."""
    cls = type(module)
    if contract.nnx_model(module) is not None:
        args = _required_args(cls.loss)
        if contract.overrides(cls, "loss") and len(args) > 2:
            raise TypeError(
                f"{cls.__name__}.loss(self, {', '.join(args)}) has linen's signature, but "
                f"{cls.__name__} trains the NNX model self.model: here it is "
                "loss(self, model, batch). It receives the model with the current "
                "parameters (in train mode, its RNG streams seeded per step and device); "
                "call it as model(x), without variables or rngs"
            )
        return
    if contract.overrides(cls, contract.init_hook(cls)):
        return
    held = [name for name, value in vars(module).items() if is_nnx(value)]
    if held:
        raise TypeError(
            f"{cls.__name__} holds an NNX model as self.{held[0]} and defines no setup(); "
            f"the Trainer trains an NNX model kept as self.model. Assign it to self.model "
            "in __init__ (loss(self, model, batch) then receives it), or define "
            "setup(self, rng, batch) returning linen variables"
        )


def fit_module(module: Any, options: StepOptions) -> bool:
    """Checks ``module`` for `fit`; whether it optimizes manually (``training_step``)."""
    _jax_module(module)
    nnx_model(module)
    manual = contract.overrides(module, "training_step")
    objective = "training_step" if manual else "loss"
    init = () if contract.nnx_model(module) is not None else (contract.init_hook(module),)
    module_hooks(module, *init, "configure_optimizers", objective)
    if manual and contract.nnx_model(module) is not None:
        raise ValueError("manual optimization (training_step) of NNX models is not supported yet")
    if manual and contract.overrides(module, "loss"):
        raise TypeError(
            f"{type(module).__name__} defines both loss() and training_step(); define "
            "loss() (one update from one loss) or training_step() (manual optimization)"
        )
    if manual and options.accumulate_grad_batches > 1:
        raise ValueError(
            "accumulate_grad_batches with manual optimization (training_step) is not "
            "supported; accumulate inside training_step or use optax.MultiSteps"
        )
    return manual
