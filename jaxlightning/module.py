"""`JaxModule`: what the user writes (model, optimizer, loss, evaluation)."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxlightning.io.checkpoint import read_meta, restore_variables
from jaxlightning.io.export import export_predict
from jaxlightning.metrics.logged import REDUCTIONS, LogOptions, reduction
from jaxlightning.metrics.objects import MetricObject


def _is_numeric(value: Any) -> bool:
    """A number or an array of numbers or booleans (a traced one included)."""
    if isinstance(value, (bool, int, float, np.number, np.bool_)):
        return True
    dtype = getattr(value, "dtype", None)
    if dtype is None or not hasattr(value, "shape"):
        return False
    try:
        dtype = np.dtype(dtype)  # numpy's, JAX's (traced values too)
    except TypeError:  # a torch tensor's (torch.int64): numbers and booleans count
        return getattr(dtype, "is_complex", True) is False
    return bool(jax.numpy.issubdtype(dtype, jax.numpy.number)) or dtype == np.bool_


# Hooks whose logged values are training values (per step by default).
_TRAINING_HOOKS = ("loss", "training_step")

# Hooks in which Lightning refuses ``self.log`` (its ``_FxValidator``): nothing
# reports what they would log (fit/stage boundaries, set-up, checkpoints, predict).
NO_LOG_HOOKS = frozenset(
    {
        "setup",
        "teardown",
        "configure_optimizers",
        "on_fit_start",
        "on_fit_end",
        "on_sanity_check_start",
        "on_sanity_check_end",
        "on_train_end",
        "on_validation_end",
        "on_test_end",
        "on_predict_start",
        "on_predict_end",
        "on_predict_epoch_start",
        "on_predict_epoch_end",
        "on_predict_batch_start",
        "on_predict_batch_end",
        "predict_step",
        "on_save_checkpoint",
        "on_load_checkpoint",
        "on_exception",
    }
)


def _check_loggable(
    name: Any,
    value: Any,
    hook: str,
    add_dataloader_idx: bool,
    *,
    reduce_fx: Any = "mean",
    host: bool = False,
) -> None:
    """Lightning's checks of a ``self.log`` call that hold wherever it is made,
    and those of a metric object (``host``: made in a host-side hook)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"self.log needs a non-empty string name, got {name!r}")
    if add_dataloader_idx and "/dataloader_idx_" in name:
        raise ValueError(
            f"self.log({name!r}, ...): the name should not carry a dataloader index; "
            "with several loaders the Trainer appends '/dataloader_idx_N' itself"
        )
    where = f" in {hook}()" if hook else ""
    if isinstance(value, MetricObject):
        if host:
            raise ValueError(
                f"self.log({name!r}, {value!r}){where}: a metric object is reduced on the "
                "devices over the rows of a traced hook; log it in eval_step, "
                "validation_step, test_step or loss, or log a number here"
            )
        if reduction(reduce_fx) != "mean":
            raise ValueError(
                f"self.log({name!r}, {value!r}, reduce_fx={reduce_fx!r}): a metric object "
                "reduces itself over every real row of the run; leave reduce_fx at 'mean' "
                "(the default), or log a per-example vector to take its sum, max or min"
            )
        return
    if not _is_numeric(value):
        if isinstance(value, Mapping):
            what = "nested dictionaries cannot be logged; use self.log_dict for a flat dict"
        else:
            what = (
                f"`{type(value).__name__}` values cannot be logged; log a number, a scalar "
                "array, a per-example array or a jl.metrics object"
            )
        raise ValueError(f"self.log({name!r}, ...){where}: {what}")


def _from_torch(x: Any) -> Any:
    """A torch tensor as a numpy array (an eager call's input); else ``x``."""
    if type(x).__module__.startswith("torch") and hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    return x


class AttributeDict(dict):
    """A dict whose keys are also attributes: ``hparams.lr == hparams["lr"]``."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"no hyperparameter {key!r}; have {sorted(self)}") from None

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value


def _dataloader_idx_args(fn: Callable[..., Any], index: int) -> tuple[tuple, dict]:
    """How an evaluation hook takes ``dataloader_idx``: by that name (or
    ``**kwargs``), or as a third positional parameter; else not at all."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return (), {}
    if any(p.name == "dataloader_idx" or p.kind is p.VAR_KEYWORD for p in params):
        return (), {"dataloader_idx": index}
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) >= 3 or any(p.kind is p.VAR_POSITIONAL for p in params):
        return (index,), {}
    return (), {}


class JaxModule:
    """Base class of a model trained by `jaxlightning.Trainer`.

    Subclass it and override the hooks. The traced hooks (`loss`, `eval_step`,
    `predict_step`) see *one device's shard* of a batch and must be pure functions
    of their arguments; the Trainer compiles them once per run.

    Example:
        ```python
        class LitDigits(jl.JaxModule):
            def __init__(self, lr=1e-3):
                super().__init__()
                self.save_hyperparameters()
                self.net = MLP()

            def setup(self, rng, batch):
                return self.net.init(rng, batch["x"])

            def configure_optimizers(self):
                return optax.adam(self.hparams.lr)

            def loss(self, variables, batch, rngs):
                logits = self.net.apply(variables, batch["x"], train=True, rngs=rngs)
                self.log("acc", logits.argmax(-1) == batch["y"])
                return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        ```

    Attributes:
        hparams: hyperparameters recorded by `save_hyperparameters`.
        rng_streams: names of the PRNG streams handed to `loss` as ``rngs``.
        variables: the trained flax variables, set by the Trainer after ``fit``
            (``None`` before); `validate`, `test` and `predict` use them.
    """

    rng_streams: tuple[str, ...] = ("dropout",)
    lora: Any = None  # a `jl.LoRA`: train low-rank adapters, the rest frozen

    def __init__(self) -> None:
        self.hparams = AttributeDict()
        self.variables: dict[str, Any] | None = None
        self._log_sink: dict[str, jax.Array] | None = None
        self._hook: str = ""
        self._mask: jax.Array | None = None
        self._step: jax.Array | None = None
        self._trainer: Any = None  # the Trainer running this module, while it runs
        self._host_log: Any = None  # where self.log in a host-side hook goes, meanwhile
        self._nnx: Any = None  # an NnxGraph while an NNX model is trained
        self._host_hook: str = ""  # the host-side hook running (for self.log's rules)
        self._epoch: jax.Array | None = None  # current_epoch inside a traced hook
        self._traced_reads: set[str] = set()  # traced counters read in this trace

    # ------------------------------------------------------------ the run
    @property
    def trainer(self) -> Any:
        """The Trainer running this module (a read-only view; set while it runs)."""
        if self._trainer is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a Trainer")
        return self._trainer

    @property
    def global_step(self) -> Any:
        """Optimizer steps so far. Inside `loss` a traced value (the step being
        taken, counting from 0), so schedules on it need no recompile; on the
        host the Trainer's count; 0 without a Trainer."""
        if self._step is not None:
            self._traced_reads.add("global_step")
            return self._step
        return self._trainer.global_step if self._trainer is not None else 0

    @property
    def loggers(self) -> list[Any]:
        """The running Trainer's loggers (``[]`` without a Trainer)."""
        return list(self._trainer.loggers) if self._trainer is not None else []

    @property
    def logger(self) -> Any:
        """The running Trainer's first logger (``None`` without a Trainer or logger)."""
        return self._trainer.logger if self._trainer is not None else None

    @property
    def global_rank(self) -> int:
        """This process's index in the job (0 without a Trainer)."""
        return self._trainer.global_rank if self._trainer is not None else 0

    @property
    def local_rank(self) -> int:
        """This process's index on its machine (0 without a Trainer)."""
        return self._trainer.local_rank if self._trainer is not None else 0

    @property
    def current_epoch(self) -> Any:
        """The epoch running (counting from 0). Inside a traced hook (`loss`,
        `eval_step`, ...) a traced int32 value, the epoch of the batch being
        processed, so arithmetic on it is right in every epoch without a
        recompile (branch on it with ``jnp.where``/``jax.lax.cond``, not
        ``if``); on the host the Trainer's count; 0 without a Trainer."""
        if self._epoch is not None:
            self._traced_reads.add("current_epoch")
            return self._epoch
        return self._trainer.current_epoch if self._trainer is not None else 0

    @contextlib.contextmanager
    def _in_hook(self, hook: str) -> Iterator[None]:
        """Marks ``hook`` (a host-side hook) as running, for `log`'s rules."""
        previous, self._host_hook = getattr(self, "_host_hook", ""), hook
        try:
            yield
        finally:
            self._host_hook = previous

    @contextlib.contextmanager
    def _explaining_traced_counters(self, hook: str) -> Iterator[None]:
        """Adds a hint to the error a Python branch on a traced ``global_step``
        or ``current_epoch`` raises while ``hook`` is traced."""
        self._traced_reads = set()
        try:
            yield
        except jax.errors.ConcretizationTypeError as exc:
            if self._traced_reads:
                names = " and ".join(f"self.{n}" for n in sorted(self._traced_reads))
                exc.add_note(
                    f"jaxlightning: {hook}() read {names}, which inside a traced hook is a "
                    "traced value (it changes without a recompile). Python `if`/`while` on it "
                    "cannot work; use jnp.where(...) or jax.lax.cond(...) instead"
                )
            raise

    # Host-side hooks, called after the callbacks' hooks of the same name (at a
    # train epoch's end, before the monitoring callbacks: ModelCheckpoint and
    # EarlyStopping see what the module logged there). Batch hooks get the
    # batch's index only: batches live on the devices, outputs in the step.
    def on_fit_start(self) -> None: ...
    def on_fit_end(self) -> None: ...
    def on_train_start(self) -> None: ...
    def on_train_end(self) -> None: ...
    def on_train_epoch_start(self) -> None: ...
    def on_train_epoch_end(self) -> None: ...
    def on_train_batch_start(self, batch_idx: int) -> int | None:
        """Return -1 to skip the rest of this epoch's training (Lightning's rule)."""

    def on_train_batch_end(self, batch_idx: int) -> None: ...
    def on_validation_start(self) -> None: ...
    def on_validation_end(self) -> None: ...
    def on_validation_epoch_start(self) -> None: ...
    def on_validation_epoch_end(self) -> None: ...
    def on_validation_batch_start(self, batch_idx: int) -> None: ...
    def on_validation_batch_end(self, batch_idx: int) -> None: ...
    def on_test_start(self) -> None: ...
    def on_test_end(self) -> None: ...
    def on_test_epoch_start(self) -> None: ...
    def on_test_epoch_end(self) -> None: ...
    def on_test_batch_start(self, batch_idx: int) -> None: ...
    def on_test_batch_end(self, batch_idx: int) -> None: ...
    def on_predict_start(self) -> None: ...
    def on_predict_end(self) -> None: ...
    def on_predict_epoch_start(self) -> None: ...
    def on_predict_epoch_end(self) -> None: ...
    def on_predict_batch_start(self, batch_idx: int) -> None: ...
    def on_predict_batch_end(self, batch_idx: int) -> None: ...
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """``checkpoint`` is the JSON record being saved; entries added to it are kept."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """``checkpoint`` is the JSON record of the checkpoint the run resumes from."""

    # ----------------------------------------------------------------- hooks
    def setup(self, rng: jax.Array, batch: Any) -> dict[str, Any]:
        """Once per run: returns the initial flax variables (linen).

        A ``setup(self, stage)`` with one parameter is Lightning's hook instead:
        called with ``"fit"``, ``"validate"``, ``"test"`` or ``"predict"`` when
        each Trainer call starts (after the callbacks' ``setup``), and the
        variables then come from `configure_model` (same arguments as here).

        Not needed for a Flax NNX model kept as ``self.model`` (built in
        ``__init__``): the Trainer splits it into its variables itself.

        Runs traced, under one ``jax.jit`` (the initialisers then compile into
        one program, much faster than one by one): ``batch`` holds abstract
        arrays of the right shapes and dtypes, so call your flax module's
        ``init`` on it, but do not convert it to numpy or branch on its values.

        Args:
            rng: a PRNG key for initialisation.
            batch: one device's share of the first training batch.
        """
        raise NotImplementedError(
            f"{type(self).__name__} must define setup(self, rng, batch) returning "
            "flax variables, e.g. `return self.net.init(rng, batch['x'])`"
        )

    def configure_model(self, rng: jax.Array, batch: Any) -> dict[str, Any]:
        """Instead of ``setup(rng, batch)`` when ``setup`` is Lightning's
        ``setup(self, stage)``: returns the initial flax variables, as `setup`
        describes (traced once, ``batch`` one device's share of the first
        training batch)."""
        raise NotImplementedError(
            f"{type(self).__name__}.setup(stage) is Lightning's set-up hook, so the "
            "variables come from configure_model(self, rng, batch): define it, e.g. "
            "`return self.net.init(rng, batch['x'])`"
        )

    def pretrained(self, into: Any) -> dict[str, Any]:
        """Optional: the variables to start from instead of ``setup``'s initial
        values, read on the host once before the train state is built
        (typically ``return jl.load_weights(path, into, rename=RULES)``).

        Args:
            into: the variables ``setup`` would return, as abstract arrays
                (``jax.ShapeDtypeStruct``), each with the sharding the strategy
                gives it where it shards them: `jl.load_weights` then reads
                only each device's block.
        """
        raise NotImplementedError

    def teardown(self, stage: str) -> None:
        """After every Trainer call (``"fit"``, ``"validate"``, ``"test"``,
        ``"predict"``), also a failing one (Lightning's hook)."""

    @classmethod
    def _stage_setup(cls) -> bool:
        """Whether ``setup`` is Lightning's ``setup(self, stage)`` (one parameter):
        then the Trainer calls it with the stage and the variables come from
        `configure_model`."""
        if not cls._overrides("setup"):
            return False
        params = list(inspect.signature(cls.setup).parameters.values())[1:]
        return len(params) == 1 and params[0].kind is not params[0].VAR_POSITIONAL

    @classmethod
    def _init_hook(cls) -> str:
        """The hook that returns the initial variables: ``setup`` or ``configure_model``."""
        return "configure_model" if cls._stage_setup() else "setup"

    def configure_callbacks(self) -> Any:
        """Callbacks this module brings (a callback or a list), merged into the
        Trainer's at the start of each of its calls, as in Lightning: one of
        a type the Trainer already has replaces those; `ModelCheckpoint` s run
        last. By default none."""
        return []

    def configure_optimizers(self) -> optax.GradientTransformation:
        """Returns the optax transformation that updates ``params``."""
        raise NotImplementedError(
            f"{type(self).__name__} must define configure_optimizers(self) returning "
            "an optax transformation, e.g. `return optax.adam(1e-3)`"
        )

    def loss(self, variables: dict[str, Any], batch: Any, rngs: dict[str, jax.Array]) -> Any:
        """Traced, one device's shard: the training objective.

        Returns a scalar, a per-example vector (the Trainer takes the mean over the
        real examples, so padded rows never count), a ``jl.metrics.TokenMean``
        (the mean over the counted tokens of the whole global batch: a language
        model's loss per token), or ``(loss, updates)`` where
        ``updates`` holds mutated collections such as ``{"batch_stats": ...}``;
        those are averaged across devices.
        """
        raise NotImplementedError

    def training_step(self, optimizers: Any, batch: Any, rngs: dict[str, jax.Array]) -> None:
        """Optional, instead of `loss`: manual optimization, traced, one device's shard.

        Call ``optimizers.step(fn, group)`` for each update, in order; each
        differentiates ``fn(params)`` (a loss, as `loss` returns it) with
        respect to ``params[group]`` and applies that group's optimizer (the
        dict `configure_optimizers` returns). Later steps see earlier updates
        in ``optimizers.params``. Returns nothing; log with `log`. Example, a GAN:

        ```python
        def training_step(self, optimizers, batch, rngs):
            x, z = batch
            d_loss = optimizers.step(lambda p: self.d_loss(p, x, z), "discriminator")
            g_loss = optimizers.step(lambda p: self.g_loss(p, z), "generator")
            self.log_dict({"d_loss": d_loss, "g_loss": g_loss}, prog_bar=True)
        ```
        """
        raise NotImplementedError

    def eval_step(self, variables: dict[str, Any], batch: Any) -> None:
        """Traced, one device's shard: log evaluation metrics with `log`."""
        raise NotImplementedError

    def validation_step(self, variables: dict[str, Any], batch: Any) -> None:
        """Optional; traced, one device's shard: `validate` (and validation during
        `fit`) runs it instead of `eval_step` where it is defined."""
        raise NotImplementedError

    def test_step(self, variables: dict[str, Any], batch: Any) -> None:
        """Optional; traced, one device's shard: `test` runs it instead of `eval_step`
        where it is defined."""
        raise NotImplementedError

    def predict_step(self, variables: dict[str, Any], batch: Any) -> Any:
        """Traced, one device's shard: returns per-example outputs (a pytree)."""
        raise NotImplementedError

    def forward(self, variables: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        """Optional: the model's output for inputs, given ``variables`` (an NNX
        module gets its model instead). Pure, so `loss` and `predict_step` may
        call it too; ``module(x)`` calls it with the current weights."""
        raise NotImplementedError

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``forward`` with the module's current weights, on the host: during a
        fit (in a callback, say) the train state's, else those `fit` left (or
        `load_from_checkpoint` loaded). Computed eagerly, for inspection; in a
        traced hook call ``self.forward(variables, ...)`` with the hook's own."""
        name = type(self).__name__
        if not type(self)._overrides("forward"):
            raise NotImplementedError(
                f"{name}(...) calls {name}.forward(variables, *inputs), which it does not "
                "define; add it (e.g. `return self.net.apply(variables, x)`)"
            )
        if self._log_sink is not None:
            raise RuntimeError(
                f"{name}(...) inside a traced hook would use the host's weights; call "
                "self.forward(variables, ...) with the hook's variables instead"
            )
        positional = [
            p
            for p in inspect.signature(self.forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        if len(positional) <= len(args) and not any(
            p.kind is p.VAR_POSITIONAL for p in inspect.signature(self.forward).parameters.values()
        ):
            raise TypeError(
                f"{name}.forward takes the variables first, then the inputs: "
                f"forward(self, variables, x) (Lightning's forward(self, x) has no variables)"
            )
        variables = self._current_variables()
        if self.lora is not None:
            variables = self.lora.merged(variables)
        if self._nnx is not None:
            variables = self._nnx.merge(variables, None, train=False)
        args, kwargs = jax.tree.map(_from_torch, (args, kwargs))
        return self.forward(variables, *args, **kwargs)

    # ------------------------------------------- torch.nn.Module's habits
    training = True  # `train()`/`eval()` set it, as torch's; ``forward`` may read it

    def train(self, mode: bool = True) -> JaxModule:
        """Sets `training` (torch's ``module.train()``); returns the module."""
        self.training = bool(mode)
        return self

    def eval(self) -> JaxModule:
        """``train(False)`` (torch's ``module.eval()``); returns the module."""
        return self.train(False)

    def to(self, *args: Any, **kwargs: Any) -> JaxModule:
        """Returns the module: the Trainer's strategy places every array (ported
        ``.to(device)`` calls are harmless)."""
        del args, kwargs
        return self

    def cpu(self) -> JaxModule:
        """Returns the module (see `to`)."""
        return self

    def cuda(self, device: Any = None) -> JaxModule:
        """Returns the module (see `to`)."""
        del device
        return self

    @property
    def device(self) -> jax.Device:
        """The first device the module's Trainer runs on (without one, JAX's
        first): where Lightning code reads ``self.device`` to make a tensor, a
        jax array needs no device."""
        trainer = self._trainer
        devices = getattr(getattr(trainer, "strategy", None), "devices", None)
        return devices[0] if devices else jax.devices()[0]

    def _current_variables(self) -> Any:
        trainer = self._trainer
        if trainer is not None and trainer.stage == "fit" and trainer.state is not None:
            return trainer.state.variables
        if self.variables is None:
            raise RuntimeError(
                f"{type(self).__name__} has no weights yet: fit it, or load them with "
                f"{type(self).__name__}.load_from_checkpoint(path)"
            )
        return self.variables

    # ------------------------------------------------ calling traced hooks
    def _nnx_model(self) -> Any:
        """The NNX model to train (``self.model``), when this module uses one."""
        model = getattr(self, "model", None)
        cls = type(self)
        if isinstance(model, nnx.Module) and not cls._overrides(cls._init_hook()):
            return model
        return None

    def _streams(self) -> tuple[str, ...]:
        return self._nnx.streams if self._nnx is not None else self.rng_streams

    def _call_loss(self, variables: Any, batch: Any, rngs: dict[str, jax.Array]) -> Any:
        """`loss` with what it takes: flax variables and ``rngs``, or the merged
        NNX model (its mutated variables come back as updates)."""
        if self.lora is not None:
            variables = self.lora.apply(variables)
        if self._nnx is None:
            with self._explaining_traced_counters("loss"):
                return self.loss(variables, batch, rngs)
        model = self._nnx.merge(variables, rngs, train=True)
        with self._explaining_traced_counters("loss"):
            out = self.loss(model, batch)
        if isinstance(out, tuple):
            raise TypeError(
                "an NNX model's loss() returns the loss only; BatchNorm statistics and "
                "other variables it changes are taken from the model"
            )
        return out, self._nnx.updates(model)

    def _call_eval(
        self, hook: str, variables: Any, batch: Any, dataloader_idx: int | None = None
    ) -> Any:
        """An evaluation hook (or ``predict_step``) with the variables or the model;
        with several loaders, ``dataloader_idx`` (a Python int: each loader is its
        own compiled program) for a hook that takes it, as Lightning passes it."""
        if self.lora is not None:
            variables = self.lora.apply(variables)
        if self._nnx is not None:
            variables = self._nnx.merge(variables, None, train=False)
        fn = getattr(self, hook)
        args, kwargs = ((), {})
        if dataloader_idx is not None:
            args, kwargs = _dataloader_idx_args(fn, dataloader_idx)
        with self._explaining_traced_counters(hook):
            return fn(variables, batch, *args, **kwargs)

    # --------------------------------------------------------------- logging
    @property
    def batch_mask(self) -> jax.Array:
        """Inside a traced hook: which rows of this device's shard are real.

        A boolean vector, one entry per row; ``False`` marks the padding rows the
        Trainer adds to fill the last, smaller batch to the fixed batch size
        (copies of the last real row). Losses and ``self.log`` values already
        leave them out; use it where your own code reduces over the batch
        (a contrastive loss, say). Note that flax's ``nn.BatchNorm(mask=...)``
        averages per-device masked means, which is not the global masked mean
        when devices hold different numbers of real rows (and is NaN on a
        device holding none).
        """
        if self._mask is None:
            raise RuntimeError(
                "batch_mask is only defined inside loss(), eval_step() and predict_step() "
                "while the Trainer traces them"
            )
        return self._mask

    def log(
        self,
        name: str,
        value: Any,
        *,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        prog_bar: bool = False,
        logger: bool | None = None,
        reduce_fx: str | Callable[..., Any] = "mean",
        sync_dist: bool = False,
        batch_size: int | None = None,
        rank_zero_only: bool = False,
        add_dataloader_idx: bool = True,
    ) -> None:
        """Records a metric from a traced hook (`loss`, `eval_step`, ...).

        ``value`` is a scalar or a per-example vector (booleans count as 0/1).
        It is reduced with ``reduce_fx`` (``"mean"``, ``"sum"``, ``"max"``,
        ``"min"``, in any case, ``"avg"``; or the function ``max``, ``min``,
        ``sum``, ``torch.max``, ``np.mean``, ...) exactly over the real
        examples of every device: padded rows never count. A per-example
        vector counts each real row. A scalar is this device's value for its
        shard, weighted by the shard's real rows:
        with ``"mean"`` a shard mean averages exactly across devices; with
        ``"sum"`` the devices' row-weighted mean counts once per step (a
        constant ``1`` sums to the number of steps, as in Lightning); to sum
        over examples, log the per-example vector. Values are always reduced
        across devices and weighted by real rows, so ``sync_dist`` and
        ``batch_size`` are accepted for Lightning code and change nothing;
        ``rank_zero_only`` neither (only process 0 writes logs).

        ``value`` may also be a metric object of `jaxlightning.metrics.logged`
        (``jl.metrics.F1Score(logits, y, num_classes=10, average="macro")``,
        ``AUROC``, ...) built from the hook's per-example values: its summed
        state is reduced exactly over every real row of the run (only with
        ``reduce_fx="mean"``, the default; not in host-side hooks).

        As in Lightning, values from `loss` default to ``on_step=True,
        on_epoch=False`` (reported every ``log_every_n_steps``, and for the
        last, partial interval of each epoch), values from evaluation hooks to
        ``on_epoch=True`` (reduced over the whole run). ``on_epoch=True`` in
        `loss` reports the reduction over the epoch at its end; with both,
        the names get ``_step`` and ``_epoch`` suffixes. The Trainer prefixes
        the stage (``train/acc``, ``val/acc``, ``test/acc``) unless the name
        already carries it (``val_loss``, ``val/acc`` are kept as written).
        ``prog_bar`` shows it in the progress bar; ``logger=False`` keeps it
        out of the loggers (``trainer.callback_metrics`` always has it). With
        several evaluation loaders the name gets ``/dataloader_idx_N`` unless
        ``add_dataloader_idx=False`` (then give each loader its own names).

        In a host-side hook (``on_train_epoch_end``, say) ``value`` is a host
        number, logged at once at the current step under ``name`` as written;
        in ``on_train_batch_start``/``on_train_batch_end`` by Lightning's rules
        for those: ``on_step=True`` by default, sent to the loggers at the
        logging interval, ``on_epoch=True`` the epoch's row-weighted mean.
        Where Lightning refuses ``self.log`` (``on_fit_start``, ``setup``,
        ``on_save_checkpoint``, the predict hooks, ...) it raises here too;
        without a Trainer it warns and records nothing.
        """
        del sync_dist, batch_size, rank_zero_only  # always exact; see above
        hook = self._hook if self._log_sink is not None else self._host_hook
        host = self._log_sink is None and self._trainer is not None
        _check_loggable(name, value, hook, add_dataloader_idx, reduce_fx=reduce_fx, host=host)
        if not self._log_allowed(name, hook, logger):
            return
        logger = True if logger is None else bool(logger)
        if self._log_sink is None:
            self._log_on_host(name, value, on_step, on_epoch, prog_bar, logger)
        else:
            self._log_traced(
                name, value, on_step, on_epoch, prog_bar, logger, reduce_fx, add_dataloader_idx
            )

    def _log_allowed(self, name: str, hook: str, logger: bool | None) -> bool:
        """Whether a `log` call made in ``hook`` records anything.

        Raises where Lightning refuses ``self.log``; without a Trainer it warns and
        says no (nothing would receive the value). ``logger=True`` with a Trainer
        that has no logger warns but still records (``callback_metrics`` has it).
        The warnings' ``stacklevel`` is 3 so that they point at the line calling
        `log`, not at this helper.
        """
        if hook in NO_LOG_HOOKS:
            raise RuntimeError(
                f"self.log({name!r}, ...) in {hook}(): Lightning does not allow logging "
                f"there and neither does jaxlightning (nothing would report it); log in a "
                "training or evaluation hook, or write to self.logger directly"
            )
        if self._log_sink is None and self._trainer is None:
            warnings.warn(
                f"self.log({name!r}, ...) was called but the module is not attached to a "
                "Trainer (it is not running in trainer.fit/validate/test): nothing is logged",
                UserWarning,
                stacklevel=3,
            )
            return False
        if logger and self._trainer is not None and not self._trainer.loggers:
            warnings.warn(
                f"self.log({name!r}, ..., logger=True) but the Trainer has no logger; "
                "enable one with Trainer(logger=...) to record it",
                UserWarning,
                stacklevel=3,
            )
        return True

    def _log_on_host(
        self,
        name: str,
        value: Any,
        on_step: bool | None,
        on_epoch: bool | None,
        prog_bar: bool,
        logger: bool,
    ) -> None:
        """`log` from a host-side hook: handed to the Trainer at once (it applies
        Lightning's rules for the hook running)."""
        if self._host_log is None:
            raise RuntimeError(
                f"self.log({name!r}, ...) was called outside the Trainer's control flow; "
                "call it in a traced hook (loss, eval_step) or a module hook"
            )
        if on_step is False and on_epoch is False:  # as in a traced hook, and Lightning
            raise ValueError(
                f"self.log({name!r}, ..., on_step=False, on_epoch=False) would report "
                "nothing; set one of them"
            )
        self._host_log(
            name,
            value,
            prog_bar=prog_bar,
            logger=logger,
            hook=self._host_hook,
            on_step=on_step,
            on_epoch=on_epoch,
        )

    def _log_traced(
        self,
        name: str,
        value: Any,
        on_step: bool | None,
        on_epoch: bool | None,
        prog_bar: bool,
        logger: bool,
        reduce_fx: Any,
        add_dataloader_idx: bool,
    ) -> None:
        """`log` from a traced hook: the value and its `LogOptions` go to the
        sink of the step being traced (`_collect_logs`)."""
        if name in self._log_sink:
            raise ValueError(f"self.log({name!r}, ...) was called twice in one step")
        options = self._log_options(
            name, on_step, on_epoch, prog_bar, logger, reduce_fx, add_dataloader_idx
        )
        if isinstance(value, MetricObject):  # its empty state's shapes depend on it
            options = dataclasses.replace(options, metric=value.spec)
        self._log_sink[name] = (value, options)

    def log_dict(self, dictionary: Mapping[str, Any], **kwargs: Any) -> None:
        """`log` for each ``name: value`` of ``dictionary``, with the same keywords."""
        if not isinstance(dictionary, Mapping):
            raise TypeError(f"self.log_dict needs a dict, got {type(dictionary).__name__}")
        for name, value in dictionary.items():
            self.log(name, value, **kwargs)

    def _log_options(
        self,
        name: str,
        on_step: bool | None,
        on_epoch: bool | None,
        prog_bar: bool,
        logger: bool,
        reduce_fx: Any,
        add_dataloader_idx: bool = True,
    ) -> LogOptions:
        if (reduced := reduction(reduce_fx)) is None:
            raise ValueError(
                f"self.log({name!r}, ..., reduce_fx={reduce_fx!r}): use one of {REDUCTIONS} "
                "(any case, or 'avg'), or the function max, min, sum (Python's, NumPy's, "
                "JAX's or torch's) or mean; the reduction runs on the devices, so other "
                "functions cannot be used"
            )
        training = self._hook in _TRAINING_HOOKS
        on_step = training if on_step is None else bool(on_step)
        on_epoch = (not training) if on_epoch is None else bool(on_epoch)
        if not (on_step or on_epoch):
            raise ValueError(
                f"self.log({name!r}, ..., on_step=False, on_epoch=False) would report "
                "nothing; set one of them"
            )
        return LogOptions(
            on_step, on_epoch, bool(prog_bar), bool(logger), reduced, bool(add_dataloader_idx)
        )

    @contextlib.contextmanager
    def _collect_logs(
        self,
        hook: str,
        mask: jax.Array | None = None,
        step: jax.Array | None = None,
        epoch: jax.Array | None = None,
    ) -> Iterator[dict[str, jax.Array]]:
        """Within the block, `log` records into the yielded dict, `batch_mask` is
        ``mask``, `global_step` is ``step`` and `current_epoch` is ``epoch``
        (traced, where given); ``hook`` names the traced hook in error messages."""
        previous = self._log_sink, self._hook, self._mask, self._step, self._epoch
        self._log_sink, self._hook, self._mask, self._step = {}, hook, mask, step
        self._epoch = epoch
        try:
            yield self._log_sink
        finally:
            self._log_sink, self._hook, self._mask, self._step, self._epoch = previous

    def save_hyperparameters(self, *names: str, ignore: tuple[str, ...] = ()) -> None:
        """Records the calling ``__init__``'s arguments in `hparams`.

        Args:
            *names: record only these arguments (default: all).
            ignore: arguments to leave out.
        """
        frame = inspect.currentframe()
        caller = frame.f_back if frame is not None else None
        if caller is None:
            raise RuntimeError("save_hyperparameters() must be called from __init__")
        info = inspect.getargvalues(caller)
        values: dict[str, Any] = {a: info.locals[a] for a in info.args if a != "self"}
        if info.keywords:
            values.update(info.locals[info.keywords])
        wanted = names or tuple(values)
        missing = [n for n in wanted if n not in values]
        if missing:
            raise ValueError(f"save_hyperparameters: no __init__ argument named {missing}")
        self.hparams.update({n: values[n] for n in wanted if n not in ignore})

    def export(
        self,
        path: str | os.PathLike[str],
        example_batch: Any,
        *,
        platforms: Sequence[str] | None = None,
        any_batch_size: bool = True,
    ) -> str:
        """Writes `predict_step` with the trained variables to one file that runs
        without this class, the Trainer or a checkpoint: read it back with
        ``jl.load_exported(path)`` and call the result on a batch.

        The step is traced once with `jax.export` on ``example_batch`` (one
        batch as `predict_step` receives it: its structure and dtypes are fixed,
        its number of rows is not, unless ``any_batch_size=False``) and stored
        as serialized StableHLO beside the variables (`jaxlightning.io.export`).

        Args:
            path: the file to write.
            example_batch: a batch of arrays (numpy, jax or torch tensors).
            platforms: where it may run, e.g. ``("cpu", "cuda")``; default:
                the platform of the current default backend.
            any_batch_size: export the leading axis as symbolic.

        Returns:
            The path written.
        """

        def predict(variables: Any, batch: Any) -> Any:
            n = jax.tree.leaves(batch)[0].shape[0]
            with self._collect_logs("predict_step", jnp.ones((n,), bool)):
                return self._call_eval("predict_step", variables, batch)

        if not type(self)._overrides("predict_step"):
            raise NotImplementedError(
                f"{type(self).__name__}.export writes predict_step(self, variables, batch), "
                "which it does not define: add it (e.g. `return {'logits': "
                "self.net.apply(variables, batch[0])}`)"
            )
        variables = self._current_variables()
        return export_predict(
            predict,
            variables,
            path,
            example_batch,
            platforms=platforms,
            any_batch_size=any_batch_size,
        )

    @classmethod
    def load_from_checkpoint(cls, path: str | os.PathLike[str], **overrides: Any) -> JaxModule:
        """Rebuilds the module from a checkpoint's hyperparameters and variables.

        Args:
            path: a checkpoint folder (``ModelCheckpoint.best_model_path``, say).
            **overrides: constructor arguments to use instead of the saved ones
                (needed for hyperparameters that JSON cannot hold).

        Returns:
            ``cls(**hparams)`` with ``variables`` set, ready for
            ``trainer.validate``, ``test`` or ``predict``.
        """
        hparams = dict(read_meta(path).get("hparams", {}))
        hparams.update(overrides)
        opaque = sorted(k for k, v in hparams.items() if isinstance(v, dict) and "__repr__" in v)
        if opaque:
            raise ValueError(
                f"hyperparameters {opaque} of checkpoint {path} could not be stored as JSON; "
                f"pass them to load_from_checkpoint, e.g. {opaque[0]}=..."
            )
        module = cls(**hparams)
        module.variables = restore_variables(path)
        return module

    @classmethod
    def _overrides(cls, hook: str) -> bool:
        return getattr(cls, hook) is not getattr(JaxModule, hook)
