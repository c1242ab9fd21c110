"""Pure per-device step functions: train, eval and predict. Traced code.

Each builder returns a function of *one device's shard* that runs inside the
strategy's SPMD context (`jax.pmap` or `jax.shard_map`) over the axis `AXIS`.
Under data parallelism everything that crosses devices goes through one `psum`
per step (plus a `pmax`/`pmin` when a value is logged with
``reduce_fx="max"``/``"min"``); a state-sharding strategy (FSDP) passes its own
gradient reduction (a reduce-scatter) and the rest keeps the one `psum`. No I/O
and no reference to the Trainer: the functions close over the module and
optimizer only. Gradient clipping is not here: it is a transformation in front
of the optimizer (`StepOptions.with_clipping`), so every strategy applies it alike.

Logged values are `clu.metrics` states keyed by name (see `jaxlightning.metrics.logged`);
a step merges its batch's states into the accumulator it is given, so
reductions over many steps stay exact and are fetched to the host only when
reported.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from clu import metrics as clu_metrics

from jaxlightning.metrics.logged import (
    Average,
    Extreme,
    LogOptions,
    Rows,
    Total,
    across_devices,
    from_logged,
    settle,
    zero,
)
from jaxlightning.module import JaxModule
from jaxlightning.training import contract
from jaxlightning.training.loss_scale import LossScaleState, next_scale
from jaxlightning.training.losses import loss_terms, pmean_floats
from jaxlightning.training.optimizers import Groups, Optimizers
from jaxlightning.training.precision import computing, for_compute
from jaxlightning.training.state import AccumulatingState, TrainState, keep_if

AXIS = "batch"
"""The device axis the step functions run over (exported as ``jl.AXIS``): name it in
collectives of your own, e.g. ``nn.BatchNorm(axis_name=jl.AXIS)`` for BatchNorm
statistics over the global batch, or ``jax.lax.pmean(x, jl.AXIS)``."""
Metrics = dict[str, clu_metrics.Metric]


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """What the train step does to the averaged gradient (Trainer arguments).

    Attributes:
        gradient_clip_val: clip the gradient (``None``: no clipping).
        gradient_clip_algorithm: ``"norm"`` (``optax.clip_by_global_norm``) or
            ``"value"`` (``optax.clip``, element-wise).
        log_grad_norm: log the global norm of the averaged gradient, before
            clipping, as ``train/grad_norm``.
        accumulate_grad_batches: micro-batches per optimizer update; the state
            is then an `AccumulatingState` that sums their gradients.
        precision: see `jaxlightning.training.precision`.
        on_nonfinite: ``"raise"`` (apply every update; the loop raises at the
            next report when a loss was not finite), ``"skip"`` (an update
            whose loss or gradient is not finite leaves the state as it was) or
            ``"rollback"`` (apply every update and log each interval's largest
            step loss, ``loss_max``: the loop goes back to its last good state
            when a check finds a bad one; see `jaxlightning.callbacks.rollback`).
        log_loss: report what ``loss()`` returns as ``train/loss`` (the mean of
            each logging interval: loggers, ``callback_metrics``, the bar). Off,
            the step still keeps it for its own checks and reports it nowhere
            (Lightning reports only what the user logged).
        step_values: what a name the user logs with ``on_step=True`` reports
            at a logging step: ``"last"``, the step's own value (Lightning's),
            or ``"interval"``, its ``reduce_fx`` over every step since the
            last report (smoother curves, the same cost).
    """

    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str = "norm"
    log_grad_norm: bool = False
    accumulate_grad_batches: int = 1
    precision: str = "32-true"
    on_nonfinite: str = "raise"
    log_loss: bool = False
    step_values: str = "last"

    @property
    def skip_nonfinite(self) -> bool:
        """Whether a non-finite update is skipped: asked for, or part of
        float16's loss scaling (an overflow halves the scale)."""
        return self.on_nonfinite == "skip" or self.loss_scaled

    @property
    def loss_scaled(self) -> bool:
        return self.precision == "16-mixed"

    def with_clipping(self, tx: Any) -> Any:
        """``tx`` with the gradient clipping in front of it, as one optax chain
        (for manual optimization's `Groups`, in front of each group's)."""
        if self.gradient_clip_val is None:
            return tx
        if self.gradient_clip_algorithm == "norm":
            clipper = optax.clip_by_global_norm(self.gradient_clip_val)
        else:
            clipper = optax.clip(self.gradient_clip_val)
        if isinstance(tx, Groups):
            return Groups({key: optax.chain(clipper, t) for key, t in tx.txs.items()})
        return optax.chain(clipper, tx)


Options = dict[str, LogOptions]
# The Trainer's own training loss, as reported (``log_loss=True``): per
# interval, in the bar; else kept for the Trainer's checks, reported nowhere.
LOSS_OPTIONS = LogOptions(on_step=True, on_epoch=False, prog_bar=True)
HIDDEN_LOSS_OPTIONS = LogOptions(on_step=True, on_epoch=False, logger=False, hidden=True)
GRAD_NORM_OPTIONS = LogOptions(on_step=True, on_epoch=False)
# Under on_nonfinite="skip": the updates skipped in each logging interval.
# The Trainer's own training values carry their full names (user names are
# reported as logged, or with a stage prefix under Trainer(stage_prefix=True)).
LOSS = "train/loss"
HIDDEN_LOSS = "jaxlightning/loss"
GRAD_NORM = "train/grad_norm"
SKIPPED = "train/skipped_updates"
SKIPPED_OPTIONS = LogOptions(on_step=True, on_epoch=False, reduce_fx="sum")
# Under on_nonfinite="rollback": the largest step loss of each logging interval.
LOSS_MAX = "train/loss_max"
LOSS_MAX_OPTIONS = LogOptions(on_step=True, on_epoch=False, reduce_fx="max")
TRAINER_NAMES = frozenset({LOSS, HIDDEN_LOSS, GRAD_NORM, SKIPPED, LOSS_MAX})


def loss_key(user_names: Any) -> str:
    """The name the step keeps what ``loss()`` returns under: ``train/loss``
    (reported under ``log_loss``; the same name either way, so checkpoints
    resume whatever the setting), or, when the module logs ``train/loss``
    itself, a name no user takes."""
    return HIDDEN_LOSS if LOSS in user_names else LOSS


def kept_loss(metrics: Mapping[str, Any]) -> str:
    """The name the step's loss is under in ``metrics`` (see `loss_key`)."""
    return HIDDEN_LOSS if HIDDEN_LOSS in metrics else LOSS


@flax.struct.dataclass
class TrainMetrics:
    """What train steps accumulate.

    Attributes:
        metrics: logged values by name since the last report, ``"train/loss"`` among
            them (reset at each report and at each epoch's end).
        epoch: the values of names logged with ``on_epoch=True``, since the
            epoch began (reset at its end).
        first_nonfinite: the first global step (1-based) whose loss was not
            finite, or 0. Checked on the host at each report and before each
            checkpoint, so detecting a bad loss costs no per-step sync.
    """

    metrics: Metrics
    epoch: Metrics
    first_nonfinite: jax.Array


def device_keys(rng: jax.Array, step: jax.Array, streams: tuple[str, ...]) -> dict[str, jax.Array]:
    """Keys for one device and one step, one per named stream, derived on device."""
    key = jax.random.fold_in(jax.random.fold_in(rng, step), jax.lax.axis_index(AXIS))
    return {name: jax.random.fold_in(key, i) for i, name in enumerate(streams)}


def _logged_metrics(logged: Mapping[str, Any], mask: jax.Array) -> Metrics:
    return {name: from_logged(name, value, mask, opts) for name, (value, opts) in logged.items()}


def _reduced(metrics: Metrics, tree: Any = None) -> tuple[Any, Metrics]:
    """``(tree, metrics)`` summed across the devices, metrics settled."""
    tree, metrics = across_devices(AXIS, metrics, tree)
    return tree, settle(metrics)


def _unpack(rows: Any) -> tuple[jax.Array, jax.Array]:
    """One device's `Rows`: its mask and (one value) the batch's epoch."""
    return rows.mask, rows.epoch[0]


def _kinds(metrics: Metrics) -> dict[str, Any]:
    return {name: (type(m), getattr(m, "op", None)) for name, m in metrics.items()}


def _merge(acc: Metrics, new: Metrics, hook: str) -> Metrics:
    """``new`` merged into ``acc``; a rank metric's `Rows` pass through as this
    step's (the evaluation loop keeps them: they are not in ``acc``)."""
    carried = {name: m for name, m in new.items() if not isinstance(m, Rows)}
    if _kinds(acc) != _kinds(carried):
        raise ValueError(
            f"{hook}() logged {sorted(new)} in this trace but {sorted(acc)} when the "
            "Trainer first traced it (or with another reduce_fx); log the same names "
            "the same way every time (a Python condition on shapes or attributes can "
            "change them between traces)"
        )
    return {name: acc[name].merge(m) if name in carried else m for name, m in new.items()}


def _merge_train(
    acc: TrainMetrics,
    new: Metrics,
    step: jax.Array,
    finite: jax.Array,
    hook: str,
    step_values: str = "interval",
) -> TrainMetrics:
    """``new`` merged into the epoch's accumulators, and into the interval's
    (``step_values="interval"``) or, for the user's names, replacing them
    (``"last"``: the step's own value; the Trainer's names always reduce over
    the interval: rollback reads the interval's largest loss)."""
    bad = jnp.where(finite, 0, step).astype(jnp.int32)
    first = jnp.where(acc.first_nonfinite > 0, acc.first_nonfinite, bad)
    epoch = _merge(acc.epoch, {name: new[name] for name in acc.epoch if name in new}, hook)
    metrics = _merge(acc.metrics, new, hook)
    if step_values == "last":
        users = HIDDEN_LOSS in new or hook == "training_step"  # train/loss is the module's
        own = TRAINER_NAMES - ({LOSS} if users else set())
        metrics.update({name: m for name, m in new.items() if name not in own})
    return TrainMetrics(metrics, epoch, first)


def all_finite(tree: Any) -> jax.Array:
    """Whether every element of every floating array of ``tree`` is finite."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves] or [jnp.bool_(True)]))


def _merge_checked(
    acc: TrainMetrics,
    new: Metrics,
    step: jax.Array,
    finite: jax.Array,
    hook: str,
    options: StepOptions,
) -> TrainMetrics:
    """`_merge_train`; under ``on_nonfinite="skip"`` a skipped step's logged
    values are left out (its loss is not finite) and it is counted as skipped."""
    if not options.skip_nonfinite:
        return _merge_train(acc, new, step, finite, hook, options.step_values)
    one = jnp.ones((), jnp.int32)
    new = {**new, SKIPPED: Total(total=(~finite).astype(jnp.float32), count=one)}
    merged = _merge_train(acc, new, step, jnp.bool_(True), hook, options.step_values)
    kept = keep_if(finite, merged, acc)
    return kept.replace(metrics={**kept.metrics, SKIPPED: merged.metrics[SKIPPED]})


def is_manual(module: JaxModule) -> bool:
    """Whether ``module`` optimizes manually (`JaxModule.training_step`)."""
    return contract.overrides(module, "training_step")


def _logged_names(
    module: JaxModule,
    hook: str,
    variables: Any,
    batch: Any,
    *extra: Any,
    call: Callable[..., None] | None = None,
) -> Options:
    """The names the hook ``hook`` logs and their options, from an abstract trace
    of the hook alone.

    Cheaper than tracing a whole step (no gradient), and needs no device: the
    step functions take their accumulators as inputs, so their structure must
    be known before the step is traced for real. The trace runs with the device
    axis `AXIS` bound (a one-device ``vmap``), so hooks that use it (SyncBatchNorm,
    ``lax.pmean``, ``axis_index``) trace as they do in the step.
    """
    names: Options = {}
    rows = jax.tree.leaves(batch)[0].shape[0]

    def run(*args: Any) -> None:
        step = jnp.zeros((), jnp.int32) if hook in ("loss", "training_step") else None
        epoch = jnp.zeros((), jnp.int32)
        with contract.collect_logs(module, hook, jnp.ones(rows, bool), step, epoch) as logged:
            (call or getattr(module, hook))(*args)
        names.update({name: opts for name, (_, opts) in logged.items()})

    one_device = jax.vmap(run, in_axes=None, axis_name=AXIS, axis_size=1)
    jax.eval_shape(one_device, variables, batch, *extra)
    return names


_HOST_ONLY_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
)


def checked_setup(module: JaxModule, rng: jax.Array, example: Any) -> dict[str, Any]:
    """``module.setup(rng, example)`` (``configure_model`` when ``setup`` is
    Lightning's ``setup(stage)``) under a trace, its result checked."""
    graph = contract.nnx_graph(module)
    if graph is not None:
        return graph.variables()
    hook = contract.init_hook(module)
    where = f"{type(module).__name__}.{hook}()"
    try:
        with contract.in_hook(module, "setup"):
            variables = getattr(module, hook)(rng, example)
    except _HOST_ONLY_ERRORS as exc:
        raise TypeError(
            f"{where} runs traced (once, under jax.jit), so "
            "host-only code on its batch (np.asarray, float(), `if` on values) fails "
            f"there; use only shapes and dtypes of the batch. JAX said: {exc}"
        ) from exc
    if not isinstance(variables, Mapping):
        raise TypeError(
            f"{where} returned {type(variables).__name__}; return "
            "the flax variables dict, e.g. `return self.net.init(rng, batch[0])`"
        )
    for path, leaf in jax.tree_util.tree_flatten_with_path(variables)[0]:
        if not isinstance(leaf, (jax.Array, np.ndarray, np.number, float, int)):
            raise TypeError(
                f"{where} returned variables"
                f"{jax.tree_util.keystr(path)} of type {type(leaf).__name__}; every leaf "
                "must be an array (keep other settings as module attributes)"
            )
    for path, leaf in jax.tree_util.tree_flatten_with_path(variables.get("params", {}))[0]:
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
            raise TypeError(
                f"{where} returned variables['params']{jax.tree_util.keystr(path)} of dtype "
                f"{jnp.result_type(leaf)}: parameters are differentiated, so they must be "
                "floating point; keep an integer (a counter, a table of indices) in "
                "another collection (variables['state'], mutable in loss) or as a module "
                "attribute"
            )
    return dict(variables)


def zero_train_metrics(
    module: JaxModule, state: TrainState, batch: Any, tx: Any, options: StepOptions = StepOptions()
) -> tuple[TrainMetrics, Options]:
    """An empty `TrainMetrics` for ``module``'s logs (``batch``: one device's
    shard), and the options of every name, ``"train/loss"`` included."""
    rngs = {s: state.rng for s in contract.streams(module)}
    if is_manual(module):

        def manual(state: Any, batch: Any, rngs: Any) -> None:
            optimizers = Optimizers(tx, state, module.batch_mask, lambda tree: tree, AXIS)
            module.training_step(optimizers, batch, rngs)

        logged = _logged_names(module, "training_step", state, batch, rngs, call=manual)
    else:
        logged = _logged_names(
            module,
            "loss",
            state.variables,
            batch,
            rngs,
            call=functools.partial(contract.call_loss, module),
        )
    hook = "training_step" if is_manual(module) else "loss"
    logged = _with_trainer_names(logged, hook, options)
    for name, opts in logged.items():
        if opts.metric is not None and opts.metric.collects:
            raise ValueError(
                f"self.log({name!r}, {opts.metric}) in {hook}(): a rank metric needs every "
                "row at once, which a training epoch does not keep; log it in "
                "validation_step/test_step (eval_step), or use a summed one (AUROC with "
                "thresholds=N, PearsonCorrCoef)"
            )
    metrics = {name: zero(opts) for name, opts in logged.items()}
    epoch = {name: zero(opts) for name, opts in logged.items() if opts.on_epoch}
    return TrainMetrics(metrics, epoch, np.zeros((), np.int32)), logged


def _with_trainer_names(logged: Options, hook: str, options: StepOptions) -> Options:
    """The user's ``logged`` names and the Trainer's own for these options;
    a user name that one of the Trainer's would overwrite is refused."""
    own: Options = {}
    if hook == "loss":
        if options.log_loss and LOSS in logged:
            own[LOSS] = LOSS_OPTIONS  # refused below: the module's would be overwritten
        else:
            own[loss_key(logged)] = LOSS_OPTIONS if options.log_loss else HIDDEN_LOSS_OPTIONS
        if options.log_grad_norm:
            own[GRAD_NORM] = GRAD_NORM_OPTIONS
        if options.on_nonfinite == "rollback":
            own[LOSS_MAX] = LOSS_MAX_OPTIONS
    if options.skip_nonfinite:
        own[SKIPPED] = SKIPPED_OPTIONS
    for name in own.keys() & logged.keys():
        raise ValueError(
            f"self.log({name!r}, ...) in {hook}(): the Trainer reports {name!r} itself here "
            + ("(Trainer(log_loss=True): what loss() returns). " if name == LOSS else "")
            + "Log yours under another name, such as 'loss' or 'train_loss'"
        )
    return {**logged, **own}


def zero_eval_metrics(
    module: JaxModule, hook: str, variables: Any, batch: Any, dataloader_idx: int | None = None
) -> tuple[Metrics, Options]:
    """Empty accumulators for what the evaluation ``hook`` logs, and their options
    (a rank metric has none: its `Rows` are each step's output)."""

    def call(variables: Any, batch: Any) -> None:
        contract.call_eval(module, hook, variables, batch, dataloader_idx)

    options = _logged_names(module, hook, variables, batch, call=call)
    carried = {n: o for n, o in options.items() if o.metric is None or not o.metric.collects}
    return {name: zero(opts) for name, opts in carried.items()}, options


@dataclasses.dataclass(frozen=True)
class TrainStepParts:
    """The automatic train step in two parts, for strategies that run them apart.

    Attributes:
        gradients: per-device ``(view, batch, rows) -> (grads, updates, metrics)``
            (``rows``: the batch's `Rows`, its mask and epoch):
            the loss and its gradient on one device's shard, reduced across
            devices (gradients summed over the real rows of the global batch,
            collections averaged, logged values merged). ``view`` is the state
            without what the gradient never reads (optimizer state, accumulated
            gradients): see `gradient_view`.
        apply: ``(state, acc, grads, updates, metrics) -> (state, acc)``: the
            optimizer update and the metric accumulation. Its inputs are the
            same on every device, so it can run per device (data parallel) or
            once on globally sharded arrays (FSDP, tensor parallel).
    """

    gradients: Callable[..., Any]
    apply: Callable[..., Any]

    def per_device(self) -> Callable[..., Any]:
        """The whole step as one per-device function."""

        def jl_train_step(state, acc, batch, rows):
            return self.apply(state, acc, *self.gradients(gradient_view(state), batch, rows))

        return jl_train_step


def gradient_view(state: TrainState) -> TrainState:
    """``state`` without the arrays the gradient part never reads: a strategy
    that shards the state gathers only the rest for each device (of the
    optimizer state only a loss scale, when there is one)."""
    scaled = isinstance(state.opt_state, LossScaleState)
    view = state.replace(opt_state=state.opt_state._replace(inner=None) if scaled else None)
    if isinstance(state, AccumulatingState):
        view = view.replace(grad_sum=None)
    return view


def build_train_parts(
    module: JaxModule,
    tx: Any,
    options: StepOptions = StepOptions(),
    reduce_grads: Callable[[Any], Any] | None = None,
    gathering: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
) -> TrainStepParts:
    """The automatic train step (`JaxModule.loss`) as `TrainStepParts`.

    The gradient is that of the loss summed over the real examples of the global
    batch divided by their number: exact on padded batches, and equal to the
    seeds' ``pmean`` of per-device mean gradients on full ones.

    Args:
        reduce_grads: how the per-device gradient is summed across devices
            (default: ``psum``, in one collective with the logged values); a
            sharding strategy passes a reduce-scatter.
        gathering: for a strategy whose gradient part receives each device's
            shard of the parameters (FSDP): turns the loss of whole parameters
            into a loss of shards that gathers them inside the differentiated
            function, so the gradient of each gathered array comes out
            reduce-scattered (the transpose of a gather).
    """
    return TrainStepParts(
        _build_gradients(module, options, reduce_grads, gathering), _build_apply(tx, options)
    )


def _build_gradients(
    module: JaxModule,
    options: StepOptions,
    reduce_grads: Callable[[Any], Any] | None,
    gathering: Callable[[Callable[..., Any]], Callable[..., Any]] | None,
) -> Callable[..., Any]:
    """`TrainStepParts.gradients` of `build_train_parts`: the loss and its
    gradient on one device's shard, reduced across devices."""
    k = options.accumulate_grad_batches

    def jl_gradients(state, batch, rows):
        mask, epoch = _unpack(rows)
        # With accumulation every micro-batch gets its own keys.
        key_step = state.step if k == 1 else state.step * k + state.micro
        rngs = device_keys(state.rng, key_step, contract.streams(module))
        scale = state.opt_state.scale if options.loss_scaled else None

        def objective(params):
            variables = {"params": for_compute(params, options.precision), **state.model_state}
            with (
                contract.collect_logs(module, "loss", mask, state.step, epoch) as logged,
                computing(options.precision),
            ):
                out = contract.call_loss(
                    module, variables, for_compute(batch, options.precision), rngs
                )
            total, count, updates = loss_terms(out, state.model_state, mask)
            metrics = _logged_metrics(logged, mask)
            metrics[loss_key(metrics)] = Average(total=total, count=count)
            scaled = total if scale is None else total * scale
            return scaled, (metrics, updates)

        if gathering is not None:
            objective = gathering(objective)
        grads, (metrics, updates) = jax.grad(objective, has_aux=True)(state.params)
        if reduce_grads is None:
            (grads, summed_updates), metrics = _reduced(metrics, (grads, updates))
        else:
            summed_updates, metrics = _reduced(metrics, updates)
            grads = reduce_grads(grads)
        updates = pmean_floats(summed_updates, updates, jax.lax.axis_size(AXIS))
        return grads, updates, metrics

    return jl_gradients


def _build_apply(tx: Any, options: StepOptions) -> Callable[..., Any]:
    """`TrainStepParts.apply` of `build_train_parts`: whether the update is
    finite, then a micro-batch summed in (with accumulation) or the update
    applied."""

    def jl_apply(state, acc, grads, updates, metrics):
        loss = metrics[kept_loss(metrics)]
        n_real, finite = loss.count, jnp.isfinite(loss.total)
        if options.skip_nonfinite:
            finite = finite & all_finite(grads)
        if options.on_nonfinite == "rollback":  # this (micro-)batch's loss, for the spike rule
            seen = n_real > 0
            mean = jnp.where(seen, loss.total / jnp.maximum(n_real, 1), -jnp.inf)
            metrics[LOSS_MAX] = Extreme(
                value=mean.astype(jnp.float32), count=seen.astype(jnp.int32), op="max"
            )
        if options.accumulate_grad_batches > 1:
            return _accumulate_micro_batch(tx, options, state, acc, grads, updates, metrics, finite)
        return _apply_update(tx, options, state, acc, grads, updates, metrics, finite)

    return jl_apply


def _accumulate_micro_batch(
    tx: Any,
    options: StepOptions,
    state: AccumulatingState,
    acc: TrainMetrics,
    grads: Any,
    updates: Any,
    metrics: Metrics,
    finite: jax.Array,
) -> tuple[AccumulatingState, TrainMetrics]:
    """Sums one micro-batch's gradient into ``state`` and applies the mean
    once ``accumulate_grad_batches`` of them are in."""
    k = options.accumulate_grad_batches
    kept = state
    state = state.accumulate(grads, metrics[kept_loss(metrics)].count).replace(
        model_state={**state.model_state, **updates}
    )
    # a bad micro-batch is left out of the mean; under 16-mixed's loss
    # scaling an overflow spoils its window instead (the update is skipped,
    # the scale halved, when the window is applied)
    if options.skip_nonfinite and not options.loss_scaled:
        state = keep_if(finite, state, kept.replace(micro=state.micro))
    new_state = jax.lax.cond(
        state.micro == k,
        lambda s: s.apply_accumulated(
            tx, skip_empty=options.skip_nonfinite, loss_scaled=options.loss_scaled
        ),
        lambda s: s,
        state,
    )
    step = state.step * k + state.micro  # micro-batches, for the non-finite report
    return new_state, _merge_checked(acc, metrics, step, finite, "loss", options)


def _apply_update(
    tx: Any,
    options: StepOptions,
    state: TrainState,
    acc: TrainMetrics,
    grads: Any,
    updates: Any,
    metrics: Metrics,
    finite: jax.Array,
) -> tuple[TrainState, TrainMetrics]:
    """The optimizer update with the global batch's mean gradient; where it is
    not ``finite`` and `StepOptions.skip_nonfinite`, the state stays as it was."""
    loss = metrics[kept_loss(metrics)]
    n_real = loss.count
    divisor = n_real if not options.loss_scaled else n_real * state.opt_state.scale
    grads = jax.tree.map(lambda g: g / divisor, grads)
    if options.log_grad_norm:  # the same on every device: counts once per step
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
        metrics[GRAD_NORM] = Average(total=norm.astype(jnp.float32), count=jnp.ones((), jnp.int32))
    # the loss of the global batch, the same on every device
    value = loss.total / n_real
    new_state = state.apply_gradients(tx, grads, updates, value=value)
    if options.skip_nonfinite:
        new_state = keep_if(finite, new_state, state)
    if options.loss_scaled:
        new_state = new_state.replace(opt_state=next_scale(new_state.opt_state, finite))
    return new_state, _merge_checked(acc, metrics, new_state.step, finite, "loss", options)


def build_train_step(
    module: JaxModule, tx: Any, options: StepOptions = StepOptions()
) -> Callable[[TrainState, TrainMetrics, Any, jax.Array], tuple[TrainState, TrainMetrics]]:
    """Per-device train step ``(state, acc, batch, rows) -> (state, acc)``.

    `build_train_parts` as one function; a module with
    `JaxModule.training_step` optimizes manually: ``tx`` is then the `Groups`
    of its optimizers, and each `Optimizers.step` it calls is such an update.
    """

    def jl_manual_train_step(state, acc, batch, rows):
        mask, epoch = _unpack(rows)
        rngs = device_keys(state.rng, state.step, contract.streams(module))

        def reduce(tree: Any) -> Any:
            return across_devices(AXIS, {}, tree)[0]

        optimizers = Optimizers(tx, state, mask, reduce, AXIS, options.precision)
        with (
            contract.collect_logs(module, "training_step", mask, state.step, epoch) as logged,
            contract.explaining_traced_counters(module, "training_step"),
        ):
            out = module.training_step(optimizers, for_compute(batch, options.precision), rngs)
        if out is not None:
            raise TypeError(
                f"training_step() returned {type(out).__name__}; it returns nothing: "
                "update the parameters with optimizers.step(fn, group) and log with self.log"
            )
        if not optimizers.steps_taken:
            raise ValueError(
                "training_step() called no optimizers.step(...); without one nothing is trained"
            )
        _, metrics = _reduced(_logged_metrics(logged, mask))
        new_state = optimizers.state.replace(step=state.step + 1)
        finite = optimizers.finite
        # (16-mixed: each optimizer step already left its group as it was on an
        # overflow, and moved the scale, which must not be undone here)
        if options.skip_nonfinite and not options.loss_scaled:
            new_state = keep_if(finite, new_state, state)
        return new_state, _merge_checked(
            acc, metrics, new_state.step, finite, "training_step", options
        )

    if is_manual(module):
        return jl_manual_train_step
    return build_train_parts(module, tx, options).per_device()


def build_flush(tx: Any, options: StepOptions) -> Callable[[Any], Any]:
    """``state -> state`` applying the gradient accumulated so far (an epoch that
    ends between two updates: Lightning updates with what it has)."""

    def jl_flush(state):
        return state.apply_accumulated(
            tx, skip_empty=options.skip_nonfinite, loss_scaled=options.loss_scaled
        )

    return jl_flush


_STEP = "\x00step"


def step_key(name: str) -> str:
    """The key of ``name``'s own per-batch value in an evaluation step's output
    (``on_step=True``; beside the accumulated ``name``)."""
    return name + _STEP


def build_eval_step(
    module: JaxModule,
    hook: str = "eval_step",
    precision: str = "32-true",
    dataloader_idx: int | None = None,
) -> Callable[[dict[str, Any], Metrics, Any, jax.Array], Metrics]:
    """Per-device eval step ``(variables, acc, batch, rows) -> acc`` running the
    module's ``hook`` (``eval_step``, ``validation_step`` or ``test_step``;
    ``dataloader_idx`` passed to it with several loaders). A hook that logs
    nothing is allowed, as in Lightning: its stage reports no values."""

    def jl_eval_step(variables, acc, batch, rows):
        mask, epoch = _unpack(rows)
        variables = {**variables, "params": for_compute(variables["params"], precision)}
        with contract.collect_logs(module, hook, mask, epoch=epoch) as logged:
            contract.call_eval(
                module, hook, variables, for_compute(batch, precision), dataloader_idx
            )
        _, metrics = _reduced(_logged_metrics(logged, mask))
        merged = _merge(acc, metrics, hook)
        for name, (_, opts) in logged.items():  # on_step=True: this batch's own value too
            if opts.on_step:
                if opts.metric is not None and opts.metric.collects:
                    raise ValueError(
                        f"self.log({name!r}, <rank metric>, on_step=True) in {hook}(): a "
                        "rank metric is computed over the whole evaluation; log it per epoch"
                    )
                merged[step_key(name)] = metrics[name]
        return merged

    return jl_eval_step


def build_statistics_step(
    module: JaxModule, seed: int, precision: str = "32-true"
) -> Callable[..., Any]:
    """Per-device ``(variables, (sums, n), batch, rows) -> (sums, n)``: each
    batch's BatchNorm statistics, summed (torch's ``update_bn``, for
    `StochasticWeightAveraging`). The loss's forward pass runs twice, from
    running statistics 0 and 1: flax's update ``new = m * old + (1 - m) * batch``
    gives ``m`` as their difference and the batch's statistic as
    ``new0 / (1 - m)``. Averaged across devices as the train step averages
    collections."""

    def jl_statistics_step(variables, acc, batch, rows):
        mask, epoch = _unpack(rows)
        sums, n = acc
        model_state = {k: v for k, v in variables.items() if k != "params"}
        rngs = device_keys(jax.random.key(seed), n, contract.streams(module))
        params = for_compute(variables["params"], precision)

        def forward(fill: float) -> Any:
            stats = jax.tree.map(lambda s: jnp.full_like(s, fill), model_state["batch_stats"])
            start = {**model_state, "batch_stats": stats}
            with (
                contract.collect_logs(module, "loss", mask, n, epoch),
                computing(precision),
            ):
                out = contract.call_loss(
                    module, {"params": params, **start}, for_compute(batch, precision), rngs
                )
            _, _, updates = loss_terms(out, start, mask)
            return jax.lax.pmean(updates["batch_stats"], AXIS)

        new0, new1 = forward(0.0), forward(1.0)

        def batch_statistic(a: jax.Array, b: jax.Array) -> jax.Array:
            keep = 1.0 - (b - a)  # 1 - m
            return jnp.where(keep == 0, a, a / jnp.where(keep == 0, 1, keep))

        stats = jax.tree.map(batch_statistic, new0, new1)
        return jax.tree.map(jnp.add, sums, stats), n + 1

    return jl_statistics_step


def build_predict_step(
    module: JaxModule, precision: str = "32-true"
) -> Callable[[dict[str, Any], Any, jax.Array], Any]:
    """Per-device predict step ``(variables, batch, rows) -> outputs`` (per-example
    rows; in float32 under ``bf16-mixed``)."""

    def jl_predict_step(variables, batch, rows):
        mask, epoch = _unpack(rows)
        variables = {**variables, "params": for_compute(variables["params"], precision)}
        with contract.collect_logs(module, "predict_step", mask, epoch=epoch):
            out = contract.call_eval(
                module, "predict_step", variables, for_compute(batch, precision)
            )
        if precision in ("bf16-mixed", "16-mixed"):
            half = (jnp.bfloat16, jnp.float16)
            out = jax.tree.map(lambda o: o.astype(jnp.float32) if o.dtype in half else o, out)
        rows = jax.tree.leaves(batch)[0].shape[0]
        for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
            shape = jnp.shape(leaf)
            if not shape or shape[0] != rows:
                raise ValueError(
                    f"predict_step output{jax.tree_util.keystr(path)} has shape {shape}; "
                    f"every output must have one row per example ({rows} on this device)"
                )
        return out

    return jl_predict_step
