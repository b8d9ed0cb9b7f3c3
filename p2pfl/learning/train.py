"""Local training and evaluation. Runs in a worker thread (never on the event loop).

Contract: the inputs are either a tensor ``x`` with its labels ``y`` (batches drawn by a
``torch.randperm`` seeded with ``seed``, evaluation in order), or a map-style torch Dataset
of ``(x, y)`` items read through a ``DataLoader`` (``training.batch_size``, shuffled by a
``torch.Generator`` seeded with ``seed``, ``num_workers=0``; ``y`` is then ignored), for data
too large to hold in memory (:attr:`p2pfl.learning.arrays.NodeData.train_set`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from p2pfl.config.schema import TrainingConfig
from p2pfl.learning.hooks import ExtraLoss, LossFn, StepHook
from p2pfl.learning.models import SplitModel

if TYPE_CHECKING:
    from p2pfl.learning.task import Task

TaskLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class TrainResult:
    loss: float  # mean total loss over the last epoch's batches
    ce_loss: float  # mean cross-entropy over the last epoch's batches
    steps: int
    seconds: float
    grad_sq_sum: float  # Σ over steps of ‖grad‖² (CriticalFL's signal)


def round_lr(cfg: TrainingConfig, round_no: int) -> float:
    """``lr · decay^(round-1)``: the learning rate of round ``round_no`` (1-based)."""
    return cfg.lr * (cfg.lr_decay ** max(0, round_no - 1))


def epoch_steps(n_samples: int, batch_size: int) -> int:
    """The optimizer steps of one epoch over ``n_samples`` in batches of ``batch_size``:
    ``⌈n / b⌉`` (the last batch may be short), at least 1."""
    return max(1, math.ceil(n_samples / max(1, batch_size)))


def round_epochs(cfg: TrainingConfig, steps_per_epoch: int) -> int:
    """The epochs of one round: ``training.epochs`` where the topology sets it, else the
    fewest whole epochs of ``steps_per_epoch`` steps that reach ``training.min_steps``,
    ``max(1, ⌈min_steps / steps_per_epoch⌉)``. A node with a few dozen rows (one batch) thus
    takes ``min_steps`` steps a round rather than one; a node with ``min_steps`` batches or
    more trains one epoch."""
    if cfg.epochs is not None:
        return cfg.epochs
    return max(1, math.ceil(cfg.min_steps / max(1, steps_per_epoch)))


def round_steps(cfg: TrainingConfig, steps_per_epoch: int) -> int:
    """The optimizer steps of one round: ``training.steps`` where the topology sets it, else
    :func:`round_epochs` whole epochs of ``steps_per_epoch``."""
    if cfg.steps is not None:
        return cfg.steps
    return round_epochs(cfg, steps_per_epoch) * steps_per_epoch


def catch_up_budget_s(previous_round_s: float, swarm_rounds: int) -> float | None:
    """The training time of a catch-up round at the swarm's pace (docs/wire.md, "Rounds and
    catch-up"): ``T / k``, the node's previous round having taken ``T = previous_round_s``
    while its neighbours ran ``k = swarm_rounds`` rounds: one of their rounds, as this node
    saw it. None (the whole round) when ``k ≤ 1``: the node is not slower than they are."""
    if swarm_rounds <= 1:
        return None
    return max(0.0, previous_round_s) / swarm_rounds


def epochs_for_steps(cfg: TrainingConfig, steps_per_epoch: int) -> int:
    """The epochs a round's steps reach into (the last one cut short under
    ``training.steps``): :func:`round_epochs` where ``steps`` is unset."""
    if cfg.steps is not None:
        return max(1, math.ceil(cfg.steps / max(1, steps_per_epoch)))
    return round_epochs(cfg, steps_per_epoch)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """The round's learning rate on every parameter group of a kept optimizer."""
    for group in opt.param_groups:
        group["lr"] = lr


def load_optimizer_machinery() -> None:
    """Build one throwaway optimizer: the first one a process builds makes ``torch.optim``
    import ``torch._dynamo`` (about 1.5 s of CPU here, in torch 2.x). A node calls this once
    it is ready, before its first round, so that the cost is not inside that round's
    training: there an emulated slower device (docs/design.md, "Emulated devices and
    links") would stretch it by ``1 / speed`` (15 s at 0.1)."""
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


def make_optimizer(model: torch.nn.Module, cfg: TrainingConfig, lr: float) -> torch.optim.Optimizer:
    if cfg.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(
        model.parameters(), lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
    )


def train_local(
    model: SplitModel,
    x: torch.Tensor | Dataset,
    y: torch.Tensor | None,
    cfg: TrainingConfig,
    lr: float,
    *,
    epochs: int | None = None,
    extra_loss: ExtraLoss | None = None,
    loss_fn: LossFn | None = None,
    step_hook: StepHook | None = None,
    seed: int = 0,
    device: torch.device | str = "cpu",
    optimizer: torch.optim.Optimizer | None = None,
    task_loss: TaskLoss | None = None,
    label_dtype: torch.dtype = torch.long,
    budget_s: float | None = None,
    time_scale: float = 1.0,
) -> TrainResult:
    """Train ``model`` in place for ``epochs`` (default :func:`round_epochs` of ``cfg`` over
    the data's :func:`epoch_steps`; under ``training.steps``, exactly that many steps) over
    ``(x, y)`` with cross-entropy plus ``extra_loss(model, xb, yb, logits)``, or with
    ``loss_fn(model, xb, yb) -> (total, task loss)`` in place of both when given;
    ``step_hook(model)`` runs after every optimizer step. A fresh optimizer is made each
    call (each round), as in the papers' simulations, unless ``optimizer`` is given (a node's
    kept one, ``training.optimizer_state: keep``), whose learning rate is set to ``lr``.
    Batches are shuffled by ``seed``. ``x`` may be a map-style Dataset of ``(x, y)`` items in
    place of the tensors (``y`` is then ignored): it is read batch by batch through a
    ``DataLoader``, its labels as ``label_dtype``. The losses are the mean over the last
    epoch's batches (under ``training.steps``, those of the last epoch begun).
    ``task_loss(outputs, y)``: the topology's loss (:mod:`p2pfl.learning.task`) in place of
    cross-entropy (``ce_loss`` is then that loss).

    ``budget_s`` (a :func:`catch_up_budget_s` round) ends the training before a step once
    the steps taken, timed here and multiplied by ``time_scale`` (an emulated device's
    ``1 / speed``), reach it; the first step is always taken. The losses are then those of
    the last epoch begun."""
    t0 = time.perf_counter()
    model.train()
    model.to(device)
    if optimizer is None:
        opt = make_optimizer(model, cfg, lr)
    else:
        opt = optimizer
        set_lr(opt, lr)
    gen = torch.Generator().manual_seed(seed)
    steps = 0
    grad_sq = 0.0
    total = ce_total = 0.0
    batches = 0
    n = len(y) if isinstance(x, torch.Tensor) and y is not None else len(x)  # type: ignore[arg-type]
    per_epoch = epoch_steps(n, cfg.batch_size)
    limit = cfg.steps if epochs is None else None  # None: whole epochs

    def spent() -> bool:
        return budget_s is not None and (time.perf_counter() - t0) * time_scale >= budget_s

    for _ in range(epochs or epochs_for_steps(cfg, per_epoch)):
        if steps and spent():
            break  # the budget ended with the last epoch: its losses are the ones kept
        total = ce_total = 0.0
        batches = 0
        for xb, yb in _train_batches(x, y, cfg.batch_size, gen, device, label_dtype):
            if (limit is not None and steps >= limit) or (steps and spent()):
                break
            opt.zero_grad(set_to_none=True)
            if loss_fn is not None:
                loss, ce = loss_fn(model, xb, yb)
            else:
                logits = model(xb)
                ce = F.cross_entropy(logits, yb) if task_loss is None else task_loss(logits, yb)
                loss = ce if extra_loss is None else ce + extra_loss(model, xb, yb, logits)
            loss.backward()
            grad_sq += float(
                sum(p.grad.pow(2).sum() for p in model.parameters() if p.grad is not None)
            )
            opt.step()
            if step_hook is not None:
                step_hook(model)
            steps += 1
            batches += 1
            total += loss.item()
            ce_total += ce.item()
    return TrainResult(
        loss=total / max(1, batches),
        ce_loss=ce_total / max(1, batches),
        steps=steps,
        seconds=time.perf_counter() - t0,
        grad_sq_sum=grad_sq,
    )


def _train_batches(
    x: torch.Tensor | Dataset,
    y: torch.Tensor | None,
    batch_size: int,
    gen: torch.Generator,
    device: torch.device | str,
    label_dtype: torch.dtype = torch.long,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of shuffled batches on ``device``: a ``randperm`` of the tensors' rows, or
    a ``DataLoader`` over a Dataset, both drawn from ``gen``."""
    if isinstance(x, torch.Tensor):
        assert y is not None
        n = len(y)
        perm = torch.randperm(n, generator=gen)
        for start in range(0, n, batch_size):
            idx = perm[start : start + batch_size]
            yield x[idx].to(device), y[idx].to(device)
        return
    loader = DataLoader(x, batch_size=batch_size, shuffle=True, generator=gen, num_workers=0)
    for xb, yb in loader:
        yield xb.to(device), torch.as_tensor(yb).to(device, label_dtype)


def _eval_batches(
    x: torch.Tensor | Dataset,
    y: torch.Tensor | None,
    batch_size: int,
    device: torch.device | str,
    label_dtype: torch.dtype = torch.long,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The samples in order, by batches on ``device``: slices of the tensors, or a
    ``DataLoader`` over a Dataset."""
    if isinstance(x, torch.Tensor):
        assert y is not None
        for start in range(0, len(y), batch_size):
            yield x[start : start + batch_size].to(device), y[start : start + batch_size].to(device)
        return
    for xb, yb in DataLoader(x, batch_size=batch_size, shuffle=False, num_workers=0):
        yield xb.to(device), torch.as_tensor(yb).to(device, label_dtype)


@torch.no_grad()
def evaluate(
    model: SplitModel,
    x: torch.Tensor | Dataset,
    y: torch.Tensor | None,
    batch_size: int = 500,
    device: torch.device | str = "cpu",
) -> tuple[float, float]:
    """``(accuracy, mean cross-entropy)`` of ``model`` on ``(x, y)``, or on a map-style
    Dataset ``x`` of ``(x, y)`` items (``y`` ignored), in order; NaNs when there is none."""
    n = len(x)  # type: ignore[arg-type]  # rows of the tensor, items of the Dataset
    if n == 0:
        return float("nan"), float("nan")
    model.eval()
    correct = 0
    loss = 0.0
    for xb, yb in _eval_batches(x, y, batch_size, device):
        logits = model(xb)
        loss += float(F.cross_entropy(logits, yb, reduction="sum"))
        correct += int((logits.argmax(dim=1) == yb).sum())
    model.train()
    return correct / n, loss / n


@torch.no_grad()
def evaluate_task(
    model: SplitModel,
    x: torch.Tensor | Dataset,
    y: torch.Tensor | None,
    task: Task,
    batch_size: int = 500,
    device: torch.device | str = "cpu",
) -> tuple[float, dict[str, float]]:
    """``(loss, metrics)`` of ``model`` on the whole of ``(x, y)`` (or a Dataset ``x``) under
    ``task``: its loss over every sample at once (a loss that couples samples, such as
    Cox's partial likelihood, is the whole split's) and :meth:`Task.score`; NaNs when there
    is no sample."""
    n = len(x)  # type: ignore[arg-type]
    if n == 0:
        return float("nan"), {m: float("nan") for m in task.metrics}
    model.eval()
    dtype = torch.long if task.targets == "classes" else torch.float32
    outs, labels = [], []
    for xb, yb in _eval_batches(x, y, batch_size, device, dtype):
        outs.append(model(xb).cpu())
        labels.append(yb.cpu())
    model.train()
    outputs, truth = torch.cat(outs), torch.cat(labels)
    loss = float(task.loss(outputs, truth))
    return loss, task.score(outputs, truth)
