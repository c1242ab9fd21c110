"""`BaseFinetuning` and `BackboneFinetuning`: Lightning's fine-tuning callbacks.

Lightning freezes modules (``requires_grad=False``) and, at some epoch, adds
their parameters to the live optimizer as a new parameter group with its own
rate. An optax optimizer cannot grow a parameter group: its state is a pytree
fixed when the train step compiles. So here the groups are declared before
training and the optimizer is split by them from the start:

- a group is a **path prefix** of the params pytree: ``"backbone"`` is every
  leaf under ``params["backbone"]``, ``"encoder/layers_0"`` every leaf under
  ``params["encoder"]["layers_0"]``;
- `BaseFinetuning.freeze_before_training` declares the groups that start
  frozen (`BaseFinetuning.freeze`);
- when `fit` starts, the optimizer ``tx`` becomes
  ``optax.multi_transform({group: gated(tx), ..., rest: tx}, labels)``: every
  group gets its own copy of the optimizer's state, behind a gate
  (`FinetuneGate`) whose scalars the host writes between steps
  (``trainer.edit.set_optimizer_state``: nothing recompiles, and a checkpoint holds
  them, so a run resumes bit-exactly);
- while a group is frozen its updates are exactly zero (no weight decay
  either) and its optimizer state is not touched (the inner update is not
  computed: ``jax.lax.cond``). A group unfrozen for the first time therefore
  starts from a fresh optimizer state (Adam's moments and count at zero), as
  the parameter group torch adds does.
- a trainable group runs the optimizer's update scaled to the group's rate:
  by ``lr / lr(count)`` where ``lr(count)`` is the optimizer's own rate
  (constant or schedule, `base_learning_rate`) at the group's update count.
  That is exact for every optimizer whose update is proportional to its rate
  (SGD, Adam, AdamW, RMSprop...). The group then trains at the constant
  ``lr`` its callback set, as a torch parameter group does, until the callback
  sets another.

Where JAX makes it differ from Lightning:

- the gradient of a frozen group is still computed (the model's loss is
  differentiated with respect to every parameter); its update is dropped. Put
  ``jax.lax.stop_gradient`` in the model to save that work;
- ``train_bn`` is accepted and kept, but cannot switch a flax ``BatchNorm``
  between training and evaluation mode from outside the model: the statistics
  of a frozen group's BatchNorm layers keep updating (Lightning's
  ``train_bn=True``) unless the model passes ``use_running_average`` itself,
  and its scale and bias are frozen with the rest of the group (Lightning's
  ``train_bn=False``);
- ``Trainer(gradient_clip_val=...)`` clips inside each group's copy of the
  optimizer, so a norm clip takes each group's norm on its own once a group
  is trainable (while it is frozen, the rest is clipped alone, as in
  Lightning, whose frozen parameters have no gradient);
- the callback must come before `EMA` and `StochasticWeightAveraging` in the
  callbacks (their transformations must follow the split optimizer).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxlightning.callbacks.base import Callback
from jaxlightning.callbacks.ema import EMA
from jaxlightning.callbacks.swa import StochasticWeightAveraging, base_learning_rate
from jaxlightning.cluster.rank_zero import rank_zero_info

if TYPE_CHECKING:
    from jaxlightning.callbacks.view import TrainerView
    from jaxlightning.module import JaxModule

REST = "~rest"  # the label of the parameters in no group


class FinetuneGate(NamedTuple):
    """The state `gated` keeps around a group's optimizer state. The host
    writes ``trainable``, ``lr`` and ``lr_scale``; the step moves ``count``
    and ``inner``. Each group's gate is its own subclass of this type
    (`BaseFinetuning.gate_type`), so ``set_optimizer_state`` reaches one group."""

    trainable: jax.Array  # bool: whether the group trains
    lr: jax.Array  # the group's rate; NaN: the optimizer's own (times lr_scale)
    lr_scale: jax.Array  # a factor on the updates (the rate when lr(count) is unknown)
    count: jax.Array  # the group's updates while trainable
    inner: Any  # the optimizer's state for the group


def gated(
    tx: optax.GradientTransformation,
    base_rate: Callable[[jax.Array], jax.Array] | None,
    kind: type[FinetuneGate] = FinetuneGate,
) -> optax.GradientTransformationExtraArgs:
    """``tx`` behind a gate: zero updates and an untouched state while
    ``trainable`` is off; ``tx``'s updates scaled to the group's rate while on.

    Args:
        tx: the optimizer (for one group: put inside ``optax.multi_transform``).
        base_rate: ``tx``'s own rate at an update count (`base_learning_rate`);
            with ``None`` only ``lr_scale`` scales the updates (``lr`` is not used).
        kind: the state's type (a subclass of `FinetuneGate`).
    """
    inner_tx = optax.with_extra_args_support(tx)

    def init(params: Any) -> FinetuneGate:
        return kind(
            trainable=jnp.zeros((), bool),
            lr=jnp.full((), jnp.nan, jnp.float32),
            lr_scale=jnp.ones((), jnp.float32),
            count=jnp.zeros((), jnp.int32),
            inner=inner_tx.init(params),
        )

    def update(
        updates: Any, state: FinetuneGate, params: Any = None, **extra: Any
    ) -> tuple[Any, FinetuneGate]:
        def train(operand: tuple[Any, Any]) -> tuple[Any, Any]:
            grads, inner = operand
            new, inner = inner_tx.update(grads, inner, params, **extra)
            ratio = state.lr_scale
            if base_rate is not None:
                base = jnp.asarray(base_rate(state.count), jnp.float32)
                # lr(count) == 0: tx's update is zero already, whatever the ratio
                own = jnp.isnan(state.lr) | (base == 0)
                ratio = ratio * jnp.where(own, 1.0, state.lr / jnp.where(base == 0, 1.0, base))
            new = jax.tree.map(lambda u: (u * ratio.astype(u.dtype)).astype(u.dtype), new)
            return new, inner

        def hold(operand: tuple[Any, Any]) -> tuple[Any, Any]:
            shapes = jax.eval_shape(lambda o: train(o)[0], operand)
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            return zeros, operand[1]

        new, inner = jax.lax.cond(state.trainable, train, hold, (updates, state.inner))
        count = jnp.where(state.trainable, optax.safe_increment(state.count), state.count)
        return new, state._replace(count=count, inner=inner)

    return optax.GradientTransformationExtraArgs(init, update)


# ------------------------------------------------------------------ paths
def _split(group: Any) -> tuple[str, ...]:
    if not isinstance(group, str) or not group or any(not p for p in group.split("/")):
        raise ValueError(
            f"parameter group {group!r}: name it by a path prefix of the params, "
            "e.g. 'backbone' or 'encoder/layers_0'"
        )
    return tuple(group.split("/"))


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _top_level(params: Any) -> list[str]:
    if isinstance(params, Mapping):
        return sorted(str(k) for k in params)
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    return sorted({_key_name(path[0]) for path in paths if path})


# --------------------------------------------------------------- callback
class BaseFinetuning(Callback):
    """Lightning's ``BaseFinetuning``: override `freeze_before_training` to
    declare the parameter groups that start frozen, and `finetune_function`
    (called at every epoch's start) to unfreeze them. A group is a path prefix
    of the params (``"backbone"``); see the module's docstring for how the
    optimizer is split.

    Example::

        class FreezeUnfreeze(jl.callbacks.BaseFinetuning):
            def freeze_before_training(self, module):
                self.freeze("backbone")

            def finetune_function(self, trainer, module, epoch):
                if epoch == 10:
                    self.unfreeze_and_add_param_group(trainer, "backbone")

    The groups are declared in `setup` (``stage="fit"``, Lightning's place:
    it runs before the Trainer builds the optimizer, which happens before
    ``on_fit_start``), and fixed from then on: `freeze` after that raises.
    Override `setup` only with a call to ``super().setup(...)``.
    """

    def __init__(self) -> None:
        self._groups: dict[str, bool] = {}  # group -> train_bn
        self._kinds: dict[str, type[FinetuneGate]] = {}
        self._started = False
        self._base_rate: Callable[[jax.Array], jax.Array] | None = None

    # ------------------------------------------------------ user overrides
    def freeze_before_training(self, module: JaxModule) -> None:
        """Override: declare the groups to freeze (`freeze`), before training.

        Args:
            module: the module being fit.
        """
        raise NotImplementedError(
            f"{type(self).__name__}: override freeze_before_training(module) to freeze groups"
        )

    def finetune_function(self, trainer: TrainerView, module: JaxModule, epoch: int) -> None:
        """Override: unfreeze groups or change their rates; called when each
        training epoch starts (Lightning's ``finetune_function(pl_module,
        epoch, optimizer)``; the optimizer is reached through ``trainer``).

        Args:
            trainer: the Trainer (`unfreeze_and_add_param_group` and
                `set_group_lr` write through it).
            module: the module being fit.
            epoch: the epoch starting (0-based).
        """
        raise NotImplementedError(
            f"{type(self).__name__}: override finetune_function(trainer, module, epoch)"
        )

    # ----------------------------------------------------------- the groups
    @property
    def groups(self) -> dict[str, bool]:
        """The declared groups, each with its ``train_bn``."""
        return dict(self._groups)

    def gate_type(self, group: str) -> type[FinetuneGate]:
        """The `FinetuneGate` subclass of ``group``'s state (one per group and
        callback, for ``trainer.edit.set_optimizer_state``)."""
        key = "/".join(_split(group))
        if key not in self._kinds:
            self._kinds[key] = type(f"FinetuneGate[{key}]", (FinetuneGate,), {"__slots__": ()})
        return self._kinds[key]

    def freeze(self, groups: str | Iterable[str], train_bn: bool = True) -> None:
        """Declares ``groups`` frozen from the first step (in
        `freeze_before_training`).

        Args:
            groups: a path prefix of the params (``"backbone"``,
                ``"encoder/layers_0"``) or several.
            train_bn: kept for Lightning's signature; it cannot change a flax
                BatchNorm's mode (see the module's docstring).

        Raises:
            RuntimeError: once `fit` has built its optimizer.
            ValueError: a group inside (or around) another group.
        """
        names = [groups] if isinstance(groups, str) else list(groups)
        for group in names:
            parts = _split(group)
            key = "/".join(parts)
            if self._started:
                raise RuntimeError(
                    f"{type(self).__name__}.freeze({key!r}) after fit started: the "
                    "optimizer's parameter groups are fixed when it is built (optax cannot "
                    "add a group to a compiled optimizer state). Declare every group to "
                    "freeze in freeze_before_training; train it later with "
                    "unfreeze_and_add_param_group or make_trainable"
                )
            for other in self._groups:
                theirs = tuple(other.split("/"))
                n = min(len(parts), len(theirs))
                if other != key and parts[:n] == theirs[:n]:
                    raise ValueError(
                        f"parameter groups {other!r} and {key!r} overlap (one is inside the "
                        "other): a parameter can be in one group only"
                    )
            self._groups[key] = bool(train_bn)

    def _gate(self, group: str) -> type[FinetuneGate]:
        key = "/".join(_split(group))
        if key not in self._groups:
            raise ValueError(
                f"parameter group {key!r} was not frozen before training: declare it with "
                f"self.freeze({key!r}) in freeze_before_training (declared: "
                f"{sorted(self._groups) or 'none'})"
            )
        return self.gate_type(key)

    def _labels(self, params: Any) -> Any:
        groups = {g: tuple(g.split("/")) for g in self._groups}
        used: set[str] = set()

        def label(path: Any, _: Any) -> str:
            names = tuple(_key_name(k) for k in path)
            for group, parts in groups.items():
                if names[: len(parts)] == parts:
                    used.add(group)
                    return group
            return REST

        labels = jax.tree_util.tree_map_with_path(label, params)
        missing = [g for g in groups if g not in used]
        if missing:
            raise ValueError(
                f"{type(self).__name__}: parameter group {missing[0]!r} matches no parameter; "
                f"the params' top-level names are {_top_level(params)}"
            )
        return labels

    # ------------------------------------------------------------- the rates
    def current_learning_rate(self, trainer: TrainerView) -> float | None:
        """The optimizer's own rate for its next update (its schedule at
        ``trainer.global_step``; Lightning's ``param_groups[0]["lr"]``), or
        ``None`` where it has not exactly one rate (`base_learning_rate`).
        A ``ReduceLROnPlateau`` scale is not in it."""
        if self._base_rate is None:
            return None
        rate = np.float32(self._base_rate(jnp.asarray(trainer.global_step, jnp.int32)))
        return float(str(rate))  # the shortest decimal of the float32: 0.01, not 0.00999999977

    def _rate_needed(self, trainer: TrainerView, what: str) -> float:
        rate = self.current_learning_rate(trainer)
        if rate is None:
            raise ValueError(
                f"{type(self).__name__}: {what} needs the optimizer's learning rate, and "
                "could not find exactly one in it: build the optimizer with an optax alias "
                "and one rate (optax.adam(1e-3), optax.sgd(schedule), "
                "optax.inject_hyperparams(...)(learning_rate=...))"
            )
        return rate

    def make_trainable(self, trainer: TrainerView, groups: str | Iterable[str]) -> None:
        """Lets frozen ``groups`` train again, at the rate they had (the
        optimizer's own rate if none was set), with their optimizer state as
        it was.

        Args:
            trainer: the Trainer.
            groups: declared groups.
        """
        for group in [groups] if isinstance(groups, str) else list(groups):
            trainer.edit.set_optimizer_state(self._gate(group), trainable=True)

    def unfreeze_and_add_param_group(
        self,
        trainer: TrainerView,
        groups: str | Iterable[str],
        lr: float | None = None,
        initial_denom_lr: float = 10.0,
        train_bn: bool = True,
    ) -> float | None:
        """Starts training ``groups`` at rate ``lr``, or at the optimizer's
        current rate divided by ``initial_denom_lr`` (Lightning's semantics). A
        group trainable for the first time starts with a fresh optimizer
        state, as torch's added parameter group.

        Args:
            trainer: the Trainer.
            groups: declared groups (one or several).
            lr: the groups' rate.
            initial_denom_lr: with ``lr=None``, the rate is the optimizer's
                current one over this.
            train_bn: kept for Lightning's signature (see `freeze`).

        Returns:
            The groups' rate; ``None`` when the optimizer's rate is unknown and
            the groups train at its own rate times ``1 / initial_denom_lr``.

        Raises:
            ValueError: ``lr`` given and the optimizer's rate not found.
        """
        del train_bn
        names = [groups] if isinstance(groups, str) else list(groups)
        if lr is None and self._base_rate is None:
            for group in names:
                trainer.edit.set_optimizer_state(
                    self._gate(group), trainable=True, lr=math.nan, lr_scale=1 / initial_denom_lr
                )
            return None
        if lr is None:
            rate = self._rate_needed(trainer, "unfreeze_and_add_param_group") / initial_denom_lr
        else:
            self._rate_needed(trainer, f"unfreeze_and_add_param_group(lr={lr})")
            rate = float(lr)
        for group in names:
            trainer.edit.set_optimizer_state(
                self._gate(group), trainable=True, lr=rate, lr_scale=1.0
            )
        return rate

    def set_group_lr(self, trainer: TrainerView, groups: str | Iterable[str], lr: float) -> None:
        """Sets ``groups``' rate (Lightning's ``param_groups[i]["lr"] = lr``).

        Args:
            trainer: the Trainer.
            groups: declared groups.
            lr: the new rate.
        """
        self._rate_needed(trainer, f"set_group_lr(lr={lr})")
        for group in [groups] if isinstance(groups, str) else list(groups):
            trainer.edit.set_optimizer_state(self._gate(group), lr=float(lr), lr_scale=1.0)

    # ---------------------------------------------------------------- hooks
    def setup(self, trainer: TrainerView, module: JaxModule, stage: str) -> None:
        """For `fit`: declares the groups afresh (`freeze_before_training`),
        before the Trainer builds the optimizer."""
        if stage != "fit":
            return
        callbacks = list(trainer.callbacks)
        mine = next((i for i, c in enumerate(callbacks) if c is self), 0)
        for other in callbacks[:mine]:
            if isinstance(other, (EMA, StochasticWeightAveraging)):
                raise ValueError(
                    f"put {type(self).__name__} before {type(other).__name__} in the "
                    "callbacks: its optimizer transformation must follow the split by groups"
                )
        self._groups, self._started = {}, False
        self.freeze_before_training(module)

    def transform_optimizer(self, tx: optax.GradientTransformation) -> Any:
        """``tx`` split by the declared groups: each behind its gate (`gated`),
        the other parameters with ``tx`` itself; ``tx`` when none is declared."""
        self._started = True
        self._base_rate = base_learning_rate(tx)
        if not self._groups:
            return tx
        transforms: dict[str, Any] = {
            group: gated(tx, self._base_rate, self.gate_type(group)) for group in self._groups
        }
        transforms[REST] = tx
        return optax.multi_transform(transforms, self._labels)

    def on_train_epoch_start(self, trainer: TrainerView, module: JaxModule) -> None:
        """Calls `finetune_function` with the epoch starting."""
        self.finetune_function(trainer, module, trainer.current_epoch)


def multiplicative(epoch: int) -> float:
    """`BackboneFinetuning`'s default ``lambda_func`` (Lightning's): 2.0."""
    return 2.0


class BackboneFinetuning(BaseFinetuning):
    """Lightning's ``BackboneFinetuning``: the ``backbone`` group is frozen
    until epoch ``unfreeze_backbone_at_epoch``; then it trains at
    ``backbone_initial_lr`` (default: the optimizer's current rate times
    ``backbone_initial_ratio_lr``), and at every later epoch ``e`` at
    ``lambda_func(e + 1)`` times its previous rate, capped at the optimizer's
    current rate when ``should_align``.

    Args:
        unfreeze_backbone_at_epoch: the epoch (0-based) the backbone starts training.
        lambda_func: ``epoch -> factor`` on the backbone's rate at each later epoch.
        backbone_initial_ratio_lr: the backbone's first rate, as a share of
            the optimizer's.
        backbone_initial_lr: the backbone's first rate (replaces the ratio).
        should_align: cap the backbone's rate at the optimizer's.
        initial_denom_lr: passed to `unfreeze_and_add_param_group` (it only
            matters there without a rate, which this callback always gives).
        train_bn: kept for Lightning's signature (see `BaseFinetuning.freeze`).
        verbose: log both rates at each of the backbone's epochs.
        rounding: digits of the logged rates.
        backbone: the backbone's path prefix in the params (Lightning: the
            ``pl_module.backbone`` module).

    Attributes:
        previous_backbone_lr: the backbone's rate of the last epoch (saved in
            checkpoints).
    """

    def __init__(
        self,
        unfreeze_backbone_at_epoch: int = 10,
        lambda_func: Callable[[int], float] = multiplicative,
        backbone_initial_ratio_lr: float = 10e-2,
        backbone_initial_lr: float | None = None,
        should_align: bool = True,
        initial_denom_lr: float = 10.0,
        train_bn: bool = True,
        verbose: bool = False,
        rounding: int = 12,
        backbone: str = "backbone",
    ) -> None:
        super().__init__()
        if (
            not isinstance(unfreeze_backbone_at_epoch, int)
            or isinstance(unfreeze_backbone_at_epoch, bool)
            or unfreeze_backbone_at_epoch < 0
        ):
            raise ValueError(
                f"BackboneFinetuning(unfreeze_backbone_at_epoch={unfreeze_backbone_at_epoch!r}): "
                "use an epoch, an int >= 0"
            )
        if not callable(lambda_func):
            raise ValueError(
                f"BackboneFinetuning(lambda_func={lambda_func!r}): use epoch -> factor"
            )
        _split(backbone)
        self.unfreeze_backbone_at_epoch = unfreeze_backbone_at_epoch
        self.lambda_func = lambda_func
        self.backbone_initial_ratio_lr = backbone_initial_ratio_lr
        self.backbone_initial_lr = backbone_initial_lr
        self.should_align = should_align
        self.initial_denom_lr = initial_denom_lr
        self.train_bn = train_bn
        self.verbose = verbose
        self.rounding = rounding
        self.backbone = backbone
        self.previous_backbone_lr: float | None = None

    def freeze_before_training(self, module: JaxModule) -> None:
        """Freezes the ``backbone`` group."""
        self.freeze(self.backbone, train_bn=self.train_bn)

    def transform_optimizer(self, tx: optax.GradientTransformation) -> Any:
        """As `BaseFinetuning.transform_optimizer`; refuses an optimizer whose
        one learning rate is not found (the schedule is relative to it)."""
        out = super().transform_optimizer(tx)
        if self._base_rate is None:
            raise ValueError(
                "BackboneFinetuning sets the backbone's rate from the optimizer's, and could "
                "not find exactly one learning rate in it: build the optimizer with an optax "
                "alias and one rate (optax.adam(1e-3), optax.sgd(schedule), "
                "optax.inject_hyperparams(...)(learning_rate=...))"
            )
        return out

    def finetune_function(self, trainer: TrainerView, module: JaxModule, epoch: int) -> None:
        """Unfreezes the backbone at ``unfreeze_backbone_at_epoch`` and sets
        its rate at every later epoch (Lightning's schedule; see the class)."""
        if epoch < self.unfreeze_backbone_at_epoch:
            return
        current = self._rate_needed(trainer, "BackboneFinetuning")
        if epoch == self.unfreeze_backbone_at_epoch:
            rate = (
                self.backbone_initial_lr
                if self.backbone_initial_lr is not None
                else current * self.backbone_initial_ratio_lr
            )
            self.unfreeze_and_add_param_group(
                trainer,
                self.backbone,
                rate,
                initial_denom_lr=self.initial_denom_lr,
                train_bn=self.train_bn,
            )
        else:
            if self.previous_backbone_lr is None:
                raise RuntimeError(
                    f"BackboneFinetuning: epoch {epoch} is past the backbone's unfreezing "
                    f"(epoch {self.unfreeze_backbone_at_epoch}) but no backbone rate is known "
                    "(a checkpoint from a run without this callback?)"
                )
            rate = self.lambda_func(epoch + 1) * self.previous_backbone_lr
            if self.should_align and rate > current:
                rate = current
            self.set_group_lr(trainer, self.backbone, rate)
        self.previous_backbone_lr = rate
        if self.verbose:
            rank_zero_info(
                f"Current lr: {round(current, self.rounding)}, "
                f"Backbone lr: {round(rate, self.rounding)}"
            )

    def state_dict(self) -> dict[str, Any]:
        """``previous_backbone_lr``, for a resumed run to go on with the schedule
        (the gates' flags and rates are in the optimizer state)."""
        return {"previous_backbone_lr": self.previous_backbone_lr}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores `state_dict`'s ``previous_backbone_lr``."""
        self.previous_backbone_lr = state.get("previous_backbone_lr")
