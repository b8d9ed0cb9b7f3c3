"""FedAvg: the sample-weighted mean of the participants' whole models.

Implements docs/algorithms.md, "FedAvg": the round's aggregator computes
``w ← Σ n_i w_i / Σ n_i`` over the uploads that arrived and sends it to all. With
``mu > 0`` it is FedProx (Li et al., 2020): each node trains on its loss plus
``(μ/2)·‖w − w_t‖²`` (:func:`proximal_term`), ``w_t`` the model it received; the server
rule is the same mean.

- The mean is :func:`~p2pfl.learning.state.weighted_mean` over the uploads in sorted node
  order (docs/algorithms.md, "Shared aggregation"): floating tensors are accumulated in
  float64 and cast back to their own dtype.
- **Reading** (non-floating tensors, e.g. BatchNorm's ``num_batches_tracked``): a mean of
  counters is meaningless, so they are taken from the first upload in sorted node order (the
  shared rule). Until the shared mean they came from the upload with the largest weight;
  the floating results are unchanged to the bit.
- The one global model is both :attr:`Aggregate.common` and every uploader's entry in
  :attr:`Aggregate.results` (the same object, so the driver packs it once).

With ``server_opt`` (FedAdam, FedYogi, FedAdagrad: Reddi et al., 2021;
:mod:`p2pfl.learning.server_opt`, docs/algorithms.md, "FedAvg") the round's
mean is the server optimizer's target, ``Δ = x̄ − x_t``, and the new global model is its
step. **Reading** (where the step is taken): the moments ``m``, ``v`` are model-sized, too
big for the announcement that carries a rotating aggregator's server state to the next
one, and a result the aggregator stepped could not be audited from the uploads alone. So
the aggregator serves the mean as FedAvg does, its announced server state counts the steps
(``opt_t``), and every member (the aggregator too) takes the same step from the same mean
with its own copy of ``x_t``, ``m`` and ``v``: every member that applied every round holds
the model a central server would have sent. A member that missed a round's result steps
from its own older copy until it catches up (as its model does under plain FedAvg).

:func:`fedavg_aggregate` is reused by FedPer and CriticalFL.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from p2pfl.algorithms.base import (
    Aggregate,
    AlgorithmContext,
    CentralizedAlgorithm,
    ExtraLoss,
    State,
    Upload,
    check_keys,
    check_state,
    check_tensor,
    peer_state_mismatch,
    register,
)
from p2pfl.algorithms.cards.fedavg import CARD
from p2pfl.learning.defence import Defence
from p2pfl.learning.server_opt import ServerOptSettings, ServerOptState, server_step
from p2pfl.learning.state import part_keys, weighted_mean

# ----------------------------------------------------------------------------- pure math


def fedavg_aggregate(
    uploads: dict[str, Upload],
    part: str = "all",
    defence: Defence | None = None,
    own: str | None = None,
) -> tuple[State, int]:
    """The sample-weighted mean of the ``part`` (``g``, ``h``, ``all``) of every upload, in
    sorted node order, and the total sample count of the uploads it kept. With ``defence``
    (the aggregator's, docs/design.md, "Robust aggregation") its rule replaces the mean,
    around ``own``'s upload when the aggregator uploaded one. Raises ``ValueError`` as
    :func:`~p2pfl.learning.state.weighted_mean` does (no uploads, mismatched states)."""
    peers = sorted(uploads)
    states = []
    for p in peers:
        state = uploads[p].state
        states.append({k: state[k] for k in part_keys(list(state), part)})
    weights = [float(uploads[p].n) for p in peers]
    if defence is None:
        return weighted_mean(states, weights), int(sum(uploads[p].n for p in peers))
    mine = peers.index(own) if own in uploads else None
    glob = defence.combine(states, weights, who=peers, own=mine)
    kept = [p for p in peers if p not in defence.rejected]
    return glob, int(sum(uploads[p].n for p in kept))


def proximal_term(anchor: dict[str, torch.Tensor], mu: float) -> ExtraLoss:
    """FedProx's ``(μ/2)·Σ ‖w − w_t‖²`` over the parameters named in ``anchor`` (``w_t``),
    an extra loss term (its gradient ``μ·(w − w_t)``)."""

    def prox(model: Any, xb: torch.Tensor, yb: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        terms = [(p - anchor[n]).pow(2).sum() for n, p in model.named_parameters() if n in anchor]
        return 0.5 * mu * torch.stack(terms).sum()

    return prox


def check_received(model_keys: list[str], received: Any, model_state: State, part: str) -> None:
    """Raise ``ValueError`` unless ``received`` is a map holding exactly the model's ``part``
    keys, each a tensor of the model's shape and dtype (what a peer sent is untrusted; the
    server rules keep every tensor's dtype, so an honest result always has the model's)."""
    template = {k: model_state[k] for k in part_keys(model_keys, part)}
    why = peer_state_mismatch(received, template)
    if why is not None:
        raise ValueError(f"received state does not match part {part!r}: {why}")


def _step_of(server: Any, *, allow_zero: bool) -> int:
    """The server-optimizer step ``opt_t`` of an announced server state (0 before the first
    round when ``allow_zero``); ``ValueError`` when it is missing or not a count."""
    t = server.get("opt_t", 0 if allow_zero else None) if isinstance(server, dict) else None
    if not isinstance(t, int) or isinstance(t, bool) or t < (0 if allow_zero else 1):
        raise ValueError(f"server state: opt_t {t!r} is not a step count")
    return t


# ----------------------------------------------------------------------------- the method


@register
class FedAvg(CentralizedAlgorithm):
    name = CARD.name
    shares = CARD.shares
    Params = CARD.Params
    upload_part = "all"

    def __init__(self, params: dict[str, Any], ctx: AlgorithmContext):
        super().__init__(params, ctx)
        kind = getattr(self.params, "server_opt", None)  # CriticalFL's knobs lack it
        self._server_opt: ServerOptSettings | None = None
        if kind is not None:
            p = self.params
            self._server_opt = ServerOptSettings.of(
                kind, lr=p.server_lr, beta1=p.beta1, beta2=p.beta2, tau=p.tau
            )
        # server_opt: the global model x_t this member last stepped to (the initial model's
        # part at first) and the moments, a copy of what a central server would keep
        self._server_x: State | None = None
        self._server_moments = ServerOptState()
        if self._server_opt is not None:
            self._server_x = self.select(self.model_state(), self.upload_part)

    def extra_loss(self) -> ExtraLoss | None:
        """FedProx's proximal term ``(μ/2)·‖w − w_t‖²`` over the uploaded part, ``w_t`` the
        model as this round's training begins (what the node received); None at ``μ = 0``
        (plain FedAvg) and for a method deriving from FedAvg without the knob."""
        mu = float(getattr(self.params, "mu", 0.0))
        if mu <= 0:
            return None
        keys = set(part_keys([n for n, _ in self.model.named_parameters()], self.upload_part))
        anchor = {n: p.detach().clone() for n, p in self.model.named_parameters() if n in keys}
        return proximal_term(anchor, mu)

    def aggregate(
        self,
        uploads: dict[str, Upload],
        server: dict[str, Any],
        roster: list[str],
        round_no: int,
    ) -> Aggregate:
        """``w ← Σ n_i w_i / Σ n_i``; the same global model for every uploader and as
        ``common``. No server state; with ``server_opt``, the step count ``opt_t`` (each
        member then steps from the mean in :meth:`apply`)."""
        glob, total = fedavg_aggregate(
            uploads, self.upload_part, self.ctx.defence, self.ctx.node_id
        )
        return Aggregate(
            results=dict.fromkeys(uploads, glob),
            common=glob,
            server=self._next_server(server),
            facts={"aggregated_n": total},
        )

    def _next_server(self, server: dict[str, Any]) -> dict[str, Any]:
        """The announced server state: nothing without ``server_opt``; else the step this
        round's result takes, one more than the last announced (``opt_t``)."""
        if self._server_opt is None:
            return {}
        return {"opt_t": _step_of(server, allow_zero=True) + 1}

    def aggregate_sum(
        self,
        total: State,
        weight: float,
        template: State,
        members: list[str],
        server: dict[str, Any],
        roster: list[str],
        round_no: int,
    ) -> Aggregate:
        """``w ← (Σ n_i w_i) / Σ n_i`` from the securely aggregated sum (FedPer: of ``g``):
        each floating tensor divided in float64 and cast back to the dtype it has in
        ``template``, the non-floating ones (counters) ``template``'s. Raises ``ValueError``
        on a weight that is not positive and finite (no upload counted)."""
        if not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"the summed weight {weight!r} is not positive")
        glob: State = {}
        for key, like in template.items():
            if like.is_floating_point():
                glob[key] = (total[key] / weight).to(like.dtype)
            else:
                glob[key] = like.clone()
        return Aggregate(
            results=dict.fromkeys(members, glob),
            common=glob,
            server=self._next_server(server),
            facts={"aggregated_n": int(round(weight))},
        )

    def apply(self, received: State, announcement: dict[str, Any]) -> dict[str, Any]:
        """Install the received part (``upload_part``) into the model. Tensors are copied into
        the existing parameters and buffers, which moves them to the model's device. Raises
        ``ValueError``, before anything changes, if the keys, shapes or dtypes do not match
        the model's part or a value is not a tensor."""
        own = self.model.state_dict()
        check_received(list(own), received, own, self.upload_part)
        if self._server_opt is not None:  # the mean is the target of the server's step
            received = self._server_step(received, announcement)
        strict = self.upload_part == "all"
        self.model.load_state_dict(received, strict=strict)
        return {}

    def _server_step(self, mean: State, announcement: dict[str, Any]) -> State:
        """``server_opt``'s step from this member's ``x_t`` towards the round's ``mean``,
        at the announced step ``opt_t``; the new ``x`` and moments are kept. ``ValueError``
        (nothing changed) when the announcement lacks a valid ``opt_t``."""
        assert self._server_opt is not None and self._server_x is not None
        t = _step_of(announcement.get("server"), allow_zero=False)
        x, moments = server_step(self._server_opt, self._server_x, mean, self._server_moments, t)
        self._server_x, self._server_moments = x, moments
        return x

    def extra_state(self) -> dict[str, Any]:
        """With ``server_opt``: the member's copy of the server's ``x_t``, ``m`` and ``v``."""
        if self._server_opt is None:
            return {}
        return {
            "server_x": dict(self._server_x or {}),
            "server_m": dict(self._server_moments.m),
            "server_v": dict(self._server_moments.v),
        }

    def load_extra_state(self, extra: dict[str, Any]) -> None:
        """Restore :meth:`extra_state`, checked whole first (``ValueError`` naming what
        does not fit the model's part)."""
        if self._server_opt is None:
            super().load_extra_state(extra)
            return
        assert self._server_x is not None
        extra = check_keys(extra, ("server_x", "server_m", "server_v"), "fedavg checkpoint extra")
        x = check_state(extra["server_x"], self._server_x, "fedavg checkpoint extra server_x")
        moments = {}
        for name in ("server_m", "server_v"):
            given = extra[name]
            if not isinstance(given, dict) or not set(given) <= set(x):
                raise ValueError(f"fedavg checkpoint extra: {name} must map the model's part")
            moments[name] = {
                k: check_tensor(t, x[k].to(torch.float64), f"fedavg checkpoint extra {name}.{k}")
                for k, t in given.items()
            }
        self._server_x = dict(x)
        self._server_moments = ServerOptState(moments["server_m"], moments["server_v"])
