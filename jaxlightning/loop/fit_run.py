"""A fit, told start to end: the module and optimizer checked, where the run
starts (a checkpoint, a requeued SLURM job, or nothing left to do), the state
built, the fit loop run, the trained variables handed back.

`FitRun` also answers what needs the fit's training data while it runs: the
checkpoint payload's record, recomputing BatchNorm statistics, and the
Tuner's cost of the train step at other batch sizes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from jaxlightning import checks
from jaxlightning.cluster import slurm
from jaxlightning.cluster.rank_zero import rank_zero_warn
from jaxlightning.data.fit_data import FitData
from jaxlightning.data.pipeline import Pipeline
from jaxlightning.io.checkpoint import read_meta
from jaxlightning.loop import resume
from jaxlightning.loop.eval_loop import EvalLoop
from jaxlightning.loop.fit_loop import FitLoop
from jaxlightning.loop.hooks import Hooks
from jaxlightning.loop.stages import Stages
from jaxlightning.loop.stop import StopPolicy
from jaxlightning.module import JaxModule
from jaxlightning.programs.compiled import CompiledSteps, resident_bytes
from jaxlightning.programs.program import Program
from jaxlightning.progress import Progress
from jaxlightning.reporting.reporter import Reporter
from jaxlightning.schedule import Schedule
from jaxlightning.training import assembly, contract
from jaxlightning.xla.cost import StepCost
from jaxlightning.xla.memory import DatasetDoesNotFit, MemoryBudget


class FitRun:
    """Runs `Trainer.fit` over the components it is given.

    Args:
        resolve_ckpt_path: turns ``"last"``, ``"best"`` or a folder into a
            checkpoint folder (raises `FileNotFoundError` when there is none).
        default_epochs: neither ``max_epochs`` nor ``max_steps`` was given: a
            fit warns, as Lightning.
    """

    def __init__(
        self,
        *,
        pipeline: Pipeline,
        program: Program,
        evaluation: EvalLoop,
        fit_loop: FitLoop,
        hooks: Hooks,
        reporter: Reporter,
        progress: Progress,
        schedule: Schedule,
        stop: StopPolicy,
        stages: Stages,
        resolve_ckpt_path: Callable[[Any], str],
        default_epochs: bool,
    ) -> None:
        self.pipeline = pipeline
        self.program = program
        self.evaluation = evaluation
        self.fit_loop = fit_loop
        self.hooks = hooks
        self.reporter = reporter
        self.progress = progress
        self.schedule = schedule
        self.stop = stop
        self.stages = stages
        self.resolve_ckpt_path = resolve_ckpt_path
        self.default_epochs = default_epochs
        self.epoch_batches: tuple[int | None] | None = None  # the last fit's, once known
        self.data: FitData | None = None  # while a fit runs
        self._stepper: Any = None  # the plateau scheduler's callback this fit added

    def run(self, module: JaxModule, train: Any, val: Any, ckpt_path: Any) -> None:
        """Trains ``module`` on ``train`` (validating on ``val``), from ``ckpt_path``."""
        manual = checks.fit_module(module, self.program.options)
        val = self.evaluation.validation_loaders(module, val)
        data = FitData(self.pipeline, train)
        checks.val_check_fraction(self.schedule.val_check_interval, data.per_epoch, val)
        self.epoch_batches = (data.per_epoch,)  # configure_optimizers may read it
        if self.default_epochs:
            warnings.warn(
                "`max_epochs` was not set. Setting it to 1000 epochs. To train without an "
                "epoch limit, set `max_epochs=-1`",
                UserWarning,
                stacklevel=3,  # the user's fit line
            )
        path = self.stages.ckpt_path = self._checkpoint(ckpt_path)
        meta = read_meta(path) if path else None
        if meta is not None:  # Lightning's order: the states, then configure_optimizers
            resume.load_states(self.hooks, self.stages.datamodule, module, meta)
        tx = self._optimizer(module, manual)
        if meta is not None:
            if self._stepper is not None:  # the scheduler's state, as Lightning's restore
                resume.load_callback_states(self.hooks, meta, only=self._stepper)
            self.reporter.resume_in(meta.get("log_dir"))
        resume.start_from(meta, self.progress, data)
        # A fresh run always builds its state, even to train 0 steps (max_steps=0
        # initialises the module); one that continues a run may have nothing left.
        if path is not None or self.program.held.started:
            reason = resume.nothing_left(self.progress, self.schedule, data.per_epoch, data.skip)
            if reason:
                if path is not None:  # the module's variables will be the checkpoint's
                    self.program.forget(module)
                return resume.load_instead(module, path, self.progress, reason)
        self.data = data  # for the checkpoint record and recompute_batch_statistics
        try:
            found = self._train_if_data_fits(module, data, val, tx, path, meta)
            if found is not None:  # nothing ran: the fit starts again, from the host
                copy, peak, limit = (n / 2**20 for n in (found.resident, found.peak, found.limit))
                rank_zero_warn(
                    f"The dataset's copy on each device ({copy:.1f} MiB) does not fit beside "
                    f"{type(module).__name__}'s train step (peak {peak:.1f} MiB of "
                    f"{limit:.1f} MiB): this fit loads its batches on the host (pass "
                    "data_on_device=False to skip the try)"
                )
                with self.pipeline.from_host():
                    data.choose_path()
                    self._train(module, data, val, tx, path, meta)
        finally:
            self.data = None
        self.hooks("on_fit_end", module)

    def _train_if_data_fits(self, *args: Any) -> MemoryBudget | None:
        """`_train`; or, where ``data_on_device="auto"`` kept the dataset on the
        devices and the train step fits a device but not beside its copy, that
        budget (found before anything ran; the copy's last reference, in the
        error's frames, is gone on return)."""
        try:
            self._train(*args)
        except DatasetDoesNotFit as err:
            if self.pipeline.data_on_device != "auto":
                raise
            return err.found
        return None

    def _optimizer(self, module: JaxModule, manual: bool) -> Any:
        """The module's optimizer; a ReduceLROnPlateau it configures steps this
        fit (its stepper replaces the one an earlier fit added)."""
        callbacks = self.hooks.callbacks
        transforms = self.hooks.extensions.transform_optimizer
        tx, plateau = assembly.fit_optimizer(module, manual, self.program.options, transforms)
        if self._stepper in callbacks:
            callbacks.remove(self._stepper)
        self._stepper = None
        if plateau is not None:
            scheduler, monitor = plateau
            self._stepper = scheduler.stepper(monitor)
            callbacks.append(self._stepper)
        return tx

    def _checkpoint(self, ckpt_path: Any) -> str | None:
        """The checkpoint folder the fit starts from (a requeued job: its last)."""
        if ckpt_path is None and slurm.restarted():  # a requeued job goes on
            with contextlib.suppress(FileNotFoundError):
                return self.resolve_ckpt_path("last")
            return None
        return None if ckpt_path is None else self.resolve_ckpt_path(ckpt_path)

    def _train(
        self, module: JaxModule, data: FitData, val: Any, tx: Any, path: Any, meta: Any
    ) -> None:
        # Every thread started from here on (prefetching, compiles) is joined on
        # every way out: one still running in XLA when the process exits aborts it.
        with contextlib.ExitStack() as threads:
            batches = None
            self.pipeline.signatures.reset()  # this fit's first batch sets the shapes
            if data.trains:
                batches = data.open(self.progress.current_epoch)
                threads.callback(batches.close)
            example = (batches and batches.first) or data.example()
            self.program.compile(module, tx, example, threads)
            self.program.check_memory(module, tx, example)  # before anything runs
            self.program.hold(module, path)
            self.evaluation.programs.forget()  # the evaluations compile for this fit's state
            self.stop.reset()
            self.progress.position = (self.progress.current_epoch, data.skip)
            self.reporter.fix_run_dirs()  # on every process at once
            self.program.group_size = self.fit_loop.groups.settle(module)
            self.fit_loop.run(module, data, val)
        held = self.program.held
        contract.hand_back(module, held.trained_variables())
        if data.trains:
            mapped = held.mapped
            self.hooks("on_train_end", module)
            if held.mapped != mapped:  # a callback replaced the state (SWA)
                contract.hand_back(module, held.trained_variables())

    # ------------------------------------------------ while the fit runs
    def checkpoint_record(self, module: JaxModule, **run: Any) -> dict[str, Any]:
        """The JSON record of a checkpoint now (``run``: seed, log_dir, num_devices)."""
        batching = self.data.batching() if self.data is not None else None
        return resume.checkpoint_record(
            self.hooks, module, self.progress, self.stages.datamodule, batching, **run
        )

    def recompute_batch_statistics(self) -> None:
        """See `Trainer.recompute_batch_statistics`."""
        module, data, held = self.program.fit_module, self.data, self.program.held
        if module is None or data is None or not held.started:
            raise RuntimeError("recompute_batch_statistics needs a running fit")
        if "batch_stats" not in held.live_state().model_state:
            raise ValueError(f"{type(module).__name__}'s variables have no 'batch_stats'")
        name = "the train dataloader (recomputing batch_stats)"
        epoch = self.progress.current_epoch
        with self.pipeline.eval_pass(data.loader, name, None, epoch) as batches:
            self.program.recompute_batch_statistics(module, batches)

    @contextlib.contextmanager
    def sizing(self, module: JaxModule, train: Any) -> Iterator[Sizing]:
        """Within the block (inside a ``"fit"`` stage), `Sizing` of ``module``'s
        train step: compiled from shapes, never run, no state built."""
        data = FitData(self.pipeline, train)
        self.epoch_batches = (data.per_epoch,)  # configure_optimizers may read it
        example = data.example()
        options = self.program.options
        manual = checks.fit_module(module, options)
        transforms = self.hooks.extensions.transform_optimizer
        tx, _ = assembly.fit_optimizer(module, manual, options, transforms)
        yield Sizing(self.program.steps, module, tx, example)


@dataclasses.dataclass(frozen=True)
class Sizing:
    """``sizing(rows)`` is XLA's count of the train step for a global batch of
    ``rows`` rows; ``sizing.budget(limit)`` its `MemoryBudget` at the data's
    batch size against ``limit``."""

    steps: CompiledSteps
    module: JaxModule
    tx: Any
    example: Any

    def __call__(self, rows: int) -> StepCost | None:
        return self.steps.cost_at(self.module, self.tx, self.example, rows)

    def budget(self, limit: int | None) -> MemoryBudget | None:
        return self.steps.budget_at(self.module, self.tx, self.example, limit)

    @property
    def resident(self) -> int:
        """Bytes of the dataset's copy a device keeps beside the step (0: none)."""
        return resident_bytes(self.example)
