"""Loggers: where host-side metric values go."""

from jaxlightning.loggers.base import Logger as Logger
from jaxlightning.loggers.csv import CSVLogger as CSVLogger
from jaxlightning.loggers.mlflow_logger import MLFlowLogger as MLFlowLogger
from jaxlightning.loggers.tensorboard import TensorBoardLogger as TensorBoardLogger
from jaxlightning.loggers.wandb_logger import WandbLogger as WandbLogger
