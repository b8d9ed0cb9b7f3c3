"""DiversiFed: learning from similar and dissimilar clients via a model-distance loss.

Implements docs/algorithms.md, "DiversiFed" (Wu et al.: "The Diversity Bonus: Learning from
Dissimilar Distributed Clients in Personalized Federated Learning", 2024), run by the rotating
aggregator peer:

- every participant uploads its whole trained model ``w_i`` (``upload_part = "all"``);
- the aggregator flattens the uploads and, for each ``i``, over ``j ∈ a(i)`` (all other
  uploaders): ``d_j = ‖w_i − w_j‖ / τ``, ``s = softmax(d)``, ``ξ_j = 1/|a(i)| − s_j`` and
  ``z_i = w_i − α Σ_j ξ_j (w_i − w_j) / (τ² d_j)``; node ``i`` receives its own ``z_i`` only;
- node ``i`` keeps its own ``w_i`` as its personalized model and trains
  ``CE(w; D_i) + (λ / 2α) ‖w − z_i‖²`` (the first round, before any ``z_i``: plain CE).

**Sign** (checked by the tests with autograd): with
``L_d(w_i) = (1/|a(i)|) Σ_j log softmax(d)_j`` one has ``∂L_d/∂d_j = 1/|a(i)| − s_j = ξ_j`` and
``∂d_j/∂w_i = (w_i − w_j) / (τ² d_j)``, so the formula above is exactly
``z_i = w_i − α ∇L_d(w_i)``: one gradient-*descent* step of size ``α`` on ``L_d`` (paper eq. 6–7,
"the server executes one step gradient descent"). ``ξ_j > 0`` (a near model, ``s_j < 1/|a(i)|``)
pulls ``w_i`` towards ``w_j``; ``ξ_j < 0`` (a far one) pushes it away.

**Reading** (degenerate cases): with ``K = 2`` uploads ``ξ = 1 − 1 = 0`` and ``z_i = w_i``; with
one upload ``a(i)`` is empty and ``z_i = w_i``. A distance ``‖w_i − w_j‖ ≤ eps`` (identical
models, e.g. round 1 when every node starts from the same seed and trains identically) makes
``(w_i − w_j) / (τ² d_j)`` 0/0: that pair contributes nothing to the sum (the subgradient of
``‖·‖`` at 0 that autograd also uses), while its ``d_j = 0`` still enters the softmax. Identical
models therefore get ``z_i = w_i`` and nothing is ever NaN or infinite.

**Reading** (what is flattened): every floating-point tensor of the upload, keys in sorted
order, in float64. For models with BatchNorm (``resnet18``) the floating running statistics
enter the distance too (the paper's models have none); integer buffers
(``num_batches_tracked``) do not, and are copied unchanged into ``z_i``. The proximal term uses
the model's parameters only (``named_parameters``), not its buffers.

**Reading** (robustness): an upload holding a non-finite value (a diverged node) would poison
every softmax; it is left out of the rule (facts ``excluded``) and gets no result, like a node
that did not upload. A node that receives nothing keeps its previous ``z_i``.

The combination is computed as ``Z = W − α L W`` with ``L = diag(B·1) − B``,
``B_ij = ξ_ij / (τ² d_ij)`` (zero on the diagonal and for coincident pairs): one ``K × K`` by
``K × P`` product on the centred ``W`` (``L`` has zero row sums), memory ``O(K·P)``. Distances use
``torch.cdist`` without the matrix-product shortcut, so near-identical models keep exact
distances.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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
    kept_uploads,
    peer_state_mismatch,
    register,
)
from p2pfl.algorithms.cards.diversifed import CARD
from p2pfl.learning.defence import SELECTING_RULES

# ----------------------------------------------------------------------------- pure math


def float_keys(state: State) -> list[str]:
    """The keys of the floating-point tensors of ``state``, sorted."""
    return sorted(k for k, v in state.items() if torch.is_floating_point(v))


def flatten_state(state: State, keys: Sequence[str]) -> torch.Tensor:
    """The tensors ``state[k]`` for ``k`` in ``keys`` (in that order), flattened and
    concatenated into one float64 CPU vector."""
    if not keys:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat(
        [state[k].detach().to(device="cpu", dtype=torch.float64).reshape(-1) for k in keys]
    )


def unflatten(vec: torch.Tensor, template_state: State) -> State:
    """Inverse of :func:`flatten_state` over ``float_keys(template_state)``: a state with the
    template's keys, shapes, dtypes and devices; non-floating tensors are copied from the
    template. Raises ``ValueError`` when ``vec`` has the wrong length."""
    keys = float_keys(template_state)
    total = sum(template_state[k].numel() for k in keys)
    if vec.dim() != 1 or vec.numel() != total:
        raise ValueError(f"vector of shape {tuple(vec.shape)} does not fit {total} elements")
    out: State = {}
    offset = 0
    for k in keys:
        ref = template_state[k]
        n = ref.numel()
        out[k] = vec[offset : offset + n].reshape(ref.shape).to(ref.device, ref.dtype, copy=True)
        offset += n
    for k, ref in template_state.items():
        if k not in out:
            out[k] = ref.detach().clone()
    return {k: out[k] for k in template_state}  # the template's key order


def pairwise_distances(W: torch.Tensor) -> torch.Tensor:
    """``‖w_i − w_j‖`` for the rows of ``W`` (K × K), computed from the differences (no
    ``|a|² + |b|² − 2ab`` shortcut, which loses near-identical pairs to cancellation)."""
    return torch.cdist(W, W, compute_mode="donot_use_mm_for_euclid_dist")


def diversifed_targets(
    W: torch.Tensor, tau: float = 1.0, alpha: float = 1.0, eps: float = 1e-12
) -> torch.Tensor:
    """``Z`` (K × P): row ``i`` is ``z_i = w_i − α Σ_{j≠i} ξ_j (w_i − w_j) / (τ² d_j)``, one
    gradient-descent step of size ``α`` on ``L_d(w_i) = (1/(K−1)) Σ_j log softmax(d)_j`` with
    ``d_j = ‖w_i − w_j‖ / τ`` (module docstring). ``W`` holds one flattened model per row;
    the arithmetic is float64. Pairs at distance ``≤ eps`` contribute no direction term.
    ``K ≤ 2`` returns ``W`` unchanged (as ``ξ ≡ 0`` for ``K = 2``)."""
    if W.dim() != 2:
        raise ValueError(f"W must be K×P, got shape {tuple(W.shape)}")
    W = W.to(torch.float64)
    K = W.shape[0]
    if K <= 1:
        return W.clone()
    dist = pairwise_distances(W)
    d = dist / tau
    eye = torch.eye(K, dtype=torch.bool, device=W.device)
    s = torch.softmax(d.masked_fill(eye, float("-inf")), dim=1)  # over a(i): diagonal is 0
    xi = (1.0 / (K - 1) - s).masked_fill(eye, 0.0)
    # B_ij = ξ_ij / (τ² d_ij) = ξ_ij / (τ ‖w_i − w_j‖); 0 where the pair coincides
    coincident = dist <= eps
    B = torch.where(coincident, torch.zeros_like(xi), xi / (tau * dist.clamp_min(eps)))
    B = B.masked_fill(eye, 0.0)
    # Σ_j B_ij (w_i − w_j) = (L W)_i with L = diag(B·1) − B; L's rows sum to 0, so centring W
    # first changes nothing but keeps the products small (less cancellation).
    Wc = W - W.mean(dim=0, keepdim=True)
    step = B.sum(dim=1, keepdim=True) * Wc - B @ Wc
    del Wc
    return W - alpha * step


# ----------------------------------------------------------------------------- the method


@register
class DiversiFed(CentralizedAlgorithm):
    name = CARD.name
    shares = CARD.shares
    Params = CARD.Params
    upload_part = "all"
    defences = ("mean", *SELECTING_RULES)  # its own arithmetic: over the states kept

    def __init__(self, params: dict[str, Any], ctx: AlgorithmContext):
        super().__init__(params, ctx)
        self.target: State | None = None  # z_i on the model's device; None before round 1

    # -- client side ---------------------------------------------------------------------
    def extra_loss(self) -> ExtraLoss | None:
        """``(λ / 2α) Σ_p ‖p − z_p‖²`` over the model's parameters; none before the first
        ``z_i`` or with ``λ = 0``."""
        if self.target is None or self.params.lam == 0:
            return None
        coef = self.params.lam / (2.0 * self.params.alpha)
        target = self.target

        def prox_term(model, x, y, logits):  # noqa: ARG001 - uniform signature
            total = None
            for name, p in model.named_parameters():
                term = (p - target[name]).pow(2).sum()
                total = term if total is None else total + term
            if total is None:  # a model without parameters
                return logits.new_zeros(())
            return coef * total

        return prox_term

    def apply(self, received: State, announcement: dict[str, Any]) -> dict[str, Any]:
        """Store ``z_i`` as the proximal target; the model keeps its own trained ``w_i``.
        Raises ``ValueError``, before anything changes, when the keys, shapes or dtypes
        differ from the model's state, a value is not a tensor or a floating value is not
        finite."""
        own = self.model.state_dict()
        why = peer_state_mismatch(received, own)
        if why is not None:
            raise ValueError(f"target: {why}")
        for k in own:
            v = received[k]
            if torch.is_floating_point(v) and not bool(torch.isfinite(v).all()):
                raise ValueError(f"target {k!r} holds a non-finite value")
        self.target = {
            k: received[k].detach().to(device=ref.device, dtype=ref.dtype).clone()
            for k, ref in own.items()
        }
        with torch.no_grad():
            sq = sum(
                float((p.detach().double() - self.target[name].double()).pow(2).sum())
                for name, p in self.model.named_parameters()
            )
        return {"prox_dist": math.sqrt(sq)}

    # -- checkpoints ---------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        """The proximal target ``z_i`` (CPU copies), or None before the first one: the
        model holds ``w_i``, not ``z_i``, and a node keeps its previous ``z_i`` in a round
        it receives none."""
        if self.target is None:
            return {"target": None}
        return {"target": {k: v.detach().to("cpu", copy=True) for k, v in self.target.items()}}

    def load_extra_state(self, extra: dict[str, Any]) -> None:
        extra = check_keys(extra, ("target",), "diversifed checkpoint extra")
        if extra["target"] is None:
            self.target = None
            return
        own = self.model.state_dict()
        target = check_state(extra["target"], own, "diversifed checkpoint target")
        self.target = {k: target[k].to(own[k].device, copy=True) for k in own}

    # -- server side (pure) --------------------------------------------------------------
    def aggregate(
        self,
        uploads: dict[str, Upload],
        server: dict[str, Any],
        roster: list[str],
        round_no: int,
    ) -> Aggregate:
        """Each finite uploader ``i`` receives its own ``z_i`` (module docstring), over the
        uploads the aggregator's defence keeps (docs/design.md, "Robust aggregation"); a
        refused uploader receives nothing."""
        uploads = kept_uploads(uploads, self.ctx.defence, self.ctx.node_id)
        nodes = sorted(uploads)
        keys = float_keys(uploads[nodes[0]].state)
        rows: list[torch.Tensor] = []
        used: list[str] = []
        excluded: list[str] = []
        for node in nodes:
            vec = flatten_state(uploads[node].state, keys)
            if bool(torch.isfinite(vec).all()):
                rows.append(vec)
                used.append(node)
            else:
                excluded.append(node)
        facts: dict[str, Any] = {"excluded": excluded, "k": len(used)}
        if not used:
            facts.update(mean_dist=0.0, mean_shift=0.0)
            return Aggregate(results={}, common=None, server=server, facts=facts)
        W = torch.stack(rows)
        del rows
        p = self.params
        Z = diversifed_targets(W, p.tau, p.alpha, p.eps)
        K = len(used)
        if K > 1:
            dist = pairwise_distances(W)
            mean_dist = float(dist.sum()) / (K * (K - 1))
        else:
            mean_dist = 0.0
        facts["mean_dist"] = mean_dist
        facts["mean_shift"] = float((Z - W).norm(dim=1).mean())
        results = {node: unflatten(Z[i], uploads[node].state) for i, node in enumerate(used)}
        return Aggregate(results=results, common=None, server=server, facts=facts)
