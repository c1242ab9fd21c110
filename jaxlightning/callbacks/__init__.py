"""Callbacks: host-side hooks into the loop."""

from jaxlightning.callbacks.base import Callback as Callback
from jaxlightning.callbacks.checkpoint import ModelCheckpoint as ModelCheckpoint
from jaxlightning.callbacks.early_stopping import EarlyStopping as EarlyStopping
from jaxlightning.callbacks.ema import EMA as EMA
from jaxlightning.callbacks.lr_monitor import LearningRateMonitor as LearningRateMonitor
from jaxlightning.callbacks.monitors import JaxProfiler as JaxProfiler
from jaxlightning.callbacks.monitors import ModelSummary as ModelSummary
from jaxlightning.callbacks.monitors import ThroughputMonitor as ThroughputMonitor
from jaxlightning.callbacks.monitors import Timer as Timer
from jaxlightning.callbacks.progress import TQDMProgressBar as TQDMProgressBar
