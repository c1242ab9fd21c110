"""The Trainer: a composition root. It fills its `TrainerArgs`, has
`loop.wiring.wire` check them and build the components (docs/how-it-works.md
draws them), reads their state for Lightning's properties, and tells `fit`,
`validate`, `test` and `predict` as short stories.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax

from jaxlightning import checks
from jaxlightning.callbacks import Callback
from jaxlightning.callbacks.rollback import Rollback
from jaxlightning.cluster import distributed
from jaxlightning.data.arrays import as_eval_loaders, as_loader
from jaxlightning.data.datamodule import fit_loaders, is_datamodule, stage_loaders
from jaxlightning.io.checkpoint import save_at
from jaxlightning.io.checkpoint import weights_only as only_weights
from jaxlightning.loggers import Logger
from jaxlightning.loop.args import TrainerArgs, with_env_defaults
from jaxlightning.loop.eval_loop import eval_hook
from jaxlightning.loop.wiring import wire
from jaxlightning.module import JaxModule
from jaxlightning.strategies import Strategy
from jaxlightning.training.losses import NonFiniteLossError
from jaxlightning.training.state import TrainState
from jaxlightning.xla.cost import StepCost

__all__ = ["NonFiniteLossError", "Trainer", "TrainerArgs"]


def _read(component: str, name: str, doc: str) -> Any:
    """A read-only property that reads ``name`` of the component ``component``."""
    return property(lambda self: getattr(getattr(self, component), name), doc=doc)


class Trainer:
    """Trains a `JaxModule` data-parallel over the local devices.

    Example:
        ```python
        trainer = jl.Trainer(max_epochs=10)
        trainer.fit(LitDigits(), train_loader, val_loader)
        trainer.validate(model, val_loader)  # [{"acc": 0.97, ...}]: names as logged
        ```

    The arguments are `TrainerArgs`' fields (``trainer.args`` holds them).
    """

    @with_env_defaults
    def __init__(
        self,
        *,
        max_epochs: int | None = None,
        max_steps: int = -1,
        min_epochs: int | None = None,
        min_steps: int | None = None,
        max_time: str | dict[str, int] | datetime.timedelta | None = None,
        devices: int | str | Sequence[jax.Device] = "auto",
        accelerator: str = "auto",
        strategy: str | Strategy = "auto",
        log_every_n_steps: int = 50,
        val_check_interval: int | float | None = None,
        check_val_every_n_epoch: int | None = 1,
        num_sanity_val_steps: int = 2,
        limit_train_batches: int | float | None = None,
        limit_val_batches: int | float | None = None,
        limit_test_batches: int | float | None = None,
        limit_predict_batches: int | float | None = None,
        fast_dev_run: int | bool = False,
        overfit_batches: int | float = 0.0,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        log_grad_norm: bool = False,
        accumulate_grad_batches: int = 1,
        precision: str | int = "32-true",
        default_root_dir: str | os.PathLike[str] | None = None,
        logger: bool | Logger | Sequence[Logger] = True,
        enable_progress_bar: bool = True,
        seed: int | None = None,
        callbacks: Sequence[Callback] | Callback | None = None,
        enable_checkpointing: bool = True,
        stop_on_nonfinite_loss: bool = True,
        on_nonfinite: str | Rollback = "raise",
        use_distributed_sampler: bool = True,
        data_on_device: bool | str = "auto",
        steps_per_execution: int | str = "auto",
        num_nodes: int | None = None,
        compilation_cache_dir: str | os.PathLike[str] | None = None,
        enable_model_summary: bool = True,
        profiler: str | None = None,
        stage_prefix: bool = False,
        log_loss: bool = False,
        step_values: str = "last",
        recompile: str = "warn",
        device_memory: int | None = None,
    ) -> None:
        self.args = TrainerArgs(**{k: v for k, v in locals().items() if k != "self"})
        parts = wire(self, self.args)
        self.fast_dev_run = parts.fast_dev_run
        self.schedule = parts.schedule
        self.default_root_dir = parts.default_root_dir
        self.strategy = parts.strategy
        self.callbacks: list[Callback] = parts.callbacks
        self._progress = parts.progress
        self._reporter = parts.reporter
        self._stop = parts.stop
        self._hooks = parts.hooks
        self._pipeline = parts.pipeline
        self._program = parts.program
        self._stages = parts.stages
        self._fit = parts.fit
        self._fit_loop = parts.fit.fit_loop
        self._groups = parts.fit.fit_loop.groups
        self._evaluation = parts.evaluation
        self._resolve_ckpt_path = parts.resolve_ckpt_path
        self._lightning_module: JaxModule | None = None  # the module fit last
        self.edit = parts.editor  # what callbacks may change in a running fit's state

    # ------------------------------------------------------------ properties
    global_step = _read("_progress", "global_step", "Optimizer updates so far.")
    current_epoch = _read("_progress", "current_epoch", "Completed epochs.")
    epoch_completed = _read("_progress", "epoch_completed", "Whether the last epoch ran out.")
    train_samples_seen = _read("_progress", "train_samples_seen", "Real rows trained on here.")
    num_training_batches = _read("_progress", "num_training_batches", "Batches of this epoch.")
    num_eval_batches = _read("_progress", "num_eval_batches", "Batches of this evaluation.")
    sanity_checking = _read("_progress", "sanity_checking", "In the sanity check's validation.")
    steps_ahead = _read("_progress", "steps_ahead", "Steps the state is ahead of this batch.")
    is_last_batch = _read("_progress", "is_last_batch", "This batch is the epoch's last.")
    received_sigterm = _read("_stop", "received_sigterm", "This process got SIGTERM in a fit.")
    accumulate_grad_batches = _read("_progress", "accumulate", "Micro-batches per update.")
    callback_metrics = _read("_reporter", "callback_metrics", "Every reported value, by name.")
    logged_metrics = _read("_reporter", "logged_metrics", "Every value logged in this call.")
    progress_bar_metrics = _read("_reporter", "progress_bar_metrics", "The bar's values.")
    loggers = _read("_reporter", "loggers", "Every logger.")
    log_dir = _read("_reporter", "log_dir", "The first logger's run directory.")
    logger = _read("_reporter", "logger", "The first logger (``None``: none).")
    checkpoint_callback = _read("_hooks", "checkpoint_callback", "The first `ModelCheckpoint`.")
    checkpoint_callbacks = _read("_hooks", "checkpoint_callbacks", "Every `ModelCheckpoint`.")
    progress_bar_callback = _read("_hooks", "progress_bar_callback", "The progress bar, if on.")
    data_path = _read(
        "_pipeline", "data_path", 'The last fit\'s batches: "device", "host" (None: none yet).'
    )
    seed = _read("_program", "seed", "The run's seed.")
    steps_per_dispatch = _read("_groups", "size", "Train steps the last fit ran per dispatch.")
    log_every_n_steps = _read("_fit_loop", "log_every_n_steps", "The logging interval.")
    max_steps = _read("schedule", "max_steps", "The step limit (-1: none).")
    check_val_every_n_epoch = _read("schedule", "check_val_every_n_epoch", "Validation epochs.")
    val_check_interval = _read("schedule", "val_check_interval", "When validation runs.")
    num_devices = _read("strategy", "num_devices", "Devices over all processes.")

    @property
    def max_epochs(self) -> int:
        """The epoch limit (-1: none, as Lightning reads ``max_epochs=-1``)."""
        limit = self.schedule.max_epochs
        return -1 if limit is None else limit

    @property
    def global_rank(self) -> int:
        """This process's index in the job (``jax.process_index()``)."""
        return jax.process_index()

    @property
    def local_rank(self) -> int:
        """This process's index among the job's processes on its machine."""
        return distributed.local_rank()

    @property
    def world_size(self) -> int:
        """The job's processes (``jax.process_count()``)."""
        return jax.process_count()

    @property
    def is_global_zero(self) -> bool:
        """Whether this is the job's process 0 (the one that writes logs)."""
        return distributed.is_rank_zero()

    stage = _read("_stages", "stage", '"fit", "validate", "test" or "predict" while running.')
    interrupted = _read("_stages", "interrupted", "The last call failed or was interrupted.")
    datamodule = _read("_stages", "datamodule", "The datamodule of the last call with one.")
    ckpt_path = _read("_stages", "ckpt_path", "The checkpoint the (last) call loaded, or None.")

    @property
    def lightning_module(self) -> JaxModule | None:
        """The module this Trainer last fit (``None`` before `fit`): `validate`,
        `test` and `predict` use it when called without one, as in Lightning."""
        return self._lightning_module

    @property
    def num_sanity_val_steps(self) -> float:
        """Validation batches of the sanity check per loader (``inf``: all, as -1 asks)."""
        n = self._fit_loop.num_sanity_val_steps
        return float("inf") if n < 0 else n

    @property
    def should_stop(self) -> bool:
        """Set it to stop the fit (once ``min_epochs``/``min_steps`` are reached)."""
        return self._stop.should_stop

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self._stop.should_stop = bool(value)

    @property
    def state(self) -> TrainState | None:
        """A copy of the train state (one, unreplicated) that stays valid while
        training goes on; ``None`` before `fit`. Copies on the devices: read
        what you need and drop it."""
        return self._program.held.state_copy()

    @property
    def estimated_stepping_batches(self) -> float:
        """The optimizer steps this fit will take, from ``max_epochs`` (and the
        limited batches per epoch) and ``max_steps``; ``inf`` when unbounded.
        Readable in ``configure_optimizers`` to size schedules."""
        if self._fit.epoch_batches is None:
            raise RuntimeError("estimated_stepping_batches is known once fit has its loaders")
        (batches,) = self._fit.epoch_batches
        updates = None if batches is None else self._progress.updates_in(batches)
        return self.schedule.estimated_steps(updates)

    # --------------------------------------------------- XLA's counts, checkpoints
    def train_step_cost(self) -> StepCost | None:
        """XLA's count of one compiled train step on one device: FLOPs and bytes
        (inputs, temporaries, outputs, peak), known before the step first runs
        (waits for its compile); ``None`` before `fit` or where the strategy
        compiles at the first call (``pmap``, several processes). A step that
        gathers its rows from data on the devices counts the dataset's copy."""
        return self._program.train_cost()

    def eval_step_cost(self) -> StepCost | None:
        """XLA's count of the last evaluation's compiled step on one device
        (validation, the sanity check's or test): ``None`` before any, under
        ``pmap`` and in multi-process runs."""
        return self._evaluation.programs.eval_cost()

    @contextlib.contextmanager
    def train_cost_at(
        self, module: JaxModule, train_dataloaders: Any = None, *, datamodule: Any = None
    ) -> Iterator[Callable[[int], StepCost | None]]:
        """For sizing (the Tuner's ``scale_batch_size``): within the block,
        ``cost(rows)`` is XLA's count of ``module``'s train step for a global
        batch of ``rows`` rows, the data's batches otherwise. Compiled from
        shapes as `fit` would set up (the datamodule, ``configure_optimizers``);
        nothing runs and no state is built."""
        with self._stages.running("fit", module, datamodule):
            train, _ = fit_loaders(train_dataloaders, None, datamodule, module)
            with self._fit.sizing(module, as_loader(train, shuffle=True)) as cost:
                yield cost

    def checkpoint_payload(self, module: JaxModule) -> tuple[Any, dict[str, Any]]:
        """What a checkpoint of the run holds now: arrays and a JSON record.

        Waits for the steps in flight, and refuses (`NonFiniteLossError`) when
        a step since the last report had a non-finite loss, so a bad state is
        never saved.
        """
        tree = self._program.held.checkpoint_tree()
        run = {"seed": self.seed, "log_dir": self.log_dir, "num_devices": self.num_devices}
        return tree, self._fit.checkpoint_record(module, **run)

    def save_checkpoint(self, filepath: str | os.PathLike[str], weights_only: bool = False) -> str:
        """Saves a checkpoint of the module this Trainer fits (or fit last) at
        ``filepath``, as Lightning's: a checkpoint folder (orbax arrays and the
        JSON record) that ``ckpt_path=filepath`` resumes, validates or tests
        from and ``load_from_checkpoint`` reads; ``weights_only``: the
        variables without the optimizer state. Returns the folder written."""
        module = self._lightning_module
        if module is None or not self._program.held.started:
            raise RuntimeError(
                "save_checkpoint needs a model this Trainer has fit (or is fitting): call "
                "trainer.fit(model, ...) first"
            )
        tree, meta = self.checkpoint_payload(module)
        if weights_only:
            tree, meta = only_weights(tree), {**meta, "weights_only": True}
        return save_at(os.fspath(filepath), self.global_step, tree, meta)

    # ------------------------------------------------------------------- fit
    def fit(
        self,
        module: JaxModule,
        train_dataloaders: Iterable[Any] | None = None,
        val_dataloaders: Iterable[Any] | Sequence[Iterable[Any]] | None = None,
        *,
        datamodule: Any = None,
        ckpt_path: str | os.PathLike[str] | None = None,
    ) -> None:
        """Trains ``module``; validates on ``val_dataloaders`` per the schedule.

        Args:
            module: the model.
            train_dataloaders: the training batches (a DataLoader, usually),
                or arrays: an array, a tuple or a dict of them (batches of 32,
                shuffled; `jl.arrays` chooses another batch size).
            val_dataloaders: one loader (or arrays) or a list, or ``None``.
            datamodule: instead of the loaders, a `DataModule` (or a Lightning
                ``LightningDataModule``) whose ``train_dataloader`` and, if it
                has one, ``val_dataloader`` are used.
            ckpt_path: resume from a checkpoint: ``"last"``, ``"best"`` or a
                checkpoint folder. The run continues exactly where it stopped,
                mid-epoch included. A run that has nothing left to do (its
                checkpoint is at ``max_epochs``, say) just loads the
                checkpoint's variables into ``module`` and says so.
        """
        if datamodule is None and is_datamodule(train_dataloaders):  # fit(model, dm)
            datamodule, train_dataloaders = train_dataloaders, None
        self._lightning_module = module
        with self._stages.running("fit", module, datamodule):
            train, val = fit_loaders(train_dataloaders, val_dataloaders, datamodule, module)
            train, val = as_loader(train, shuffle=True), as_eval_loaders(val)
            self._fit.run(module, train, val, ckpt_path)

    # ------------------------------------------------ validate, test, predict
    def validate(
        self,
        module: JaxModule | None = None,
        dataloaders: Any = None,
        ckpt_path: Any = None,
        verbose: bool = True,
        datamodule: Any = None,
    ) -> list[dict[str, float]]:
        """Evaluates ``module`` (its ``validation_step``, else ``eval_step``);
        returns ``[{name: value}]`` (names as logged), one dict per loader.
        Lightning's arguments, in its order.

        Uses the module's trained variables, or those of ``ckpt_path``
        (``"last"``, ``"best"`` or a checkpoint folder), which it then keeps.
        ``datamodule=`` takes the loaders from its ``val_dataloader()``.
        ``verbose`` prints the results as a table (process 0), as Lightning.
        """
        call = self._call_args("validate", module, dataloaders, datamodule)
        return self._run_eval_stage("validation", *call, ckpt_path, verbose)

    def test(
        self,
        module: JaxModule | None = None,
        dataloaders: Any = None,
        ckpt_path: Any = None,
        verbose: bool = True,
        datamodule: Any = None,
    ) -> list[dict[str, float]]:
        """Like `validate`, with ``test_step`` (else ``eval_step``)."""
        call = self._call_args("test", module, dataloaders, datamodule)
        return self._run_eval_stage("test", *call, ckpt_path, verbose)

    def _call_args(
        self, call: str, module: JaxModule | None, dataloaders: Any, datamodule: Any
    ) -> tuple[JaxModule, Any, Any]:
        """A call's module, loaders and datamodule: a datamodule passed as the
        loaders (``validate(model, dm)``) taken as such; without a module (as
        Lightning allows) the one this Trainer fit."""
        if datamodule is None and is_datamodule(dataloaders):
            datamodule, dataloaders = dataloaders, None
        if module is None and self._lightning_module is None:
            raise TypeError(
                f"trainer.{call}() needs the module: pass trainer.{call}(model, ...); this "
                "Trainer has not fit one it could use instead"
            )
        return module if module is not None else self._lightning_module, dataloaders, datamodule

    def _loaded(self, ckpt_path: Any) -> str | None:
        """The folder ``ckpt_path`` names (``"last"``, ``"best"``: resolved once,
        here), recorded as ``trainer.ckpt_path``."""
        if ckpt_path is not None:
            self._stages.ckpt_path = self._resolve_ckpt_path(ckpt_path)
        return self._stages.ckpt_path

    def _run_eval_stage(
        self,
        stage: str,
        module: JaxModule,
        dataloaders: Any,
        datamodule: Any,
        ckpt_path: Any,
        verbose: bool = True,
    ) -> list[dict[str, float]]:
        call = "validate" if stage == "validation" else stage
        with self._stages.running(call, module, datamodule):
            dataloaders = as_eval_loaders(stage_loaders(stage, dataloaders, datamodule, module))
            checks.evaluation_hook(module, stage, eval_hook(module, stage))
            checks.module_hooks(module, eval_hook(module, stage))
            ckpt_path = self._loaded(ckpt_path)
            self._reporter.fix_run_dirs()  # on every process at once
            return self._evaluation.run(stage, module, dataloaders, ckpt_path, verbose)

    def predict(
        self,
        module: JaxModule | None = None,
        dataloaders: Any = None,
        *,
        datamodule: Any = None,
        return_predictions: bool | None = None,
        ckpt_path: Any = None,
        concatenate: bool = False,
    ) -> Any:
        """Runs ``predict_step`` over ``dataloaders`` (with ``ckpt_path``'s variables).

        Args:
            return_predictions: ``False`` returns ``None`` (Lightning's flag;
                ``None`` means ``True``).
            concatenate: return one output with a row per dataset example
                instead of one per batch.

        Returns:
            As Lightning: a list with one output per batch, its real rows (numpy
            arrays, the pytree ``predict_step`` returns), in order; with
            ``concatenate`` the batches joined (padding removed, dataset order).
            A list of those for a list of loaders.
        """
        module, dataloaders, datamodule = self._call_args(
            "predict", module, dataloaders, datamodule
        )
        with self._stages.running("predict", module, datamodule):
            loaders = stage_loaders("predict", dataloaders, datamodule, module)
            dataloaders = as_eval_loaders(loaders)
            checks.module_hooks(module, "predict_step")
            ckpt_path = self._loaded(ckpt_path)
            out = self._evaluation.predict(module, dataloaders, ckpt_path, concatenate)
        return None if return_predictions is False else out


# help(), the CLI and the API reference read the arguments from the class.
Trainer.__doc__ = f"{Trainer.__doc__.rstrip()}\n\n{TrainerArgs.arguments_doc()}"
