"""The hospitals' own survival model: a Cox proportional-hazards risk score (one
``nn.Linear`` over the 39 features, FLamby's Fed-TCGA-BRCA baseline) and its loss, the
negative Cox partial log-likelihood (Breslow's handling of tied times)."""

from __future__ import annotations

import math

import torch
from torch import nn


def risk_score(num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    """``num_classes`` is the outputs a row p2pfl asks for: 1, the log-hazard ratio."""
    return nn.Linear(math.prod(input_shape), num_classes)


def cox_loss(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``−(1/d) Σ_{i: event} (r_i − log Σ_{j: t_j ≥ t_i} exp r_j)`` over the batch, with
    ``labels = [event, time]`` a row and ``d`` the observed events (0 for a batch without
    one: it carries no partial likelihood)."""
    event, time = labels[:, 0], labels[:, 1]
    order = torch.argsort(time, descending=True)
    risk, event = outputs.reshape(-1)[order], event[order]
    at_risk = torch.logcumsumexp(risk, dim=0)  # log Σ exp r_j over t_j ≥ t_i
    return -((risk - at_risk) * event).sum() / event.sum().clamp_min(1.0)
