"""jaxlightning: a Lightning-style trainer for JAX, data-parallel over every device."""

from jaxlightning import callbacks as callbacks
from jaxlightning import cli as cli
from jaxlightning import loggers as loggers
from jaxlightning import metrics as metrics
from jaxlightning import strategies as strategies
from jaxlightning.callbacks import Callback as Callback
from jaxlightning.callbacks import EarlyStopping as EarlyStopping
from jaxlightning.callbacks import LearningRateMonitor as LearningRateMonitor
from jaxlightning.callbacks import ModelCheckpoint as ModelCheckpoint
from jaxlightning.callbacks import TQDMProgressBar as TQDMProgressBar
from jaxlightning.callbacks.plateau import ReduceLROnPlateau as ReduceLROnPlateau
from jaxlightning.callbacks.rollback import Rollback as Rollback
from jaxlightning.cluster.rank_zero import rank_zero_info as rank_zero_info
from jaxlightning.cluster.rank_zero import rank_zero_only as rank_zero_only
from jaxlightning.cluster.rank_zero import rank_zero_warn as rank_zero_warn
from jaxlightning.data import BatchError as BatchError
from jaxlightning.data import DataModule as DataModule
from jaxlightning.data.arrays import arrays as arrays
from jaxlightning.data.buckets import BucketCollate as BucketCollate
from jaxlightning.data.signature import RecompileError as RecompileError
from jaxlightning.io.checkpoint import CheckpointError as CheckpointError
from jaxlightning.io.export import load_exported as load_exported
from jaxlightning.loggers import CSVLogger as CSVLogger
from jaxlightning.loggers import Logger as Logger
from jaxlightning.loggers import TensorBoardLogger as TensorBoardLogger
from jaxlightning.module import AttributeDict as AttributeDict
from jaxlightning.module import JaxModule as JaxModule
from jaxlightning.seed import seed_everything as seed_everything
from jaxlightning.strategies import FSDPStrategy as FSDPStrategy
from jaxlightning.strategies import ModelParallelStrategy as ModelParallelStrategy
from jaxlightning.strategies import PmapStrategy as PmapStrategy
from jaxlightning.strategies import ShardMapStrategy as ShardMapStrategy
from jaxlightning.strategies import Strategy as Strategy
from jaxlightning.strategies import fsdp_gathered as fsdp_gathered
from jaxlightning.trainer import NonFiniteLossError as NonFiniteLossError
from jaxlightning.trainer import Trainer as Trainer
from jaxlightning.trainer import TrainerArgs as TrainerArgs
from jaxlightning.training.state import TrainState as TrainState
from jaxlightning.training.step import AXIS as AXIS
from jaxlightning.tuner.tuner import Tuner as Tuner
from jaxlightning.xla.memory import MemoryBudget as MemoryBudget
from jaxlightning.xla.memory import MemoryBudgetError as MemoryBudgetError

__version__ = "0.1.0"
