"""Adaptive server optimizers (Reddi et al., "Adaptive Federated Optimization", ICLR 2021):
FedAdam, FedYogi and FedAdagrad, as pure functions over states. No I/O; the method that
uses them is :class:`~p2pfl.algorithms.fedavg.FedAvg` (``algorithm.params.server_opt``,
docs/algorithms.md, "FedAvg").

One server step from the current global model ``x`` and the round's aggregate ``x̄`` (the
weighted mean of the uploads), at step ``t = 1, 2, …``:

- ``Δ = x̄ − x``; ``m ← β1·m + (1 − β1)·Δ`` (``m`` starts at zero);
- FedAdam: ``v ← β2·v + (1 − β2)·Δ²``, and the step is taken with the bias-corrected rate
  ``η_t = η·√(1 − β2^(t+1)) / (1 − β1^(t+1))``;
- FedYogi: ``v ← v − (1 − β2)·Δ²·sign(v − Δ²)``, rate ``η``;
- FedAdagrad: ``v ← v + Δ²``, rate ``η`` (``β1`` 0 by default, so ``m = Δ``);
- ``x ← x + η_t·m / (√v + τ)``; ``v`` starts at zero for each.

**Reading** (as Flower 1.28's ``FedAdam``, ``FedYogi`` and ``FedAdagrad`` strategies compute
it, which the tests check against): the bias correction uses ``t + 1`` where ``t`` is the
server round counted from 1, and Yogi's and Adagrad's rates are not bias-corrected. The
defaults are Flower's: FedAdam η 0.1, β1 0.9, β2 0.99, τ 1e-9; FedYogi η 0.01, β1 0.9,
β2 0.99, τ 1e-3; FedAdagrad η 0.1, β1 0, τ 1e-9.

Arithmetic is in float64 per tensor and the new ``x`` is cast back to each tensor's dtype;
``m`` and ``v`` stay float64. Non-floating tensors (counters) are the aggregate's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

State = dict[str, torch.Tensor]
ServerOptKind = Literal["adam", "yogi", "adagrad"]
SERVER_OPTS: tuple[str, ...] = ("adam", "yogi", "adagrad")

DEFAULTS: dict[str, dict[str, float]] = {
    "adam": {"lr": 0.1, "beta1": 0.9, "beta2": 0.99, "tau": 1e-9},
    "yogi": {"lr": 0.01, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3},
    "adagrad": {"lr": 0.1, "beta1": 0.0, "beta2": 0.0, "tau": 1e-9},
}
"""Each optimizer's knobs where the topology sets none (Flower's defaults)."""


@dataclass(frozen=True)
class ServerOptSettings:
    """One server optimizer's kind and knobs (η ``lr``, ``beta1``, ``beta2``, ``tau``)."""

    kind: ServerOptKind
    lr: float
    beta1: float
    beta2: float
    tau: float

    @classmethod
    def of(cls, kind: str, **given: float | None) -> ServerOptSettings:
        """``kind``'s settings: each knob given (not None) or its default (:data:`DEFAULTS`);
        ``ValueError`` for an unknown kind."""
        if kind not in DEFAULTS:
            raise ValueError(f"server_opt {kind!r} is unknown; expected one of {SERVER_OPTS}")
        knobs = {k: given[k] if given.get(k) is not None else v for k, v in DEFAULTS[kind].items()}
        return cls(kind, **knobs)  # type: ignore[arg-type]


@dataclass
class ServerOptState:
    """What a server optimizer keeps between steps: the first and second moments (float64,
    one per floating tensor; empty before the first step)."""

    m: dict[str, torch.Tensor] = field(default_factory=dict)
    v: dict[str, torch.Tensor] = field(default_factory=dict)


def server_step(
    settings: ServerOptSettings,
    x: Mapping[str, torch.Tensor],
    aggregate: Mapping[str, torch.Tensor],
    state: ServerOptState,
    t: int,
) -> tuple[State, ServerOptState]:
    """One step of ``settings.kind`` at server step ``t`` (1 for the first) from the global
    model ``x`` towards the round's ``aggregate`` (same keys, shapes; see the module's
    docstring): the new global model and the new moments (``state`` is not changed).
    ``ValueError`` when the keys or shapes differ or ``t < 1``."""
    if t < 1:
        raise ValueError(f"server_step: step {t} must be >= 1")
    if set(x) != set(aggregate):
        raise ValueError("server_step: the aggregate's tensors are not the model's")
    b1, b2, tau = settings.beta1, settings.beta2, settings.tau
    rate = settings.lr
    if settings.kind == "adam":
        rate = settings.lr * math.sqrt(1 - b2 ** (t + 1)) / (1 - b1 ** (t + 1))
    new_x: State = {}
    new = ServerOptState()
    for k, agg in aggregate.items():
        if not torch.is_floating_point(agg):
            new_x[k] = agg.detach().clone()
            continue
        if x[k].shape != agg.shape:
            raise ValueError(
                f"server_step: {k!r} has shape {tuple(agg.shape)}, not {tuple(x[k].shape)}"
            )
        x64 = x[k].detach().to(torch.float64)
        delta = agg.detach().to(device=x64.device, dtype=torch.float64) - x64
        m = state.m.get(k)
        v = state.v.get(k)
        m = torch.zeros_like(delta) if m is None else m.to(delta.device)
        v = torch.zeros_like(delta) if v is None else v.to(delta.device)
        m = b1 * m + (1 - b1) * delta
        sq = delta * delta
        if settings.kind == "adam":
            v = b2 * v + (1 - b2) * sq
        elif settings.kind == "yogi":
            v = v - (1 - b2) * sq * torch.sign(v - sq)
        else:  # adagrad
            v = v + sq
        new.m[k], new.v[k] = m, v
        new_x[k] = (x64 + rate * m / (torch.sqrt(v) + tau)).to(x[k].dtype)
    return new_x, new
