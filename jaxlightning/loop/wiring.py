"""The Trainer's components, built from its arguments in one place.

`wire` checks each field of the Trainer's `TrainerArgs` once (errors name
the argument), turns them into the run's settings (`Schedule`, step options, seed, strategy,
callbacks with their defaults) and builds the components, handing each one,
in its constructor, only what it may touch. The Trainer keeps what it returns.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from jaxlightning import checks
from jaxlightning.callbacks import Callback, with_defaults
from jaxlightning.callbacks.rollback import Rollback
from jaxlightning.cluster import distributed
from jaxlightning.data import Pipeline
from jaxlightning.loggers import TensorBoardLogger
from jaxlightning.loop import resume
from jaxlightning.loop.args import TrainerArgs
from jaxlightning.loop.editor import StateEditor
from jaxlightning.loop.eval_loop import EvalLoop, as_list
from jaxlightning.loop.fit_loop import FitLoop
from jaxlightning.loop.fit_run import FitRun
from jaxlightning.loop.groups import Groups
from jaxlightning.loop.hooks import Hooks
from jaxlightning.loop.stages import Stages
from jaxlightning.loop.state_points import StatePoints
from jaxlightning.loop.stop import StopPolicy
from jaxlightning.programs.evaluation import EvalPrograms
from jaxlightning.programs.program import Program
from jaxlightning.progress import Progress
from jaxlightning.reporting.reporter import Reporter, as_loggers
from jaxlightning.schedule import Schedule, parse_max_time
from jaxlightning.seed import default_seed
from jaxlightning.strategies import Strategy, resolve_devices, resolve_strategy
from jaxlightning.strategies.shard_map import ShardMapStrategy
from jaxlightning.training.precision import resolve as precision_setting
from jaxlightning.training.step import StepOptions
from jaxlightning.xla import compile_cache

_STAGES = ("train", "val", "test", "predict")  # of the limit_<stage>_batches arguments


@dataclasses.dataclass(frozen=True)
class Parts:
    """What `wire` builds: the run's settings and its components."""

    fast_dev_run: int
    schedule: Schedule
    default_root_dir: str
    strategy: Strategy
    callbacks: list[Callback]
    progress: Progress
    reporter: Reporter
    stop: StopPolicy
    hooks: Hooks
    pipeline: Pipeline
    program: Program
    evaluation: EvalLoop
    stages: Stages
    fit: FitRun
    editor: StateEditor
    resolve_ckpt_path: Callable[[Any], str]


@dataclasses.dataclass(frozen=True)
class _Settings:
    """The Trainer's arguments, checked and turned into the run's settings."""

    fast_dev_run: int
    schedule: Schedule
    default_epochs: bool
    rollback: Rollback | None
    options: StepOptions
    seed: int
    sanity: int
    default_root_dir: str
    strategy: Strategy
    logger: Any
    callbacks: list[Callback]


def _settings(args: TrainerArgs) -> _Settings:
    """Checks each argument once, in the order the Trainer always has (errors
    name the argument), and sets up the processes and the devices."""
    fast_dev_run = checks.fast_dev_run(args.fast_dev_run)
    schedule, default_epochs = _schedule(args, fast_dev_run)
    sanity = 0 if fast_dev_run else checks.sanity_steps(args.num_sanity_val_steps)
    rollback, on_nonfinite = _rollback(args.on_nonfinite)
    options = checks.step_options(
        args.gradient_clip_val,
        args.gradient_clip_algorithm,
        args.log_grad_norm,
        args.accumulate_grad_batches,
        on_nonfinite,
        log_loss=args.log_loss,
        step_values=args.step_values,
    )
    options = dataclasses.replace(options, precision=precision_setting(args.precision))
    seed = args.seed
    seed = checks.int_arg("seed", default_seed() if seed is None else seed, minimum=0)
    default_root_dir = os.fspath(args.default_root_dir or os.getcwd())
    distributed.initialize(args.num_nodes)  # before anything touches the devices
    if args.compilation_cache_dir is not None:
        compile_cache.enable(args.compilation_cache_dir)
    strategy = resolve_strategy(args.strategy)
    strategy.setup(resolve_devices(args.devices, args.accelerator))
    logger, callbacks = _loggers_and_callbacks(args, fast_dev_run, rollback, default_root_dir)
    return _Settings(
        fast_dev_run=fast_dev_run,
        schedule=schedule,
        default_epochs=default_epochs,
        rollback=rollback,
        options=options,
        seed=seed,
        sanity=sanity,
        default_root_dir=default_root_dir,
        strategy=strategy,
        logger=logger,
        callbacks=callbacks,
    )


def wire(view: Any, args: TrainerArgs) -> Parts:
    """Checks the Trainer's arguments and builds the parts; ``view`` is what
    callbacks and the module (``self.trainer``) receive: the Trainer."""
    s = _settings(args)
    progress = Progress(accumulate=s.options.accumulate_grad_batches)
    reporter = Reporter(as_loggers(s.logger), progress, stage_prefix=bool(args.stage_prefix))
    stop = StopPolicy(s.schedule, progress)
    hooks = Hooks(s.callbacks, view)
    pipeline = _pipeline(args, s)
    program = _program(args, s, progress)

    def resolve_ckpt_path(ckpt_path: Any) -> str:
        return resume.resolve_ckpt_path(
            ckpt_path, hooks.checkpoint_callback, reporter.loggers, s.default_root_dir
        )

    programs = EvalPrograms(program)
    evaluation = EvalLoop(pipeline, programs, hooks, reporter, progress, resolve_ckpt_path)
    points = StatePoints(hooks)
    log_every = checks.int_arg("log_every_n_steps", args.log_every_n_steps, minimum=1)
    groups = Groups(
        checks.steps_per_execution(args.steps_per_execution, s.strategy),
        groupable=isinstance(s.strategy, ShardMapStrategy),
        hooks=hooks,
        points=points,
        progress=progress,
        schedule=s.schedule,
        stop=stop,
        log_every_n_steps=log_every,
    )
    fit_loop = FitLoop(
        program=program,
        evaluation=evaluation,
        hooks=hooks,
        reporter=reporter,
        stop=stop,
        progress=progress,
        schedule=s.schedule,
        log_every_n_steps=log_every,
        num_sanity_val_steps=s.sanity,
        points=points,
        groups=groups,
    )
    stages = Stages(view, hooks, reporter, s.strategy)
    fit = FitRun(
        pipeline=pipeline,
        program=program,
        evaluation=evaluation,
        fit_loop=fit_loop,
        hooks=hooks,
        reporter=reporter,
        progress=progress,
        schedule=s.schedule,
        stop=stop,
        stages=stages,
        resolve_ckpt_path=resolve_ckpt_path,
        default_epochs=s.default_epochs,
    )
    return Parts(
        fast_dev_run=s.fast_dev_run,
        schedule=s.schedule,
        default_root_dir=s.default_root_dir,
        strategy=s.strategy,
        callbacks=s.callbacks,
        progress=progress,
        reporter=reporter,
        stop=stop,
        hooks=hooks,
        pipeline=pipeline,
        program=program,
        evaluation=evaluation,
        stages=stages,
        fit=fit,
        editor=StateEditor(program.held, progress, reporter, fit),
        resolve_ckpt_path=resolve_ckpt_path,
    )


def _pipeline(args: TrainerArgs, s: _Settings) -> Pipeline:
    return Pipeline(
        s.strategy,
        s.schedule,
        seed=s.seed,
        own_order=args.use_distributed_sampler,
        shuffle_train=False if args.overfit_batches else None,
        data_on_device=args.data_on_device,
        recompile=args.recompile,
    )


def _program(args: TrainerArgs, s: _Settings, progress: Progress) -> Program:
    return Program(
        s.strategy,
        s.options,
        seed=s.seed,
        progress=progress,
        stop_on_nonfinite_loss=args.stop_on_nonfinite_loss and s.rollback is None,
        device_memory=checks.device_memory(args.device_memory),
    )


def _schedule(args: TrainerArgs, fast_dev_run: int) -> tuple[Schedule, bool]:
    """The run's `Schedule` and whether neither ``max_epochs`` nor ``max_steps``
    was given (a fit then warns of the 1000-epoch default, as Lightning)."""
    max_epochs, max_steps = args.max_epochs, args.max_steps
    default_epochs = max_epochs is None and max_steps == -1 and not fast_dev_run
    max_epochs, max_steps = checks.epoch_limit(max_epochs, max_steps)
    every_n_epochs = args.check_val_every_n_epoch
    if every_n_epochs is not None:
        checks.int_arg("check_val_every_n_epoch", every_n_epochs, minimum=1)
    schedule = Schedule.from_trainer_args(
        limits={f"limit_{s}_batches": getattr(args, f"limit_{s}_batches") for s in _STAGES},
        overfit_batches=args.overfit_batches,
        fast_dev_run=fast_dev_run,
        val_check_interval=args.val_check_interval,
        max_epochs=max_epochs,
        max_steps=max_steps,
        min_epochs=checks.int_arg("min_epochs", args.min_epochs or 0, minimum=0),
        min_steps=checks.int_arg("min_steps", args.min_steps or 0, minimum=0),
        check_val_every_n_epoch=every_n_epochs,
    )
    return schedule, default_epochs


def _rollback(on_nonfinite: Any) -> tuple[Rollback | None, Any]:
    """The `Rollback` policy ``on_nonfinite`` asks for (``"rollback"``: the
    defaults), and ``on_nonfinite`` as the train step's option."""
    if isinstance(on_nonfinite, Rollback):
        return on_nonfinite, "rollback"
    if isinstance(on_nonfinite, str) and on_nonfinite == "rollback":
        return Rollback(), "rollback"
    return None, on_nonfinite


def _loggers_and_callbacks(
    args: TrainerArgs, fast_dev_run: int, rollback: Rollback | None, default_root_dir: str
) -> tuple[Any, list[Callback]]:
    """The logger setting and the callbacks with the Trainer's defaults (a
    fast dev run keeps no logger; its checkpoint callbacks skip every check)."""
    logger, callbacks = args.logger, as_list(args.callbacks)
    if fast_dev_run:  # a few batches of everything; nothing kept
        logger = False
    if logger is True:
        logger = TensorBoardLogger(default_root_dir)
    callbacks = with_defaults(
        callbacks + ([rollback] if rollback is not None else []),
        checkpointing=args.enable_checkpointing,
        progress_bar=args.enable_progress_bar,
        summary=args.enable_model_summary,
        profiler=args.profiler,
        max_time=parse_max_time(args.max_time, minimum=0.0),
    )
    return logger, callbacks
