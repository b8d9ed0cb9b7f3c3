"""The hospitals' own survival model: a Cox proportional-hazards risk score (one
``nn.Linear`` over the 39 features, FLamby's Fed-TCGA-BRCA baseline) and its loss, the
negative Cox partial log-likelihood as FLamby's ``BaselineLoss`` computes it: over the
batch, each observed event's log-risk against its risk set, averaged over the batch's
samples (censored ones included)."""

from __future__ import annotations

import math

import torch
from torch import nn


def risk_score(num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    """``num_classes`` is the outputs a row p2pfl asks for: 1, the log-hazard ratio."""
    return nn.Linear(math.prod(input_shape), num_classes)


def cox_loss(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``(1/n) Σ_{i: event} (log Σ_{j: t_j ≥ t_i} exp r_j − r_i)`` over a batch of ``n``
    rows, ``labels = [event, time]`` a row (a batch without an event: 0)."""
    event, time = labels[:, 0], labels[:, 1]
    order = torch.argsort(time, descending=True, stable=True)
    risk, event = outputs.reshape(-1)[order], event[order]
    at_risk = torch.logcumsumexp(risk, dim=0)  # log Σ exp r_j over the rows before, t_j ≥ t_i
    return ((at_risk - risk) * event).mean()
