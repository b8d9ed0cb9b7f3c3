"""A topology's task: the loss a node trains with, what its model outputs, and the metrics
every round's evaluation reports (``training.loss``, ``evaluation.metrics``,
``dataset.targets``).

* ``cross_entropy`` (the default): one logit a class, softmax cross-entropy on class
  indices; the model outputs ``(B, C)``.
* ``bce``: one logit, two classes; binary cross-entropy of ``sigmoid(z)`` against the label
  (class index 1 is the positive class); the model outputs ``(B, 1)``.
* ``mse``, ``mae``: values; the mean squared or absolute error; the model outputs one value
  a label column, ``(B, k)`` (``(B, 1)`` for one column, whose labels are ``(B,)``).
* ``package.module:function``: the user's ``function(outputs, labels) -> scalar tensor``,
  on class indices (``dataset.classes`` given) or values (``dataset.label`` one column or a
  list, e.g. ``[event, time]``); the model outputs ``(B, 1)`` unless it says otherwise.

The factory of a user's model is called with ``num_classes`` = the outputs a row
(:meth:`Task.outputs`): C, or 1 for ``bce``, or the value columns.

Metrics are computed over the whole test split at once (``evaluate``): ``accuracy``,
``balanced_accuracy`` (the mean recall over the classes present), ``auc`` (ROC AUC of the
positive class; macro one-vs-rest for more classes, over the classes present with both
sides), ``f1`` (of the positive class; macro for more classes), ``mae``, ``rmse``, and
``c_index`` (Harrell's concordance of a risk score, higher is earlier, against labels
``[event, time]``: FLamby's Fed-TCGA-BRCA convention), or a user's
``function(outputs, labels) -> float``. A metric that a test split cannot define (AUC with
one class) is NaN, recorded as None.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from p2pfl.config.schema import TopologyConfig

LossFunction = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
MetricFunction = Callable[[torch.Tensor, torch.Tensor], float]


def cross_entropy(outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, y)


def bce(outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(outputs.reshape(-1), y.to(outputs.dtype).reshape(-1))


def _as_outputs(outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Value predictions shaped as the labels (``(B, 1)`` outputs for ``(B,)`` labels)."""
    return outputs.reshape(y.shape) if outputs.numel() == y.numel() else outputs


def mse(outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(_as_outputs(outputs, y), y.to(outputs.dtype))


def mae(outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.l1_loss(_as_outputs(outputs, y), y.to(outputs.dtype))


LOSSES: dict[str, LossFunction] = {
    "cross_entropy": cross_entropy,
    "bce": bce,
    "mse": mse,
    "mae": mae,
}


# ----------------------------------------------------------------------------- metrics


def class_probabilities(outputs: torch.Tensor) -> torch.Tensor:
    """``(N, C)`` class probabilities of a model's ``(N, C)`` outputs: the softmax of ``C``
    logits, or ``[1 − p, p]`` with ``p = sigmoid(z)`` for one logit (class 1 the positive
    one). The one reading of outputs as classes of the metrics, ``p2pfl predict`` and
    serving."""
    if outputs.shape[-1] == 1:
        p = torch.sigmoid(outputs)
        return torch.cat([1 - p, p], dim=-1)
    return torch.softmax(outputs, dim=-1)


def class_scores(outputs: torch.Tensor) -> np.ndarray:
    """:func:`class_probabilities` in float64, as numpy (what the class metrics read)."""
    return class_probabilities(outputs.detach().double()).numpy()


def accuracy(probs: np.ndarray, y: np.ndarray) -> float:
    return float((probs.argmax(axis=1) == y).mean())


def balanced_accuracy(probs: np.ndarray, y: np.ndarray) -> float:
    pred = probs.argmax(axis=1)
    recalls = [float((pred[y == c] == c).mean()) for c in np.unique(y)]
    return float(np.mean(recalls))


def binary_auc(score: np.ndarray, positive: np.ndarray) -> float:
    """ROC AUC of ``score`` for the ``positive`` mask (ties count a half: the Mann–Whitney
    statistic); NaN without both sides."""
    from scipy.stats import rankdata

    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return math.nan
    ranks = rankdata(score)
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def auc(probs: np.ndarray, y: np.ndarray) -> float:
    if probs.shape[1] == 2:
        return binary_auc(probs[:, 1], y == 1)
    per_class = [binary_auc(probs[:, c], y == c) for c in np.unique(y)]
    defined = [a for a in per_class if not math.isnan(a)]
    return float(np.mean(defined)) if defined else math.nan


def _f1(pred: np.ndarray, y: np.ndarray, c: int) -> float:
    tp = int(((pred == c) & (y == c)).sum())
    fp = int(((pred == c) & (y != c)).sum())
    fn = int(((pred != c) & (y == c)).sum())
    return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0


def f1(probs: np.ndarray, y: np.ndarray) -> float:
    pred = probs.argmax(axis=1)
    if probs.shape[1] == 2:
        return _f1(pred, y, 1)
    return float(np.mean([_f1(pred, y, c) for c in np.unique(np.concatenate([pred, y]))]))


def values_of(outputs: torch.Tensor, y: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Predictions and labels as float64 arrays of one shape."""
    pred = _as_outputs(outputs.detach(), y).double().numpy()
    return pred, y.double().numpy()


def mae_metric(outputs: torch.Tensor, y: torch.Tensor) -> float:
    pred, true = values_of(outputs, y)
    return float(np.abs(pred - true).mean())


def rmse(outputs: torch.Tensor, y: torch.Tensor) -> float:
    pred, true = values_of(outputs, y)
    return float(np.sqrt(((pred - true) ** 2).mean()))


def concordance_index(risk: np.ndarray, event: np.ndarray, time: np.ndarray) -> float:
    """Harrell's C: over the pairs ``(i, j)`` with an observed event at ``t_i < t_j``, the
    share whose risks are ordered ``r_i > r_j`` (ties count a half); NaN without such a
    pair."""
    risk, event, time = (np.asarray(a, dtype=np.float64).reshape(-1) for a in (risk, event, time))
    concordant = 0.0
    pairs = 0
    for i in np.flatnonzero(event > 0):
        later = time > time[i]
        n = int(later.sum())
        if n == 0:
            continue
        pairs += n
        concordant += float((risk[i] > risk[later]).sum()) + 0.5 * float(
            (risk[i] == risk[later]).sum()
        )
    return concordant / pairs if pairs else math.nan


def c_index(outputs: torch.Tensor, y: torch.Tensor) -> float:
    labels = y.detach().double().numpy()
    if labels.ndim != 2 or labels.shape[1] != 2:
        raise ValueError("c_index scores labels [event, time] (two label columns)")
    risk = outputs.detach().double().numpy().reshape(len(labels), -1)[:, 0]
    return concordance_index(risk, labels[:, 0], labels[:, 1])


CLASS_METRIC_FUNCTIONS: dict[str, Callable[[np.ndarray, np.ndarray], float]] = {
    "accuracy": accuracy,
    "balanced_accuracy": balanced_accuracy,
    "auc": auc,
    "f1": f1,
}
VALUE_METRIC_FUNCTIONS: dict[str, MetricFunction] = {
    "mae": mae_metric,
    "rmse": rmse,
    "c_index": c_index,
}


def record_field(metric: str) -> str:
    """A metric's field in a round record: ``test_acc`` for ``accuracy``, ``test_<name>``
    otherwise (a user's ``package.module:function``: ``test_<function>``)."""
    if metric == "accuracy":
        return "test_acc"
    return "test_" + metric.rsplit(":", 1)[-1].rsplit(".", 1)[-1]


# ----------------------------------------------------------------------------- the task


@dataclass(frozen=True)
class Task:
    """One topology's task: its loss, its labels and its metrics (module docstring)."""

    loss_name: str
    loss: LossFunction
    targets: str  # "classes" or "values"
    metrics: tuple[str, ...]
    value_columns: int = 1  # the label columns of values
    user_metrics: tuple[tuple[str, MetricFunction], ...] = ()

    @property
    def is_default(self) -> bool:
        """Softmax cross-entropy scored by accuracy: the records say what they always did."""
        return self.loss_name == "cross_entropy" and self.metrics == ("accuracy",)

    def outputs(self, num_classes: int) -> int:
        """The outputs a row the model gives (:func:`outputs_for`)."""
        return outputs_for(self.loss_name, self.targets, self.value_columns, num_classes)

    def output_problem(self, shape: tuple[int, ...], num_classes: int) -> str | None:
        """Why outputs of ``shape`` (for a batch of 2) cannot train with this loss; None when
        they can."""
        want = self.outputs(num_classes)
        user_on_classes = self.loss_name not in LOSSES and self.targets == "classes"
        if user_on_classes or tuple(shape) == (2, want):  # a user's class loss reads any
            return None
        what = {
            "cross_entropy": f"{want} logits a row, one a class",
            "bce": "one logit a row (two classes)",
        }.get(self.loss_name, f"{want} value(s) a row")
        hint = ""
        if self.loss_name == "cross_entropy" and tuple(shape) == (2, 1) and num_classes == 2:
            hint = " (training.loss: bce takes one logit)"
        return (
            f"{self.loss_name} takes {what}; the model outputs {tuple(shape)} for a batch of 2"
            + hint
        )

    def score(self, outputs: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        """Every metric of the task on the whole test split (``outputs`` in order with
        ``y``), NaN where a split cannot define one."""
        out: dict[str, float] = {}
        probs = class_scores(outputs) if self.targets == "classes" else None
        labels = y.detach().numpy() if self.targets == "classes" else None
        for name in self.metrics:
            if name in CLASS_METRIC_FUNCTIONS:
                assert probs is not None and labels is not None
                out[name] = CLASS_METRIC_FUNCTIONS[name](probs, labels)
            elif name in VALUE_METRIC_FUNCTIONS:
                out[name] = VALUE_METRIC_FUNCTIONS[name](outputs, y)
        for name, fn in self.user_metrics:
            out[name] = float(fn(outputs.detach(), y.detach()))
        return out


def outputs_for(loss: str, targets: str, value_columns: int, num_classes: int) -> int:
    """The outputs a row of a model trained with ``loss`` on ``targets``: ``C`` for
    ``cross_entropy`` and a user's loss on classes, 1 for ``bce`` and a user's loss on
    values, the value columns for ``mse`` and ``mae``."""
    if loss == "bce":
        return 1
    if targets == "classes":
        return num_classes
    return value_columns if loss in ("mse", "mae") else 1


def model_outputs(cfg: TopologyConfig, num_classes: int) -> int:
    """The outputs a row of the topology's model (what a user's factory is called with as
    ``num_classes``; :func:`outputs_for`)."""
    label = cfg.dataset.label
    columns = len(label) if isinstance(label, list) else 1
    targets = cfg.dataset.targets or cfg.default_targets
    return outputs_for(cfg.training.loss, targets, columns, num_classes)


def default_metrics(loss: str, targets: str) -> tuple[str, ...]:
    """``evaluation.metrics`` unset: ``accuracy`` for classes, ``mae`` and ``rmse`` for the
    built-in value losses, none for a user's loss on values (its loss alone)."""
    if targets == "classes":
        return ("accuracy",)
    return ("mae", "rmse") if loss in ("mse", "mae") else ()


def task_of(cfg: TopologyConfig) -> Task:
    """The topology's :class:`Task`, the user's loss and metrics imported (``UserCodeError``
    naming the field when they do not import)."""
    from p2pfl.learning.user_code import import_object

    name = cfg.training.loss
    targets = cfg.dataset.targets or cfg.default_targets
    loss = LOSSES.get(name) or import_object(name, "training.loss")
    metrics = tuple(cfg.evaluation.metrics or default_metrics(name, targets))
    user = tuple((m, import_object(m, "evaluation.metrics")) for m in metrics if ":" in m)
    label = cfg.dataset.label
    columns = len(label) if isinstance(label, list) else 1
    return Task(name, loss, targets, metrics, columns, user)


__all__ = ["LOSSES", "Task", "concordance_index", "record_field", "task_of"]
