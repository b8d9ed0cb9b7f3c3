"""Score kept models on a site's own held-out data: :func:`held_out_scorer` (the promotion
gate's scoring function, docs/design.md, "A site's own models").

The held-out data is the test split of a run's node as the run built it (its
``config.yaml``: the site's data binding today). Each model is scored on the same rows
through its own ``input_spec``: a model trained on older data normalised its inputs with
that data's statistics, so the rows are taken back to raw values with the data's
statistics and normalised again with the model's (:func:`renormalize`), as ``p2pfl
predict`` prepares new data for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from p2pfl.check.load import load_topology
from p2pfl.config.learning_schema import CLASS_METRICS
from p2pfl.export.model import load_model_with_info
from p2pfl.learning.artifacts import ExportError
from p2pfl.learning.data import load_node_data
from p2pfl.learning.task import task_of

BATCH = 512


def renormalize(
    x: torch.Tensor, data_spec: dict[str, Any], model_spec: dict[str, Any]
) -> torch.Tensor:
    """``x`` (inputs normalised by ``data_spec``: ``(raw - mean) / std`` per feature of a
    tabular spec, per channel of an image spec) normalised by ``model_spec`` instead. Specs
    of another kind, or equal statistics: ``x`` itself. Raises :class:`ExportError` when the
    model reads other features or another image layout than the data gives. A model with
    no ``input_spec`` takes the inputs as they are."""
    if not model_spec:
        return x
    if data_spec.get("kind") != model_spec.get("kind"):
        raise ExportError(
            f"the model was trained on {model_spec.get('kind')!r} inputs, "
            f"the held-out data is {data_spec.get('kind')!r}"
        )
    kind = data_spec.get("kind")
    if kind not in ("tabular", "image"):
        return x
    for key in ("features", "channels", "size"):
        if data_spec.get(key) != model_spec.get(key):
            raise ExportError(
                f"the model reads {key} {model_spec.get(key)!r}, the held-out data has "
                f"{data_spec.get(key)!r}"
            )
    n = x.shape[1]
    mean_d, std_d = _stats(data_spec, n), _stats(data_spec, n, "std")
    mean_m, std_m = _stats(model_spec, n), _stats(model_spec, n, "std")
    if np.array_equal(mean_d, mean_m) and np.array_equal(std_d, std_m):
        return x
    shape = (1, n) + (1,) * (x.dim() - 2)
    raw = x.double() * torch.as_tensor(std_d).view(shape) + torch.as_tensor(mean_d).view(shape)
    out = (raw - torch.as_tensor(mean_m).view(shape)) / torch.as_tensor(std_m).view(shape)
    return out.to(x.dtype)


def _stats(spec: dict[str, Any], n: int, field: str = "mean") -> np.ndarray:
    default = 0.0 if field == "mean" else 1.0
    values = spec.get(field)
    vec = np.full(n, default) if values is None else np.asarray(values, dtype=np.float64).ravel()
    if len(vec) == 1:
        vec = np.full(n, float(vec[0]))
    if len(vec) != n:
        raise ExportError(f"input_spec.{field} does not have {n} values")
    if field == "std":
        vec = np.where(vec > 0, vec, 1.0)  # a constant feature: as predict takes it
    return vec


def held_out_scorer(
    run_dir: str | Path, node_id: str, metric: str = "accuracy"
) -> Callable[[Path], float]:
    """A function that scores a kept model (its run directory) by ``metric``
    (``promote.metric``: its accuracy by default) on node ``node_id``'s test split in
    ``run_dir`` (read once, here), through the run's task (:mod:`p2pfl.learning.task`); an
    :class:`ExportError` when the task does not report that metric (``mae`` of classes)."""
    run = Path(run_dir)
    cfg = load_topology(run / "config.yaml")
    data = load_node_data(cfg.dataset, cfg.node_ids, node_id, cfg.seed)
    if data.test_x is not None:
        x = data.test_x
    elif data.test_set is not None and len(data.test_set) > 0:  # type: ignore[arg-type]
        x = torch.stack([data.test_set[i][0] for i in range(len(data.test_set))])  # type: ignore[arg-type]
    else:
        raise ExportError(f"{run}: node {node_id!r} holds no held-out data")
    y = data.test_y
    if len(y) == 0:
        raise ExportError(f"{run}: node {node_id!r} holds no held-out data")

    task = task_of(cfg)
    if metric != "accuracy" or task.targets != "classes":
        if (metric in CLASS_METRICS) != (task.targets == "classes"):
            raise ExportError(
                f"{run}: promote.metric {metric!r} does not score this run's labels "
                f"({task.targets}, training.loss {task.loss_name})"
            )
        task = replace(task, metrics=(metric,), user_metrics=())

    def score(model_dir: Path) -> float:
        module, info = load_model_with_info(model_dir, node_id)
        inputs = renormalize(x, data.input_spec or {}, info.get("input_spec") or {})
        with torch.no_grad():
            outputs = torch.cat(
                [module(inputs[i : i + BATCH].float()) for i in range(0, len(y), BATCH)]
            )
        if metric == "accuracy" and task.loss_name == "cross_entropy":  # argmax of the logits
            return int((outputs.argmax(1) == y).sum()) / len(y)
        return task.score(outputs, y)[metric]

    return score
