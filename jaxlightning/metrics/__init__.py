"""Metrics for ``self.log``: exact across devices and steps.

`jaxlightning.metrics.logged` holds what ``self.log`` records (reductions on
device); `jaxlightning.metrics.objects` the metric objects re-exported here::

    self.log("f1", jl.metrics.F1Score(logits, labels, num_classes=10, average="macro"))
"""

from jaxlightning.metrics.objects import AUROC as AUROC
from jaxlightning.metrics.objects import Accuracy as Accuracy
from jaxlightning.metrics.objects import AveragePrecision as AveragePrecision
from jaxlightning.metrics.objects import ConfusionMatrix as ConfusionMatrix
from jaxlightning.metrics.objects import F1Score as F1Score
from jaxlightning.metrics.objects import MatthewsCorrCoef as MatthewsCorrCoef
from jaxlightning.metrics.objects import MeanAbsoluteError as MeanAbsoluteError
from jaxlightning.metrics.objects import MeanSquaredError as MeanSquaredError
from jaxlightning.metrics.objects import MetricObject as MetricObject
from jaxlightning.metrics.objects import PearsonCorrCoef as PearsonCorrCoef
from jaxlightning.metrics.objects import Precision as Precision
from jaxlightning.metrics.objects import Recall as Recall
from jaxlightning.metrics.objects import SpearmanCorrCoef as SpearmanCorrCoef
from jaxlightning.metrics.objects import TokenMean as TokenMean
