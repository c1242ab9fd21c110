"""Metric objects for ``self.log``: F1, AUROC, correlation, ... exact across devices.

A metric object holds one device shard's per-example inputs (leading axis: the
rows the traced hook sees) and its static settings::

    self.log("f1", jl.metrics.F1Score(logits, labels, num_classes=10, average="macro"))

`jaxlightning.metrics.from_logged` asks it for its `state` over the real rows
(padding rows never count). Every state is a `clu.metrics.Metric` whose array
fields are **sums** (confusion counts, histogram bins, moments), so the ``psum``
across devices and the merge across steps are exact: the score is computed once,
on the host, from the sums of every real row of the run. `MetricSpec` (class and
settings) is what ``LogOptions`` carries so that `zero` builds the empty state
with the right shapes before anything is traced.

``compute()`` of these states runs on the host, in float64 numpy, on fetched
sums; it is not meant for traced code.

Rank metrics need every row at once (`SpearmanCorrCoef`, the exact AUROC of
``AUROC(..., thresholds=None)``, `AveragePrecision`): their state is `Rows`,
one evaluation step's rows gathered from every device, which the evaluation
loop keeps step by step and the host concatenates (real rows only) to score
once. They are for evaluation hooks: a training epoch's rows are not kept.
`ConfusionMatrix` is summed like the rest; its value is the matrix itself.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from clu import metrics as clu_metrics
from scipy import stats

AVERAGES = ("binary", "macro", "micro", "weighted")


# ------------------------------------------------------------------ states
@flax.struct.dataclass
class Sums(clu_metrics.Metric):
    """A state whose every array field is a sum: merging adds field by field."""

    def merge(self, other: Sums) -> Sums:
        return jax.tree.map(jnp.add, self, other)


def _ratio(num: Any, den: Any) -> Any:
    """``num / den``, 0 where ``den`` is 0 (scikit-learn's default zero division,
    without its warning)."""
    den = np.asarray(den, np.float64)
    return np.where(den == 0, 0.0, np.asarray(num, np.float64) / np.where(den == 0, 1.0, den))


def confusion_score(matrix: np.ndarray, score: str, average: str) -> float:
    """``score`` (``"precision"``, ``"recall"``, ``"f1"`` or ``"mcc"``) of a confusion
    matrix (``matrix[true, predicted]``), averaged as scikit-learn's ``average=``.

    ``"macro"`` averages over the classes that occur as a target or a prediction
    (the labels scikit-learn sees), ``"weighted"`` weights by each class's
    targets, ``"binary"`` scores class 1, ``"micro"`` pools the counts.
    """
    matrix = np.asarray(matrix, np.float64)
    if score == "mcc":
        return _matthews(matrix)
    tp, predicted, actual = np.diag(matrix), matrix.sum(0), matrix.sum(1)
    if average == "binary":
        tp, predicted, actual = tp[1:], predicted[1:], actual[1:]
    elif average == "micro":
        tp, predicted, actual = (
            tp.sum(keepdims=True),
            predicted.sum(keepdims=True),
            actual.sum(keepdims=True),
        )
    per_class = {
        "precision": _ratio(tp, predicted),
        "recall": _ratio(tp, actual),
        "f1": _ratio(2 * tp, predicted + actual),
    }[score]
    if average == "weighted":
        weights = actual
    elif average == "macro":
        weights = (predicted + actual > 0).astype(np.float64)
    else:
        weights = np.ones_like(tp)
    return float(_ratio((per_class * weights).sum(), weights.sum()))


def _matthews(matrix: np.ndarray) -> float:
    """Multiclass Matthews correlation (scikit-learn's ``matthews_corrcoef``):
    0 where it is undefined."""
    n, correct = matrix.sum(), np.trace(matrix)
    actual, predicted = matrix.sum(1), matrix.sum(0)
    cov_tp = correct * n - actual @ predicted
    cov_pp = n * n - predicted @ predicted
    cov_tt = n * n - actual @ actual
    if cov_pp * cov_tt == 0:
        return 0.0
    return float(cov_tp / np.sqrt(cov_tt * cov_pp))


@flax.struct.dataclass
class ConfusionCounts(Sums):
    """A summed confusion matrix (``matrix[t, p]``: real rows of target ``t``
    predicted ``p``) and the score to compute from it (`confusion_score`)."""

    matrix: jax.Array
    count: jax.Array
    score: str = flax.struct.field(pytree_node=False, default="f1")
    average: str = flax.struct.field(pytree_node=False, default="macro")

    def compute(self) -> float:
        return confusion_score(self.matrix, self.score, self.average)


@flax.struct.dataclass
class Hits(Sums):
    """Real rows whose target was predicted (in the top k), and real rows."""

    hits: jax.Array
    count: jax.Array

    def compute(self) -> float:
        return float(_ratio(self.hits, self.count))


@flax.struct.dataclass
class MeanError(Sums):
    """A summed per-row error and the real rows: its mean (root: its square root)."""

    total: jax.Array
    count: jax.Array
    root: bool = flax.struct.field(pytree_node=False, default=False)

    def compute(self) -> float:
        mean = float(_ratio(self.total, self.count))
        return float(np.sqrt(mean)) if self.root else mean


@flax.struct.dataclass
class Moments(Sums):
    """Sums of ``x``, ``y``, their squares and products over real rows."""

    count: jax.Array
    x: jax.Array
    y: jax.Array
    xx: jax.Array
    yy: jax.Array
    xy: jax.Array

    def compute(self) -> float:
        n, x, y, xx, yy, xy = (
            np.float64(v) for v in (self.count, self.x, self.y, self.xx, self.yy, self.xy)
        )
        var_x, var_y = xx - x * x / n, yy - y * y / n
        if var_x <= 0 or var_y <= 0:
            return float("nan")  # a constant input: undefined, as numpy.corrcoef
        return float(np.clip((xy - x * y / n) / np.sqrt(var_x * var_y), -1.0, 1.0))


@flax.struct.dataclass
class RocBins(Sums):
    """Positive and negative real rows by bin of a threshold grid: bin ``b``
    holds scores with ``b`` grid values at or below them."""

    positives: jax.Array
    negatives: jax.Array
    count: jax.Array

    def compute(self) -> float:
        def above(hist: Any) -> np.ndarray:  # rows at or above each threshold, then none
            return np.append(np.cumsum(np.asarray(hist, np.float64)[::-1])[::-1], 0.0)

        tp, fp = above(self.positives), above(self.negatives)
        if tp[0] == 0 or fp[0] == 0:
            return float("nan")  # one class only: undefined (scikit-learn raises)
        tpr, fpr = tp / tp[0], fp / fp[0]
        return float(np.sum((fpr[:-1] - fpr[1:]) * (tpr[:-1] + tpr[1:]) / 2))


NORMALIZE = (None, "true", "pred", "all")


@flax.struct.dataclass
class ConfusionTable(Sums):
    """A summed confusion matrix whose value is the matrix (``normalize``: as
    ``sklearn.metrics.confusion_matrix``'s, rows where nothing is counted stay 0)."""

    matrix: jax.Array
    count: jax.Array
    normalize: str | None = flax.struct.field(pytree_node=False, default=None)

    def compute(self) -> np.ndarray:
        matrix = np.asarray(self.matrix)
        if self.normalize is None:
            return matrix.astype(np.int64)
        axis = {"true": 1, "pred": 0, "all": None}[self.normalize]
        return _ratio(matrix, matrix.sum(axis=axis, keepdims=axis is not None))


def _auroc(scores: np.ndarray, target: np.ndarray) -> float:
    """The exact ROC area: the Mann-Whitney statistic over average ranks (ties
    count one half), which is the trapezoid area of scikit-learn's curve."""
    positive = target == 1
    p, n = int(positive.sum()), int((~positive).sum())
    if p == 0 or n == 0:
        return float("nan")  # one class only: undefined (scikit-learn raises)
    ranks = stats.rankdata(scores)
    return float((ranks[positive].sum() - p * (p + 1) / 2) / (p * n))


def _average_precision(scores: np.ndarray, target: np.ndarray) -> float:
    """Precision at each distinct threshold weighted by the recall gained there."""
    order = np.argsort(-scores, kind="mergesort")
    scores, positive = scores[order], target[order] == 1
    if not positive.any():
        return float("nan")  # no positive: recall undefined
    last = np.r_[np.flatnonzero(np.diff(scores)), scores.size - 1]  # end of each tie group
    tp = np.cumsum(positive)[last].astype(np.float64)
    precision, recall = tp / (last + 1), tp / tp[-1]
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def _spearman(preds: np.ndarray, target: np.ndarray) -> float:
    """Pearson's correlation of the average ranks (NaN for a constant input)."""
    x, y = stats.rankdata(preds), stats.rankdata(target)
    x, y = x - x.mean(), y - y.mean()
    den = np.sqrt((x * x).sum() * (y * y).sum())
    return float("nan") if den == 0 else float(np.clip((x * y).sum() / den, -1.0, 1.0))


RANK_FORMULAS = {"auroc": _auroc, "average_precision": _average_precision, "spearman": _spearman}


@flax.struct.dataclass
class Rows(clu_metrics.Metric):
    """Rows of a rank metric: inside a step, one step's rows of every device
    (gathered across devices, padding rows marked by ``mask``); on the host,
    after `concatenate`, every real row of the evaluation.

    They do not add up on device: the step returns them and the evaluation
    loop keeps each step's (`merge` is the latest step's rows).
    """

    preds: jax.Array
    target: jax.Array
    mask: jax.Array
    count: jax.Array
    formula: str = flax.struct.field(pytree_node=False, default="spearman")

    def merge(self, other: Rows) -> Rows:
        return other

    @classmethod
    def concatenate(cls, steps: Sequence[Rows], formula: str) -> Rows:
        """The real rows of fetched ``steps``, in order (host numpy)."""
        if not steps:
            empty = np.zeros(0, np.float64)
            return cls(empty, empty, np.zeros(0, bool), np.zeros((), np.int64), formula)
        mask = np.concatenate([np.asarray(s.mask, bool) for s in steps])
        preds = np.concatenate([np.asarray(s.preds, np.float64) for s in steps])[mask]
        target = np.concatenate([np.asarray(s.target, np.float64) for s in steps])[mask]
        return cls(preds, target, np.ones(preds.size, bool), np.asarray(preds.size), formula)

    def compute(self) -> float:
        mask = np.asarray(self.mask, bool)
        preds, target = np.asarray(self.preds, np.float64), np.asarray(self.target, np.float64)
        return RANK_FORMULAS[self.formula](preds[mask], target[mask])


# ------------------------------------------------------------ the objects
@dataclasses.dataclass(frozen=True)
class MetricSpec:
    """A metric object's class and static settings: all `zero` needs for its
    empty state (hashable, so it can sit in ``LogOptions``)."""

    kind: type[MetricObject]
    settings: tuple[tuple[str, Hashable], ...]

    def empty(self) -> clu_metrics.Metric:
        """The state of no rows (host numpy arrays)."""
        return self.kind.empty(**dict(self.settings))

    @property
    def collects(self) -> bool:
        """Whether the state is a rank metric's `Rows` (kept step by step, for
        evaluation hooks only) rather than sums."""
        return isinstance(self.empty(), Rows)

    def __str__(self) -> str:
        args = ", ".join(f"{key}={value!r}" for key, value in self.settings)
        return f"{self.kind.__name__}({args})"


class MetricObject(abc.ABC):
    """A value for ``self.log`` in a traced hook that reduces to summed state.

    Built from per-example ``preds`` and ``target`` (leading axis: this device's
    rows) and static settings. Subclasses state:

    - `settings`: the hashable settings that fix the state (its shapes, its
      formula); `MetricSpec` carries them to `empty`;
    - `empty(**settings)`: the state of no rows, as host numpy arrays;
    - `state(mask)`: the state over the rows where ``mask`` is True (traced),
      with `empty`'s structure, every array field a sum, and a ``count`` of
      the real rows.
    """

    def __init__(self, preds: Any, target: Any) -> None:
        self.preds, self.target = jnp.asarray(preds), jnp.asarray(target)
        for role, value in (("preds", self.preds), ("target", self.target)):
            if value.ndim == 0:
                raise ValueError(
                    f"{type(self).__name__}: {role} is a scalar; give one value per "
                    "example (the leading axis: this device's rows)"
                )
        if self.preds.shape[0] != self.target.shape[0]:
            raise ValueError(
                f"{type(self).__name__}: preds of shape {self.preds.shape} and target of "
                f"shape {self.target.shape} have different numbers of rows; give one row "
                "per example for both"
            )

    @property
    def rows(self) -> int:
        """The examples this object holds (this device's shard)."""
        return self.preds.shape[0]

    @property
    def spec(self) -> MetricSpec:
        return MetricSpec(type(self), tuple(self.settings().items()))

    def __repr__(self) -> str:
        return str(self.spec)

    @abc.abstractmethod
    def settings(self) -> dict[str, Hashable]:
        """The static settings that fix the state (keyword arguments of `empty`)."""

    @classmethod
    @abc.abstractmethod
    def empty(cls, **settings: Any) -> clu_metrics.Metric:
        """The state of no rows, as host numpy arrays."""

    @abc.abstractmethod
    def state(self, mask: jax.Array) -> clu_metrics.Metric:
        """The state over the rows where ``mask`` is True (traced)."""

    def _vector(self, role: str, value: jax.Array) -> jax.Array:
        if value.ndim != 1:
            raise ValueError(
                f"{self!r}: {role} has shape {value.shape}; give one value per row, "
                f"shape ({value.shape[0]},)"
            )
        return value

    def _labels(self, value: jax.Array) -> jax.Array:
        """``value`` as class labels: integers or booleans, one per row."""
        value = self._vector("preds", value)
        if jnp.issubdtype(value.dtype, jnp.inexact):
            raise ValueError(
                f"{self!r}: preds of shape {value.shape} are {value.dtype} numbers; give "
                "class labels (integers or booleans: `probs > 0.5`, `logits.argmax(-1)`) "
                "or scores with one column per class"
            )
        return value.astype(jnp.int32)


def _count(mask: jax.Array) -> jax.Array:
    return mask.sum(dtype=jnp.int32)


def _int(value: Any) -> Any:
    """A Python int for a numpy one (settings are hashed and shown), else as given."""
    return int(value) if isinstance(value, np.integer) else value


class _Confusion(MetricObject):
    """Scores of a summed confusion matrix: the formulas in `confusion_score`."""

    score = ""

    def __init__(
        self, preds: Any, target: Any, *, num_classes: int = 2, average: str = "binary"
    ) -> None:
        super().__init__(preds, target)
        name, num_classes = type(self).__name__, _int(num_classes)
        if not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"{name}: num_classes={num_classes!r}; give an int, at least 2")
        if average not in AVERAGES:
            raise ValueError(f"{name}: average={average!r}; use one of {AVERAGES}")
        if average == "binary" and num_classes != 2:
            raise ValueError(
                f"{name}(num_classes={num_classes}, average='binary'): 'binary' scores "
                "class 1 of two classes; with more, use average='macro', 'micro' or 'weighted'"
            )
        self.num_classes, self.average = num_classes, average
        if self.preds.ndim == 2:
            if self.preds.shape[1] != num_classes:
                raise ValueError(
                    f"{self!r}: preds of shape {self.preds.shape} hold "
                    f"{self.preds.shape[1]} scores per row; give scores of shape "
                    f"({self.rows}, {num_classes}) or class labels of shape ({self.rows},)"
                )
            self.labels = self.preds.argmax(-1).astype(jnp.int32)
        else:
            self.labels = self._labels(self.preds)
        self.classes = self._vector("target", self.target).astype(jnp.int32)

    def settings(self) -> dict[str, Hashable]:
        return {"num_classes": self.num_classes, "average": self.average}

    @classmethod
    def empty(cls, num_classes: int, average: str = "macro") -> ConfusionCounts:
        zeros = np.zeros((num_classes, num_classes), np.int32)
        return ConfusionCounts(zeros, np.zeros((), np.int32), cls.score, average)

    def state(self, mask: jax.Array) -> ConfusionCounts:
        n = self.num_classes
        # Labels outside [0, num_classes) enter no cell (they still count as rows).
        valid = mask & (self.classes >= 0) & (self.classes < n)
        valid &= (self.labels >= 0) & (self.labels < n)
        cells = jnp.where(valid, self.classes * n + self.labels, 0)
        matrix = jnp.zeros(n * n, jnp.int32).at[cells].add(valid.astype(jnp.int32))
        return ConfusionCounts(matrix.reshape(n, n), _count(mask), self.score, self.average)


class Precision(_Confusion):
    """Precision of class predictions, as ``sklearn.metrics.precision_score``.

    Args:
        preds: class labels ``[rows]`` (integers or booleans) or scores
            ``[rows, num_classes]`` (their argmax is the prediction).
        target: class labels ``[rows]``.
        num_classes: the number of classes (labels outside ``[0, num_classes)``
            enter no count).
        average: ``"binary"`` (class 1 of two, the default, as scikit-learn's),
            ``"macro"`` (classes seen as a target or a prediction), ``"micro"``
            or ``"weighted"`` (by each class's targets). A class never predicted
            has precision 0, without a warning.
    """

    score = "precision"


class Recall(_Confusion):
    """Recall, as ``sklearn.metrics.recall_score``; arguments as `Precision`'s."""

    score = "recall"


class F1Score(_Confusion):
    """F1 score, as ``sklearn.metrics.f1_score``; arguments as `Precision`'s.

    Example:
        ``self.log("f1", jl.metrics.F1Score(logits, y, num_classes=10, average="macro"))``
    """

    score = "f1"


class MatthewsCorrCoef(_Confusion):
    """Matthews correlation coefficient, multiclass, as
    ``sklearn.metrics.matthews_corrcoef`` (0 where undefined); arguments as
    `Precision`'s, without ``average``."""

    score = "mcc"

    def __init__(self, preds: Any, target: Any, *, num_classes: int = 2) -> None:
        super().__init__(preds, target, num_classes=num_classes, average="macro")

    def settings(self) -> dict[str, Hashable]:
        return {"num_classes": self.num_classes}


class ConfusionMatrix(_Confusion):
    """The confusion matrix of class predictions, as
    ``sklearn.metrics.confusion_matrix(target, preds, labels=range(num_classes),
    normalize=normalize)``: ``matrix[t, p]`` counts real rows of target ``t``
    predicted ``p``. Its value is the matrix (a numpy array in
    ``trainer.callback_metrics`` and the results of ``validate``/``test``);
    loggers record numbers only, so it is not sent to them.

    Args:
        preds: class labels or scores, as `Precision`'s.
        target: class labels ``[rows]``.
        num_classes: the number of classes (the matrix is square in it).
        normalize: ``None`` (counts), ``"true"`` (each row sums to 1),
            ``"pred"`` (each column) or ``"all"``.
    """

    def __init__(
        self, preds: Any, target: Any, *, num_classes: int = 2, normalize: str | None = None
    ) -> None:
        if normalize not in NORMALIZE:
            raise ValueError(f"ConfusionMatrix: normalize={normalize!r}; use one of {NORMALIZE}")
        self.normalize = normalize
        super().__init__(preds, target, num_classes=num_classes, average="macro")

    def settings(self) -> dict[str, Hashable]:
        return {"num_classes": self.num_classes, "normalize": self.normalize}

    @classmethod
    def empty(  # type: ignore[override]
        cls, num_classes: int, normalize: str | None = None
    ) -> ConfusionTable:
        zeros = np.zeros((num_classes, num_classes), np.int32)
        return ConfusionTable(zeros, np.zeros((), np.int32), normalize)

    def state(self, mask: jax.Array) -> ConfusionTable:  # type: ignore[override]
        counts = super().state(mask)
        return ConfusionTable(counts.matrix, counts.count, self.normalize)


class Accuracy(MetricObject):
    """The fraction of rows predicted right, as ``sklearn.metrics.accuracy_score``,
    or in the top k, as ``top_k_accuracy_score``.

    Args:
        preds: class labels ``[rows]`` (integers or booleans), or scores
            ``[rows, classes]``: a hit when the target is among the ``top_k``
            highest (ties go to the lower class index, as ``argmax``).
        target: class labels ``[rows]``.
        top_k: with scores, how many of the highest count (default 1).
    """

    def __init__(self, preds: Any, target: Any, *, top_k: int | None = None) -> None:
        super().__init__(preds, target)
        self.top_k = top_k = _int(top_k)
        target = self._vector("target", self.target).astype(jnp.int32)
        if self.preds.ndim == 2:
            k, classes = top_k or 1, self.preds.shape[1]
            if not isinstance(k, int) or not 1 <= k <= classes:
                raise ValueError(
                    f"{self!r}: top_k must be an int from 1 to the {classes} classes of "
                    f"preds of shape {self.preds.shape}"
                )
            _, best = jax.lax.top_k(self.preds, k)
            self.hits = (best == target[:, None]).any(-1)
        elif top_k not in (None, 1):
            raise ValueError(
                f"{self!r}: top_k needs scores of shape ({self.rows}, classes); preds "
                f"have shape {self.preds.shape}"
            )
        else:
            self.hits = self._labels(self.preds) == target

    def settings(self) -> dict[str, Hashable]:
        return {"top_k": self.top_k}

    @classmethod
    def empty(cls, top_k: int | None = None) -> Hits:
        return Hits(np.zeros((), np.int32), np.zeros((), np.int32))

    def state(self, mask: jax.Array) -> Hits:
        return Hits((self.hits & mask).sum(dtype=jnp.int32), _count(mask))


class _MeanError(MetricObject):
    """The mean over real rows and all their values of an error of ``preds``
    against ``target`` (same shape): scikit-learn's uniform average over outputs."""

    def __init__(self, preds: Any, target: Any) -> None:
        super().__init__(preds, target)
        if self.preds.shape != self.target.shape:
            raise ValueError(
                f"{self!r}: preds of shape {self.preds.shape} and target of shape "
                f"{self.target.shape} differ; give both the same shape"
            )

    def settings(self) -> dict[str, Hashable]:
        return {}

    @classmethod
    def _root(cls, **settings: Any) -> bool:
        """Whether the score is the square root of the mean."""
        return False

    @classmethod
    def empty(cls, **settings: Any) -> MeanError:
        zero = np.zeros((), np.float32)
        return MeanError(zero, np.zeros((), np.int32), cls._root(**settings))

    @abc.abstractmethod
    def error(self, diff: jax.Array) -> jax.Array:
        """The per-value error of ``diff = preds - target``."""

    def state(self, mask: jax.Array) -> MeanError:
        diff = self.preds.astype(jnp.float32) - self.target.astype(jnp.float32)
        per_row = self.error(diff).reshape(self.rows, -1).mean(-1)
        total = jnp.where(mask, per_row, 0.0).sum()
        return MeanError(total, _count(mask), self._root(**self.settings()))


class MeanAbsoluteError(_MeanError):
    """Mean absolute error, as ``sklearn.metrics.mean_absolute_error``."""

    def error(self, diff: jax.Array) -> jax.Array:
        return jnp.abs(diff)


class MeanSquaredError(_MeanError):
    """Mean squared error, as ``sklearn.metrics.mean_squared_error``
    (``squared=False``: its root, as ``root_mean_squared_error``)."""

    def __init__(self, preds: Any, target: Any, *, squared: bool = True) -> None:
        self.squared = bool(squared)
        super().__init__(preds, target)

    def settings(self) -> dict[str, Hashable]:
        return {"squared": self.squared}

    @classmethod
    def _root(cls, squared: bool = True) -> bool:
        return not squared

    def error(self, diff: jax.Array) -> jax.Array:
        return diff * diff


class TokenMean(MetricObject):
    """The mean of ``values`` over the elements where ``mask`` is True, exact
    over every real row of every device: a language model's loss per predicted
    token, not a mean of row means. As a value of ``self.log``, or returned by
    ``loss`` (the gradient is then of the mean over the global batch's tokens).

    Args:
        values: one row per example (leading axis), any trailing shape, e.g.
            ``(rows, seq_len)`` per-token losses.
        mask: booleans of the same shape: which values count (the predicted
            tokens: same document, not padding).
    """

    def __init__(self, values: Any, mask: Any) -> None:
        super().__init__(values, mask)
        if self.preds.shape != self.target.shape:
            raise ValueError(
                f"TokenMean: values of shape {self.preds.shape} and mask of shape "
                f"{self.target.shape} differ; give one mask entry per value"
            )
        if jnp.issubdtype(self.target.dtype, jnp.inexact):
            raise ValueError(
                f"TokenMean: the mask is {self.target.dtype}; give booleans (or 0/1 integers)"
            )

    def settings(self) -> dict[str, Hashable]:
        return {}

    @classmethod
    def empty(cls, **settings: Any) -> MeanError:
        return MeanError(np.zeros((), np.float32), np.zeros((), np.int32))

    def state(self, mask: jax.Array) -> MeanError:
        rows = mask.reshape(mask.shape + (1,) * (self.preds.ndim - 1))
        counted = self.target.astype(bool) & rows
        total = jnp.where(counted, self.preds.astype(jnp.float32), 0.0).sum()
        return MeanError(total, counted.sum(dtype=jnp.int32))


class PearsonCorrCoef(MetricObject):
    """Pearson's correlation of ``preds`` and ``target`` (one value per row), as
    ``numpy.corrcoef``; NaN when either is constant.

    Computed from float32 sums of ``x``, ``y``, ``x²``, ``y²`` and ``xy``: values
    whose mean is large next to their spread lose precision (center them).
    """

    def __init__(self, preds: Any, target: Any) -> None:
        super().__init__(preds, target)
        self.x = self._vector("preds", self.preds).astype(jnp.float32)
        self.y = self._vector("target", self.target).astype(jnp.float32)

    def settings(self) -> dict[str, Hashable]:
        return {}

    @classmethod
    def empty(cls) -> Moments:
        zero = np.zeros((), np.float32)
        return Moments(np.zeros((), np.int32), zero, zero, zero, zero, zero)

    def state(self, mask: jax.Array) -> Moments:
        x, y = jnp.where(mask, self.x, 0.0), jnp.where(mask, self.y, 0.0)
        return Moments(_count(mask), x.sum(), y.sum(), (x * x).sum(), (y * y).sum(), (x * y).sum())


def threshold_grid(thresholds: int | Sequence[float]) -> np.ndarray:
    """The float32 grid of `AUROC`'s ``thresholds``: ``N`` evenly spaced in [0, 1],
    or the given increasing values."""
    if isinstance(thresholds, int):
        return np.linspace(0.0, 1.0, thresholds).astype(np.float32)
    return np.asarray(thresholds, np.float32)


class AUROC(MetricObject):
    """Area under the ROC curve of binary targets, binned on a fixed threshold grid.

    As torchmetrics' ``thresholds=`` mode: each row is counted in the bin of the
    grid its score falls in, so the state is two histograms of ``len(grid) + 1``
    counts (constant memory, summed across devices). The curve has one point per
    threshold, closed at (0, 0) and (1, 1) as scikit-learn's is, and its area is
    taken by the trapezoid rule. It **equals** ``sklearn.metrics.roc_auc_score``
    when every score lies on the grid (as float32), and approximates it
    otherwise (scores between two thresholds count as tied); a finer grid
    approximates better. NaN when the rows seen hold only one class.

    ``thresholds=None`` is the exact, unbinned area (torchmetrics' default):
    the state is every row (`Rows`), so it is for evaluation hooks only, and
    the value equals ``roc_auc_score`` on the float32 scores, ties included.

    Args:
        preds: scores ``[rows]``, higher meaning positive (probabilities, for the
            default grid: scores outside [0, 1] fall in its end bins).
        target: ``[rows]``, 1 for positive, anything else negative.
        thresholds: ``N`` (at least 2) evenly spaced values in [0, 1], an
            increasing sequence of values (a host array, not a traced one), or
            ``None``: exact.
    """

    def __init__(
        self, preds: Any, target: Any, *, thresholds: int | Sequence[float] | None = 200
    ) -> None:
        if isinstance(thresholds, jax.core.Tracer):
            raise ValueError(
                "AUROC: thresholds is a traced value; give an int or a host array "
                "(numpy or a list): the grid fixes the state's shape"
            )
        thresholds = _int(thresholds)
        if thresholds is None:
            self.thresholds: int | tuple[float, ...] | None = None
        elif isinstance(thresholds, int):
            if thresholds < 2:
                raise ValueError(f"AUROC(thresholds={thresholds}): give at least 2 thresholds")
            self.thresholds = thresholds
        else:
            grid = threshold_grid(thresholds)
            if grid.ndim != 1 or not grid.size or not np.all(np.diff(grid) > 0):
                raise ValueError(
                    f"AUROC: thresholds of shape {grid.shape} must be a strictly "
                    "increasing 1-D sequence (as float32)"
                )
            self.thresholds = tuple(float(t) for t in grid)
        super().__init__(preds, target)
        self.scores = self._vector("preds", self.preds).astype(jnp.float32)
        self.positive = self._vector("target", self.target) == 1

    def settings(self) -> dict[str, Hashable]:
        return {"thresholds": self.thresholds}

    @classmethod
    def empty(cls, thresholds: int | tuple[float, ...] | None = 200) -> RocBins | Rows:
        if thresholds is None:
            return _no_rows("auroc")
        bins = np.zeros(len(threshold_grid(thresholds)) + 1, np.int32)
        return RocBins(bins, bins.copy(), np.zeros((), np.int32))

    def state(self, mask: jax.Array) -> RocBins | Rows:
        if self.thresholds is None:
            return _rows(self.scores, self.positive, mask, "auroc")
        grid = jnp.asarray(threshold_grid(self.thresholds))
        bins = jnp.searchsorted(grid, self.scores, side="right")
        empty = jnp.zeros(grid.shape[0] + 1, jnp.int32)
        positives = empty.at[bins].add((mask & self.positive).astype(jnp.int32))
        negatives = empty.at[bins].add((mask & ~self.positive).astype(jnp.int32))
        return RocBins(positives, negatives, _count(mask))


def _no_rows(formula: str) -> Rows:
    empty = np.zeros(0, np.float32)
    return Rows(empty, empty, np.zeros(0, bool), np.zeros((), np.int32), formula)


def _rows(preds: jax.Array, target: jax.Array, mask: jax.Array, formula: str) -> Rows:
    return Rows(preds.astype(jnp.float32), target.astype(jnp.float32), mask, _count(mask), formula)


class _RankMetric(MetricObject):
    """A metric of every row at once: its state is `Rows` (evaluation hooks only)."""

    formula = ""

    def __init__(self, preds: Any, target: Any) -> None:
        super().__init__(preds, target)
        self.x = self._vector("preds", self.preds)
        self.y = self._vector("target", self.target)

    def settings(self) -> dict[str, Hashable]:
        return {}

    @classmethod
    def empty(cls) -> Rows:
        return _no_rows(cls.formula)

    def state(self, mask: jax.Array) -> Rows:
        return _rows(self.x, self.y, mask, self.formula)


class SpearmanCorrCoef(_RankMetric):
    """Spearman's rank correlation of two vectors, as ``scipy.stats.spearmanr``
    (ties get their average rank; NaN for a constant input). Every row is
    kept, so it is for evaluation hooks only; values are ranked as float32.

    Args:
        preds: ``[rows]``.
        target: ``[rows]``.
    """

    formula = "spearman"


class AveragePrecision(_RankMetric):
    """Average precision of binary targets, as
    ``sklearn.metrics.average_precision_score`` (exact: every row is kept, so
    for evaluation hooks only; NaN while no row is positive).

    Args:
        preds: scores ``[rows]``, higher meaning positive.
        target: ``[rows]``, 1 for positive, anything else negative.
    """

    formula = "average_precision"

    def __init__(self, preds: Any, target: Any) -> None:
        super().__init__(preds, target)
        self.y = self.y == 1
