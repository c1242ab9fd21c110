"""Callbacks: host-side hooks into the loop."""

import datetime

from jaxlightning.callbacks.base import Callback as Callback
from jaxlightning.callbacks.checkpoint import ModelCheckpoint as ModelCheckpoint
from jaxlightning.callbacks.early_stopping import EarlyStopping as EarlyStopping
from jaxlightning.callbacks.ema import EMA as EMA
from jaxlightning.callbacks.finetuning import BackboneFinetuning as BackboneFinetuning
from jaxlightning.callbacks.finetuning import BaseFinetuning as BaseFinetuning
from jaxlightning.callbacks.lr_monitor import LearningRateMonitor as LearningRateMonitor
from jaxlightning.callbacks.monitors import JaxProfiler as JaxProfiler
from jaxlightning.callbacks.monitors import ModelSummary as ModelSummary
from jaxlightning.callbacks.monitors import ThroughputMonitor as ThroughputMonitor
from jaxlightning.callbacks.monitors import Timer as Timer
from jaxlightning.callbacks.progress import TQDMProgressBar as TQDMProgressBar
from jaxlightning.callbacks.swa import StochasticWeightAveraging as StochasticWeightAveraging
from jaxlightning.callbacks.view import StateEdits as StateEdits
from jaxlightning.callbacks.view import TrainerView as TrainerView
from jaxlightning.cluster import distributed
from jaxlightning.cluster.rank_zero import rank_zero_info


def with_defaults(
    callbacks: list[Callback],
    *,
    checkpointing: bool,
    progress_bar: bool,
    summary: bool,
    profiler: str | None,
    max_time: float | None = None,
) -> list[Callback]:
    """``callbacks`` with the ones the Trainer adds by default, unless given:
    a `ModelCheckpoint`, a `TQDMProgressBar` (process 0 only), a `ModelSummary`
    (first), a `JaxProfiler` for ``profiler="jax"``, and a `Timer` for
    ``max_time`` (seconds; one among ``callbacks`` is kept, as in Lightning).
    Refuses a `ModelCheckpoint` when ``checkpointing`` is off (`check_checkpointing`)."""

    def has(kind: type) -> bool:
        return any(isinstance(c, kind) for c in callbacks)

    check_checkpointing(callbacks, enabled=checkpointing)
    callbacks = list(callbacks)
    if checkpointing and not has(ModelCheckpoint):
        callbacks.append(ModelCheckpoint())
    if progress_bar and distributed.is_rank_zero() and not has(TQDMProgressBar):
        callbacks.append(TQDMProgressBar())
    if summary and not has(ModelSummary):
        callbacks.insert(0, ModelSummary())
    if profiler not in (None, "jax"):
        raise ValueError(f"profiler={profiler!r}: use 'jax' or None")
    if profiler == "jax":
        callbacks.append(JaxProfiler())
    if max_time is not None:
        if has(Timer):
            rank_zero_info(
                "Ignoring `Trainer(max_time=...)`, callbacks list already contains a Timer."
            )
        else:
            callbacks.append(Timer(duration=datetime.timedelta(seconds=max_time)))
    return callbacks


def check_checkpointing(callbacks: list[Callback], *, enabled: bool) -> None:
    """Lightning's check of ``Trainer(enable_checkpointing=False)`` with a
    `ModelCheckpoint` among ``callbacks``: a contradiction, refused (`ValueError`)."""
    if not enabled and any(isinstance(c, ModelCheckpoint) for c in callbacks):
        raise ValueError(
            "Trainer was configured with `enable_checkpointing=False` but found "
            "`ModelCheckpoint` in callbacks list: remove it, or leave enable_checkpointing=True"
        )
