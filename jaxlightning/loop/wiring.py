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
from jaxlightning.callbacks import Callback, ModelCheckpoint, with_defaults
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
from jaxlightning.loop.hooks import Hooks
from jaxlightning.loop.stages import Stages
from jaxlightning.loop.state_points import StatePoints
from jaxlightning.loop.stop import StopPolicy
from jaxlightning.programs.program import Program
from jaxlightning.progress import Progress
from jaxlightning.reporting.reporter import Reporter, as_loggers
from jaxlightning.schedule import Schedule, parse_max_time
from jaxlightning.seed import default_seed
from jaxlightning.strategies import Strategy, resolve_devices, resolve_strategy
from jaxlightning.training.precision import resolve as precision_setting
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


def wire(view: Any, args: TrainerArgs) -> Parts:
    """Checks the Trainer's arguments and builds the parts; ``view`` is what
    callbacks and the module (``self.trainer``) receive: the Trainer."""
    fast_dev_run = checks.fast_dev_run(args.fast_dev_run)
    max_epochs, max_steps = args.max_epochs, args.max_steps
    # Lightning warns at fit when it picks the 1000-epoch default for you
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
    sanity = checks.sanity_steps(args.num_sanity_val_steps)
    logger, callbacks = args.logger, args.callbacks
    checkpointing = args.enable_checkpointing
    if fast_dev_run:  # a few batches of everything; nothing kept
        sanity, logger, checkpointing = 0, False, False
        callbacks = [c for c in as_list(callbacks) if not isinstance(c, ModelCheckpoint)]
    seed = args.seed
    seed = checks.int_arg("seed", default_seed() if seed is None else seed, minimum=0)
    on_nonfinite = args.on_nonfinite
    rollback = on_nonfinite if isinstance(on_nonfinite, Rollback) else None
    if rollback is not None or on_nonfinite == "rollback":
        rollback, on_nonfinite = rollback or Rollback(), "rollback"
    options = checks.step_options(
        args.gradient_clip_val,
        args.gradient_clip_algorithm,
        args.log_grad_norm,
        args.accumulate_grad_batches,
        on_nonfinite,
    )
    options = dataclasses.replace(options, precision=precision_setting(args.precision))
    default_root_dir = os.fspath(args.default_root_dir or os.getcwd())
    distributed.initialize(args.num_nodes)  # before anything touches the devices
    if args.compilation_cache_dir is not None:
        compile_cache.enable(args.compilation_cache_dir)
    strategy = resolve_strategy(args.strategy)
    strategy.setup(resolve_devices(args.devices, args.accelerator))
    steps_per_execution = checks.steps_per_execution(args.steps_per_execution, strategy)
    if logger is True:
        logger = TensorBoardLogger(default_root_dir)
    callbacks = with_defaults(
        as_list(callbacks) + ([rollback] if rollback is not None else []),
        checkpointing=checkpointing,
        progress_bar=args.enable_progress_bar,
        summary=args.enable_model_summary,
        profiler=args.profiler,
        max_time=parse_max_time(args.max_time, minimum=0.0),
    )

    progress = Progress(accumulate=options.accumulate_grad_batches)
    reporter = Reporter(as_loggers(logger), progress, stage_prefix=bool(args.stage_prefix))
    stop = StopPolicy(schedule, progress)
    hooks = Hooks(callbacks, view)
    pipeline = Pipeline(
        strategy,
        schedule,
        seed=seed,
        own_order=args.use_distributed_sampler,
        shuffle_train=False if args.overfit_batches else None,
        data_on_device=args.data_on_device,
        recompile=args.recompile,
    )
    program = Program(
        strategy, options, seed=seed, progress=progress,
        stop_on_nonfinite_loss=args.stop_on_nonfinite_loss and rollback is None,
        steps_per_execution=steps_per_execution,
        device_memory=checks.device_memory(args.device_memory),
    )  # fmt: skip

    def resolve_ckpt_path(ckpt_path: Any) -> str:
        return resume.resolve_ckpt_path(
            ckpt_path, hooks.checkpoint_callback, reporter.loggers, default_root_dir
        )

    evaluation = EvalLoop(pipeline, program, hooks, reporter, progress, resolve_ckpt_path)
    log_every = checks.int_arg("log_every_n_steps", args.log_every_n_steps, minimum=1)
    fit_loop = FitLoop(
        program=program, evaluation=evaluation, hooks=hooks, reporter=reporter, stop=stop,
        progress=progress, schedule=schedule,
        log_every_n_steps=log_every, num_sanity_val_steps=sanity,
        points=StatePoints(hooks),
    )  # fmt: skip
    stages = Stages(view, hooks, reporter, strategy)
    fit = FitRun(
        pipeline=pipeline, program=program, evaluation=evaluation, fit_loop=fit_loop,
        hooks=hooks, reporter=reporter, progress=progress, schedule=schedule, stop=stop,
        stages=stages, resolve_ckpt_path=resolve_ckpt_path, default_epochs=default_epochs,
    )  # fmt: skip
    return Parts(
        fast_dev_run=fast_dev_run,
        schedule=schedule,
        default_root_dir=default_root_dir,
        strategy=strategy,
        callbacks=callbacks,
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
