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

:func:`fedavg_aggregate` is reused by FedPer and CriticalFL.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from p2pfl.algorithms.base import (
    Aggregate,
    CentralizedAlgorithm,
    ExtraLoss,
    State,
    Upload,
    peer_state_mismatch,
    register,
)
from p2pfl.algorithms.cards.fedavg import CARD
from p2pfl.learning.defence import Defence
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


# ----------------------------------------------------------------------------- the method


@register
class FedAvg(CentralizedAlgorithm):
    name = CARD.name
    shares = CARD.shares
    Params = CARD.Params
    upload_part = "all"

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
        ``common``. No server state."""
        glob, total = fedavg_aggregate(
            uploads, self.upload_part, self.ctx.defence, self.ctx.node_id
        )
        return Aggregate(
            results=dict.fromkeys(uploads, glob),
            common=glob,
            server={},
            facts={"aggregated_n": total},
        )

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
            server={},
            facts={"aggregated_n": int(round(weight))},
        )

    def apply(self, received: State, announcement: dict[str, Any]) -> dict[str, Any]:
        """Install the received part (``upload_part``) into the model. Tensors are copied into
        the existing parameters and buffers, which moves them to the model's device. Raises
        ``ValueError``, before anything changes, if the keys, shapes or dtypes do not match
        the model's part or a value is not a tensor."""
        own = self.model.state_dict()
        check_received(list(own), received, own, self.upload_part)
        strict = self.upload_part == "all"
        self.model.load_state_dict(received, strict=strict)
        return {}
