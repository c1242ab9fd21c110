"""`LearningRateMonitor`: log the learning rate of the optimizer's next update,
under Lightning's names (``lr-Adam``, ``lr-SGD/encoder``)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxlightning.callbacks.base import Callback
from jaxlightning.training.optimizers import walk_closures
from jaxlightning.training.scales import PlateauScaleState, RollbackScaleState

if TYPE_CHECKING:
    from jaxlightning.callbacks.view import TrainerView
    from jaxlightning.module import JaxModule

# torch's class names for the optax aliases that have a torch counterpart
_TORCH_NAMES = {
    "sgd": "SGD",
    "adamw": "AdamW",
    "rmsprop": "RMSprop",
    "nadam": "NAdam",
    "radam": "RAdam",
    "adamax": "Adamax",
    "adagrad": "Adagrad",
    "adadelta": "Adadelta",
    "lbfgs": "LBFGS",
}


def optimizer_name(factory: Callable[..., Any]) -> str:
    """The name Lightning would log for the optimizer an optax alias builds:
    torch's class name where torch has one (``optax.adamw`` -> ``"AdamW"``,
    ``optax.sgd`` -> ``"SGD"``), else the alias capitalised (``optax.lion`` ->
    ``"Lion"``)."""
    alias = getattr(factory, "__name__", type(factory).__name__)
    return _TORCH_NAMES.get(alias, alias[:1].upper() + alias[1:])


@dataclasses.dataclass(frozen=True)
class Injected:
    """An ``optax.inject_hyperparams`` transformation found in an optimizer.

    Attributes:
        optimizer: the name of the optax alias it wraps (`optimizer_name`).
        schedules: its hyperparameters given as schedules, by name.
    """

    optimizer: str
    schedules: Mapping[str, Any]


def find_injected(tx: Any) -> list[Injected]:
    """The ``optax.inject_hyperparams`` transformations inside ``tx`` (through
    ``optax.chain``, ``optax.MultiSteps`` and other wrappers), in the order
    their states appear in the optimizer state. Read from the closures optax
    builds its transformations from; what is hidden elsewhere is not found."""
    found: list[Injected] = []

    def visit(fn: Any, cells: dict[str, Any]) -> bool:
        if "inner_factory" in cells and "sched_hps" in cells:  # inject_hyperparams' init
            found.append(Injected(optimizer_name(cells["inner_factory"]), dict(cells["sched_hps"])))
            return True
        return False

    walk_closures(tx, visit, max_depth=16)
    return found


def _is_injected(node: Any) -> bool:
    hyperparams = getattr(node, "hyperparams", None)
    return isinstance(hyperparams, dict) and "learning_rate" in hyperparams


def injected_states(opt_state: Any, groups: Mapping[str, Any]) -> list[tuple[str | None, Any]]:
    """Each ``optax.inject_hyperparams`` state with a ``learning_rate`` in
    ``opt_state``, in pytree order, with the group (a key of ``groups``, the
    dict `configure_optimizers` returned) it belongs to (``None``: no group)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=_is_injected)
    out = []
    for path, node in leaves:
        if not _is_injected(node):
            continue
        keys = [getattr(entry, "key", None) for entry in path]
        out.append((next((k for k in keys if isinstance(k, str) and k in groups), None), node))
    return out


def _on_host(node: Any) -> Any:
    """An injected state's count and hyperparameters on the host (not its inner
    state: the optimizer's moments stay on the devices)."""
    if hasattr(node, "_replace") and hasattr(node, "inner_state"):
        node = node._replace(inner_state=None)
    return jax.device_get(node)


def update_scale(opt_state: Any) -> float:
    """The factor the Trainer's own scales put on every update (a
    `ReduceLROnPlateau`'s, a rollback's): the rates an update really uses are
    the optimizer's times it, as torch's scheduler lowers the group's ``lr``."""
    kinds = (PlateauScaleState, RollbackScaleState)
    nodes = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, kinds))
    factor = 1.0
    for node in nodes:
        if isinstance(node, kinds):
            factor *= float(np.asarray(jax.device_get(node.scale)).reshape(-1)[0])
    return factor


def _value(node: Any, name: str, schedules: Mapping[str, Any]) -> float | None:
    """Hyperparameter ``name`` of the next update of the injected state ``node``:
    its schedule at the state's count, or the value in the state (``None``: none)."""
    schedule = schedules.get(name)
    if schedule is not None:
        states = getattr(node, "hyperparams_states", None) or {}
        # optax's stateful schedules take their own state; plain ones the count
        return float(schedule(states[name]) if name in states else schedule(node.count))
    value = node.hyperparams.get(name)
    return None if value is None else float(value)


@dataclasses.dataclass(frozen=True)
class _Site:
    """One learning rate to log: its key and how to read the next update's value."""

    key: str
    schedules: Mapping[str, Any]

    @property
    def scheduled(self) -> bool:
        """Whether the rate follows a schedule (Lightning: has a scheduler)."""
        return "learning_rate" in self.schedules


class LearningRateMonitor(Callback):
    """Logs the learning rate of each optimizer as ``lr-<Optimizer>``, as
    Lightning's callback of the same name does.

    The rate is the one the next update uses: read from the optimizer state of
    ``optax.inject_hyperparams`` (a rate given as a schedule is that schedule at
    the state's count), times the scale a ``ReduceLROnPlateau`` (or a
    rollback) has lowered every update by, as torch's scheduler lowers the
    group's ``lr``; or, with ``schedule``, that schedule at ``global_step``
    on the host. Reading the state waits for the steps in flight, once per
    logging interval. Values go to ``trainer.callback_metrics``, to the
    loggers (at the number of updates made before the one they are for, as in
    Lightning) and to `lrs`.

    Names: ``<Optimizer>`` is the optax alias ``inject_hyperparams`` wraps, in
    torch's spelling where torch has it (``optax.adam`` -> ``lr-Adam``,
    ``optax.sgd`` -> ``lr-SGD``, ``optax.adamw`` -> ``lr-AdamW``; others
    capitalised, ``optax.lion`` -> ``lr-Lion``). Several optimizers (a dict of
    them from ``configure_optimizers``, in its order, or several injected rates
    in one chain) are named as Lightning names several optimizers: the second
    of a kind ``lr-Adam-1``, the third ``lr-Adam-2`` (``{"a": adam, "b": sgd,
    "c": adam}`` -> ``lr-Adam``, ``lr-SGD``, ``lr-Adam-1``). To learn the names
    it calls ``configure_optimizers()`` once more when `fit` starts.

    When `fit` starts it raises without a logger (except with
    ``fast_dev_run``), and when it finds no rate to read (no ``schedule`` and
    no ``inject_hyperparams``).

    Args:
        logging_interval: ``"step"`` (before every ``log_every_n_steps``-th
            update, as Lightning) or ``"epoch"`` (when each epoch starts). With
            ``None`` (Lightning's default: a scheduler's rate at its own
            interval, a rate without scheduler at both) a rate given as a
            schedule is logged by step (an optax schedule moves with every
            update), a constant one by step and when each epoch starts.
        log_momentum: also log ``<key>-momentum`` (``b1`` of Adam-like
            optimizers, else ``momentum``; 0 with a warning if neither is
            injected). Not with ``schedule``.
        log_weight_decay: also log ``<key>-weight_decay`` (0 if not injected).
            Not with ``schedule``.
        log_key_prefix: put in front of every key (``"optim/"`` -> ``optim/lr-Adam``).
        schedule: an optax schedule ``step -> rate`` to log instead of the state's.
        name: the key instead of ``lr-<Optimizer>`` (several optimizers: ``name``,
            ``name-1``, ...).

    Attributes:
        lrs: every logged rate, by key.
        last_momentum_values: the last logged momentum, by ``<key>-momentum``.
        last_weight_decay_values: the last logged weight decay, by ``<key>-weight_decay``.
    """

    def __init__(
        self,
        logging_interval: str | None = None,
        log_momentum: bool = False,
        log_weight_decay: bool = False,
        log_key_prefix: str | None = None,
        schedule: Callable[[int], Any] | None = None,
        name: str | None = None,
    ) -> None:
        if logging_interval not in (None, "step", "epoch"):
            raise ValueError(f"logging_interval={logging_interval!r}: use 'step', 'epoch' or None")
        self.logging_interval = logging_interval
        self.log_momentum, self.log_weight_decay = log_momentum, log_weight_decay
        self.log_key_prefix = log_key_prefix or ""
        self.schedule, self.name = schedule, name
        self.lrs: dict[str, list[float]] = {}
        self.last_momentum_values: dict[str, float | None] = {}
        self.last_weight_decay_values: dict[str, float | None] = {}
        self._groups: Mapping[str, Any] = {}
        self._sites: list[_Site] = []
        self._logged_at = -1

    # ------------------------------------------------------------ fit start
    def on_fit_start(self, trainer: TrainerView, module: JaxModule) -> None:
        """Checks the set-up and names the rates, before the sanity check and training."""
        if not trainer.loggers and not trainer.fast_dev_run:
            raise ValueError(
                "Cannot use LearningRateMonitor callback with Trainer that has no logger: "
                "pass Trainer(logger=...) (True: TensorBoard), or drop the callback"
            )
        self._logged_at = -1
        if self.schedule is not None:
            configured = module.configure_optimizers() if self.name is None else None
            found = find_injected(configured) if configured is not None else []
            key = self._key(self._base(found[0].optimizer if found else None), 0)
            self._sites = [_Site(key, {"learning_rate": self.schedule})]
        else:
            self._sites = self._find_sites(trainer, module)
        self.lrs = {site.key: [] for site in self._sites}
        self.last_momentum_values = dict.fromkeys((f"{s.key}-momentum" for s in self._sites), None)
        self.last_weight_decay_values = dict.fromkeys(
            (f"{s.key}-weight_decay" for s in self._sites), None
        )

    def _find_sites(self, trainer: TrainerView, module: JaxModule) -> list[_Site]:
        """The injected rates in the optimizer state, named from ``configure_optimizers``."""
        configured = module.configure_optimizers()
        self._groups = dict(configured) if isinstance(configured, Mapping) else {}
        states = injected_states(trainer.state.opt_state, self._groups)
        if not states:
            raise ValueError(
                "LearningRateMonitor found no learning rate to log: the optimizer from "
                "configure_optimizers() does not inject it. Wrap the optimizer with "
                "optax.inject_hyperparams, e.g. "
                "optax.inject_hyperparams(optax.adam)(learning_rate=1e-3) (a schedule works "
                "too), or pass LearningRateMonitor(schedule=...)"
            )
        if self.log_momentum and not all(
            "b1" in node.hyperparams or "momentum" in node.hyperparams for _, node in states
        ):
            warnings.warn(
                "You have set log_momentum=True, but some optimizers do not have momentum "
                "(no injected b1 or momentum). This will log a value 0 for the momentum.",
                RuntimeWarning,
                stacklevel=2,
            )
        found = {
            group: find_injected(self._groups[group] if group is not None else configured)
            for group in {group for group, _ in states}
        }
        sites, in_group, seen = [], {}, {}
        for group, _ in states:
            index = in_group[group] = in_group.get(group, -1) + 1
            injected = found[group][index] if index < len(found[group]) else None
            optimizer = injected.optimizer if injected is not None else None
            schedules = injected.schedules if injected is not None else {}
            base = self._base(optimizer)
            repeat = seen[base] = seen.get(base, -1) + 1
            sites.append(_Site(self._key(base, repeat), schedules))
        return sites

    def _base(self, optimizer: str | None) -> str:
        """``lr-<Optimizer>`` (``name`` instead, where given)."""
        return self.name or (f"lr-{optimizer}" if optimizer else "lr")

    def _key(self, base: str, repeat: int) -> str:
        """``<prefix><base>[-<repeat>]``: Lightning's rule, the second optimizer of a
        kind is ``lr-Adam-1``, the third ``lr-Adam-2``."""
        return f"{self.log_key_prefix}{base}" + (f"-{repeat}" if repeat else "")

    # -------------------------------------------------------------- logging
    def needs_each_step(self) -> bool:
        """Logging at the epoch reads no step's own state; at steps it does."""
        return self.logging_interval != "epoch"

    def on_train_batch_start(self, trainer: TrainerView, module: JaxModule, batch_idx: int) -> None:
        """Before every ``log_every_n_steps``-th update (Lightning's steps) and while a
        requested stop waits."""
        step = trainer.global_step
        due = (step + 1) % trainer.log_every_n_steps == 0 or trainer.should_stop
        if self.logging_interval != "epoch" and due and step != self._logged_at:
            self._logged_at = step
            self._log(trainer, self._sites)

    def on_train_epoch_start(self, trainer: TrainerView, module: JaxModule) -> None:
        """When the epoch starts; with ``logging_interval=None`` the constant rates only."""
        if self.logging_interval == "epoch":
            self._log(trainer, self._sites)
        elif self.logging_interval is None:
            self._log(trainer, [site for site in self._sites if not site.scheduled])

    def _log(self, trainer: TrainerView, sites: list[_Site]) -> None:
        """Logs the values of ``sites`` as Lightning's callback does: straight to the
        loggers, at the number of updates made so far (the step of the update they
        precede), and into ``trainer.callback_metrics`` (where `EarlyStopping` or
        `ModelCheckpoint` can monitor them)."""
        if not sites:
            return
        stats = self._stats(trainer, sites)
        trainer.callback_metrics.update(stats)
        for logger in trainer.loggers:
            logger.log_metrics(stats, step=trainer.global_step)

    def _stats(self, trainer: TrainerView, sites: list[_Site]) -> dict[str, float]:
        """The values of ``sites`` to log now, by key; also recorded in `lrs` and
        the ``last_*`` dicts."""
        if self.schedule is not None:
            (site,) = self._sites
            rate = float(self.schedule(trainer.global_step))
            self.lrs[site.key].append(rate)
            return {site.key: rate}
        states = injected_states(trainer.state.opt_state, self._groups)
        scale = update_scale(trainer.state.opt_state)  # a plateau's lowering, say
        stats: dict[str, float] = {}
        for site, (_, node) in zip(self._sites, states, strict=True):
            if site not in sites:
                continue
            node = _on_host(node)
            rate = (_value(node, "learning_rate", site.schedules) or 0.0) * scale
            stats[site.key] = rate
            self.lrs[site.key].append(rate)
            if self.log_momentum:
                momentum = _value(node, "b1", site.schedules)
                if momentum is None:
                    momentum = _value(node, "momentum", site.schedules)
                stats[f"{site.key}-momentum"] = momentum or 0.0
                self.last_momentum_values[f"{site.key}-momentum"] = momentum or 0.0
            if self.log_weight_decay:
                decay = _value(node, "weight_decay", site.schedules) or 0.0
                stats[f"{site.key}-weight_decay"] = decay
                self.last_weight_decay_values[f"{site.key}-weight_decay"] = decay
        return stats
