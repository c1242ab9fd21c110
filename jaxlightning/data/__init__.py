"""The data path: users' loaders to device batches (see `Pipeline`)."""

from jaxlightning.data.convert import BatchError as BatchError
from jaxlightning.data.convert import Padder as Padder
from jaxlightning.data.convert import to_numpy as to_numpy
from jaxlightning.data.datamodule import DataModule as DataModule
from jaxlightning.data.pipeline import Pipeline as Pipeline
from jaxlightning.data.prefetch import Batches as Batches
from jaxlightning.data.prefetch import DeviceBatch as DeviceBatch
from jaxlightning.data.prefetch import Prefetcher as Prefetcher
