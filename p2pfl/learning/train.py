"""Local training and evaluation. Runs in a worker thread (never on the event loop)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from p2pfl.algorithms.base import ExtraLoss, LossFn, StepHook
from p2pfl.config.schema import TrainingConfig
from p2pfl.learning.models import SplitModel


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


def make_optimizer(model: torch.nn.Module, cfg: TrainingConfig, lr: float) -> torch.optim.Optimizer:
    if cfg.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(
        model.parameters(), lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
    )


def train_local(
    model: SplitModel,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: TrainingConfig,
    lr: float,
    *,
    epochs: int | None = None,
    extra_loss: ExtraLoss | None = None,
    loss_fn: LossFn | None = None,
    step_hook: StepHook | None = None,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> TrainResult:
    """Train ``model`` in place for ``epochs`` (default ``cfg.epochs``) over ``(x, y)`` with
    cross-entropy plus ``extra_loss(model, xb, yb, logits)``, or with ``loss_fn(model, xb, yb)
    -> (total, task loss)`` in place of both when given; ``step_hook(model)`` runs after every
    optimizer step. A fresh optimizer is made each
    call (each round), as in the papers' simulations. Batches are shuffled by ``seed``."""
    t0 = time.perf_counter()
    model.train()
    model.to(device)
    opt = make_optimizer(model, cfg, lr)
    gen = torch.Generator().manual_seed(seed)
    n = len(y)
    steps = 0
    grad_sq = 0.0
    total = ce_total = 0.0
    batches = 0
    for _ in range(epochs or cfg.epochs):
        perm = torch.randperm(n, generator=gen)
        total = ce_total = 0.0
        batches = 0
        for start in range(0, n, cfg.batch_size):
            idx = perm[start : start + cfg.batch_size]
            xb, yb = x[idx].to(device), y[idx].to(device)
            opt.zero_grad(set_to_none=True)
            if loss_fn is not None:
                loss, ce = loss_fn(model, xb, yb)
            else:
                logits = model(xb)
                ce = F.cross_entropy(logits, yb)
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


@torch.no_grad()
def evaluate(
    model: SplitModel,
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int = 500,
    device: torch.device | str = "cpu",
) -> tuple[float, float]:
    """``(accuracy, mean cross-entropy)`` of ``model`` on ``(x, y)``."""
    if len(y) == 0:
        return float("nan"), float("nan")
    model.eval()
    correct = 0
    loss = 0.0
    for start in range(0, len(y), batch_size):
        xb, yb = x[start : start + batch_size].to(device), y[start : start + batch_size].to(device)
        logits = model(xb)
        loss += float(F.cross_entropy(logits, yb, reduction="sum"))
        correct += int((logits.argmax(dim=1) == yb).sum())
    model.train()
    return correct / len(y), loss / len(y)
