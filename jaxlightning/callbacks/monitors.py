"""Callbacks that watch a run: model summary, timer, throughput, profiler."""

from __future__ import annotations

import datetime
import os
import time
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from clu import parameter_overview

from jaxlightning.adapters.lora import adapters_only
from jaxlightning.callbacks.base import Callback
from jaxlightning.cluster import distributed
from jaxlightning.cluster.rank_zero import rank_zero_info
from jaxlightning.data.convert import to_numpy
from jaxlightning.schedule import parse_max_time
from jaxlightning.training import contract
from jaxlightning.training.nnx import is_nnx
from jaxlightning.xla.cost import peak_flops

if TYPE_CHECKING:
    from jaxlightning.callbacks.view import TrainerView
    from jaxlightning.module import JaxModule


class ModelSummary(Callback):
    """Prints a table of the parameters (name, shape, dtype, size) when `fit`
    starts, on process 0; on by default (``Trainer(enable_model_summary=False)``
    turns it off). Shapes only: nothing is copied from the devices. When
    training starts, once the train step is compiled, it adds what XLA counts
    of one step on one device (``Train step per device: ... GFLOP, peak ...``).

    Args:
        max_lines: the most rows shown (``None``: all).

    Attributes:
        summary: the last table printed.
    """

    def __init__(self, max_lines: int | None = 40) -> None:
        self.max_lines = max_lines
        self.summary = ""

    def on_fit_start(self, trainer: TrainerView, module: JaxModule) -> None:
        if not distributed.is_rank_zero():
            return
        shapes = jax.eval_shape(lambda state: state.params, trainer.state)
        self.summary = parameter_overview.get_parameter_overview(
            flat_shapes(shapes), include_stats=False, max_lines=self.max_lines
        )
        self.summary += _trainable(module, shapes)
        self.summary += _in_out_sizes(trainer, module) + _data_path(trainer)
        print(self.summary, flush=True)

    def on_train_start(self, trainer: TrainerView, module: JaxModule) -> None:
        # Here, not at fit start: the compile runs meanwhile (the first step
        # waits for it anyway), alongside the sanity check's.
        if not distributed.is_rank_zero():
            return
        lines = []
        cost = trainer.train_step_cost()
        if cost is not None:
            lines.append(f"Train step per device: {cost.describe()}")
        cost = trainer.eval_step_cost()  # the sanity check's validation, if one ran
        if cost is not None:
            lines.append(f"Eval step per device: {cost.describe()}")
        for line in lines:
            self.summary += "\n" + line
            print(line, flush=True)


def _trainable(module: JaxModule, params: Any) -> str:
    """Lightning's trainable / non-trainable counts, where LoRA freezes the base."""
    if module.lora is None:
        return ""
    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    adapters = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(adapters_only(params)))
    return (
        f"\nTrainable params: {adapters:,} (LoRA adapters, {adapters / total:.2%}); "
        f"non-trainable params: {total - adapters:,} (frozen)"
    )


def _shapes_text(tree: Any) -> str:
    shapes = [list(np.shape(x)) for x in jax.tree.leaves(tree)]
    return str(shapes[0] if len(shapes) == 1 else shapes)


def _in_out_sizes(trainer: TrainerView, module: JaxModule) -> str:
    """Lightning's "In sizes / Out sizes" of ``example_input_array`` through the
    module's ``forward`` (from shapes alone, nothing computed), or ``""``."""
    example = getattr(module, "example_input_array", None)
    if example is None or not contract.overrides(module, "forward"):
        return ""
    args = to_numpy(example if isinstance(example, tuple) else (example,))  # torch's too
    if is_nnx(getattr(module, "model", None)):
        return ""  # forward takes the model: no shapes-only run of it here
    variables = jax.eval_shape(lambda state: state.variables, trainer.state)
    out = jax.eval_shape(module.forward, variables, *args)
    return f"\nIn sizes: {_shapes_text(args)} -- Out sizes: {_shapes_text(out)}"


def _data_path(trainer: TrainerView) -> str:
    """Which data path the fit's training batches take, or ``""``."""
    path = getattr(trainer, "data_path", None)
    if path == "device":
        text = "\nData: on the devices (each step's rows gathered there)"
    elif path == "host":
        text = "\nData: from the host (loaded, converted and copied each step)"
    else:
        return ""
    steps = getattr(trainer, "steps_per_dispatch", 1)
    return text + f"; {steps} train step{'s' if steps > 1 else ''} per dispatch"


def _key_name(key: Any) -> str:
    """One step of a pytree path as text: a dict key, a list index, an attribute."""
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def flat_shapes(tree: Any) -> dict[str, Any]:
    """Any pytree of arrays (nested dicts, lists, tuples, dataclasses) as one flat
    dict by slash-joined path (``"layers/0/kernel"``), which the table takes."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(_key_name(k) for k in path) or "(root)": leaf for path, leaf in flat}


class Timer(Callback):
    """Measures the time spent in each stage, and stops training once
    ``duration`` has passed, as Lightning's ``Timer`` (``Trainer(max_time=...)``
    adds one): the elapsed training time is saved in checkpoints, so a resumed
    run counts on from it.

    Stages are ``"train"`` (from ``on_train_start``, once the train step is
    compiled: compiling is not training), ``"validate"``, ``"test"`` and
    ``"predict"``. The limit is checked after each training batch
    (``interval="step"``) or epoch (``"epoch"``), and when a fit starts (a
    timer restored used up trains nothing); across processes, process 0's
    clock decides, at logging intervals. The stop is a request
    (``trainer.should_stop``): ``min_epochs``/``min_steps`` hold it back.

    Args:
        duration: ``"DD:HH:MM:SS"``, a dict of ``timedelta`` keywords, a
            ``timedelta`` (zero included: stop at the first check), or ``None``
            to only measure.
        interval: ``"step"`` or ``"epoch"``: when the limit is checked.
        verbose: say on process 0 when the time limit stops training.
    """

    STAGES = ("train", "validate", "test", "predict")

    def __init__(self, duration: Any = None, interval: str = "step", verbose: bool = True) -> None:
        if interval not in ("step", "epoch"):
            raise ValueError(
                f"Unsupported parameter value Timer(interval={interval!r}): use 'step' or 'epoch'"
            )
        self.duration = parse_max_time(duration, "duration", minimum=0.0)
        self.interval = interval
        self.verbose = verbose
        self._start: dict[str, float | None] = dict.fromkeys(self.STAGES)
        self._end: dict[str, float | None] = dict.fromkeys(self.STAGES)
        self._offset = 0.0  # training time of the runs before a resume

    def start_time(self, stage: str = "train") -> float | None:
        """When ``stage`` last started (``time.monotonic``), ``None`` if never."""
        return self._start[stage]

    def end_time(self, stage: str = "train") -> float | None:
        """When ``stage`` last ended, ``None`` while it runs or before."""
        return self._end[stage]

    def time_elapsed(self, stage: str = "train") -> float:
        """Seconds spent in ``stage``'s last run (for ``"train"``, plus the
        training time restored from a checkpoint)."""
        start, end = self._start[stage], self._end[stage]
        offset = self._offset if stage == "train" else 0.0
        if start is None:
            return offset
        return (time.monotonic() if end is None else end) - start + offset

    def time_remaining(self, stage: str = "train") -> float | None:
        """``duration`` less the time elapsed (negative once over; ``None``
        without a duration)."""
        return None if self.duration is None else self.duration - self.time_elapsed(stage)

    def _started(self, stage: str) -> None:
        self._start[stage], self._end[stage] = time.monotonic(), None

    def _ended(self, stage: str) -> None:
        self._end[stage] = time.monotonic()

    def on_train_start(self, trainer: TrainerView, module: JaxModule) -> None:
        self._started("train")

    def on_train_end(self, trainer: TrainerView, module: JaxModule) -> None:
        self._ended("train")

    def on_validation_start(self, trainer: TrainerView, module: JaxModule) -> None:
        self._started("validate")

    def on_validation_end(self, trainer: TrainerView, module: JaxModule) -> None:
        self._ended("validate")

    def on_test_start(self, trainer: TrainerView, module: JaxModule) -> None:
        self._started("test")

    def on_test_end(self, trainer: TrainerView, module: JaxModule) -> None:
        self._ended("test")

    def on_predict_start(self, trainer: TrainerView, module: JaxModule) -> None:
        self._started("predict")

    def on_predict_end(self, trainer: TrainerView, module: JaxModule) -> None:
        self._ended("predict")

    def on_fit_start(self, trainer: TrainerView, module: JaxModule) -> None:
        # after the checkpoint's state is restored: a used-up timer trains nothing
        if self.duration is not None:
            self._check(trainer, at_sync=True)

    def needs_each_step(self) -> bool:
        """A limit checked after each step stops at that step's own state."""
        return self.interval == "step" and self.duration is not None

    def on_train_batch_end(self, trainer: TrainerView, module: JaxModule, batch_idx: int) -> None:
        if self.interval == "step" and self.duration is not None:
            self._check(trainer, at_sync=trainer.global_step % trainer.log_every_n_steps == 0)

    def on_train_epoch_end(self, trainer: TrainerView, module: JaxModule) -> None:
        if self.interval == "epoch" and self.duration is not None:
            self._check(trainer, at_sync=True)

    def _check(self, trainer: TrainerView, *, at_sync: bool) -> None:
        # every process stops at one step: process 0's clock decides at sync points
        elapsed = self.time_elapsed()
        if distributed.agree(elapsed >= self.duration, at_sync=at_sync):
            trainer.should_stop = True
            if self.verbose:
                rank_zero_info(
                    f"Time limit reached. Elapsed time is "
                    f"{datetime.timedelta(seconds=int(elapsed))}. Signaling Trainer to stop."
                )

    def state_dict(self) -> dict[str, Any]:
        return {"time_elapsed": {stage: self.time_elapsed(stage) for stage in self.STAGES}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # ({"fit": seconds}: a checkpoint written before the stages were Lightning's)
        elapsed = state.get("time_elapsed", {"train": state.get("fit", 0.0)})
        self._offset = float(elapsed.get("train", 0.0))


class ThroughputMonitor(Callback):
    """Logs ``throughput/samples_per_sec`` and ``throughput/step_time`` (seconds per
    optimizer step) over each logging interval, and ``throughput/compile_time``
    (seconds XLA spent compiling since the fit began) once the first interval
    ends. Samples are this process's real (unpadded) rows; wall time includes
    everything the loop does, so the figures are what the run achieves.

    With XLA's count of the compiled train step (`Trainer.train_step_cost`) it
    also logs ``throughput/flops_per_sec`` (all devices) and, where the peak of
    a device is known (``peak_flops``, else the table `jaxlightning.xla.cost.PEAK_FLOPS`
    of dense bfloat16 peaks by device kind), ``throughput/mfu``: achieved over
    peak FLOP/s — no FLOPs to count by hand.

    Args:
        batch_size_fn: Lightning's way to count a batch's samples; accepted for
            its signature and not needed: the Trainer counts the real rows of
            every batch itself (padding excluded).
        length_fn: Lightning's per-sample length for items/s: not supported
            (callbacks here do not receive the batch); refused with a message.
        peak_flops: one device's peak FLOP/s for the MFU (``None``: from the table).
    """

    def __init__(
        self,
        batch_size_fn: Any = None,
        length_fn: Any = None,
        *,
        peak_flops: float | None = None,
    ) -> None:
        if length_fn is not None:
            raise ValueError(
                "ThroughputMonitor(length_fn=...): items per second are not supported here "
                "(callbacks do not receive the batch); samples/s and FLOPs/MFU are logged"
            )
        self.batch_size_fn = batch_size_fn
        self.peak_flops = peak_flops
        self._step_flops: float | None = None
        self._compile = 0.0
        self._listening = False
        self._mark: tuple[float, int, int] | None = None
        self._reported_compile = False

    def _on_event(self, event: str, duration: float, **kwargs: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self._compile += duration

    def setup(self, trainer: TrainerView, module: JaxModule, stage: str) -> None:
        # Here, not at fit start: the fit's programs start compiling on worker
        # threads before on_fit_start (the train step may be done by then).
        if stage != "fit":
            return
        if not self._listening:
            jax.monitoring.register_event_duration_secs_listener(self._on_event)
            self._listening = True
        self._compile, self._reported_compile = 0.0, False

    def on_fit_start(self, trainer: TrainerView, module: JaxModule) -> None:
        self._mark = None
        self._step_flops = None

    def on_train_start(self, trainer: TrainerView, module: JaxModule) -> None:
        cost = trainer.train_step_cost()
        if cost is not None and cost.flops > 0:  # one device's step, times the devices
            self._step_flops = cost.flops * trainer.num_devices

    def on_train_batch_end(self, trainer: TrainerView, module: JaxModule, batch_idx: int) -> None:
        now, step, rows = time.monotonic(), trainer.global_step, trainer.train_samples_seen
        if self._mark is None:  # the first step includes compiling: start after it
            self._mark = (now, step, rows)
            return
        if step == self._mark[1] or step % trainer.log_every_n_steps:
            return
        start, start_step, start_rows = self._mark
        values = {
            "throughput/samples_per_sec": (rows - start_rows) / (now - start),
            "throughput/step_time": (now - start) / (step - start_step),
        }
        if self._step_flops is not None:
            flops = self._step_flops * trainer.accumulate_grad_batches
            achieved = flops * (step - start_step) / (now - start)
            values["throughput/flops_per_sec"] = achieved
            peak = self.peak_flops or peak_flops(trainer.strategy.devices[0])
            if peak:
                values["throughput/mfu"] = achieved / (peak * trainer.num_devices)
        if not self._reported_compile:
            values["throughput/compile_time"] = self._compile
            self._reported_compile = True
        for name, value in values.items():
            module.log(name, value)
        self._mark = (now, step, rows)


class JaxProfiler(Callback):
    """Records a ``jax.profiler`` trace of ``num_steps`` training steps from
    ``start_step`` into ``{log_dir}/plugins/profile/``, where TensorBoard's
    profile tab (``pip install tensorboard-plugin-profile``) shows it.
    ``Trainer(profiler="jax")`` adds one with the defaults.

    Args:
        start_step: the global step after which tracing starts (after the first
            steps, so compiling is not in the trace).
        num_steps: how many steps to trace.
        dirpath: where to write (default: the run's log directory, else
            ``default_root_dir``).
    """

    def __init__(self, start_step: int = 5, num_steps: int = 3, dirpath: str | None = None):
        self.start_step, self.num_steps, self.dirpath = start_step, num_steps, dirpath
        self._tracing = False
        self.trace_dir = ""

    def _stop(self, trainer: TrainerView) -> None:
        if self._tracing:
            jax.block_until_ready(trainer.state)  # waits for the traced steps (a copy of theirs)
            jax.profiler.stop_trace()
            self._tracing = False

    def on_train_batch_end(self, trainer: TrainerView, module: JaxModule, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self.start_step and not self._tracing and not self.trace_dir:
            root = self.dirpath or trainer.log_dir or trainer.default_root_dir
            self.trace_dir = root
            os.makedirs(root, exist_ok=True)
            jax.profiler.start_trace(root)
            self._tracing = True
        elif self._tracing and step >= self.start_step + self.num_steps:
            self._stop(trainer)

    def teardown(self, trainer: TrainerView, module: JaxModule, stage: str) -> None:
        if stage == "fit":
            self._stop(trainer)
