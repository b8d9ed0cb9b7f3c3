"""UA-PDFL: unit-representation-aided personalized decentralized FL.

Implements docs/algorithms.md, "UA-PDFL" (Zhu, Fan, Xie: "UA-PDFL: A Personalized Approach for
Decentralized Federated Learning", 2024):

- unit tensor ``X_unit``: one input-shaped tensor, every element ``unit_value`` (swarm config);
- unit representation ``I_i = softmax(f(w_i; X_unit))`` (for one output, ``[σ, 1 − σ]``:
  the Reading below) and auxiliary representation
  ``A_i = g_i(X_unit)``, gossiped each round with ``n_i``;
- ``Div(i,j) = ½ KL(I_i‖I_j) + ½ KL(I_j‖I_i)`` with an epsilon guard;
- client-wise dropout when ``Div(i,j) ≤ th_I`` for every drawn peer: adopt one random peer's
  whole model;
- otherwise layer-wise personalization: ``g`` averaged over ``{i} ∪ Q_i``, ``h`` over
  ``{i} ∪ H_i`` (``H_i = {j : Div(i,j) < th_I}``), both weighted by sample counts, with the
  shared weighted mean (docs/algorithms.md, "Shared aggregation"; float64 accumulation,
  non-floating buffers such as ``num_batches_tracked`` are the node's own, listed first);
- a pulled state (the dropout peer's whole model, a peer's ``g`` or whole model) that does
  not have the layout of the matching part of the node's own model (keys, shapes, dtypes)
  is left out as if its pull had failed and named in the facts (``rejected``): the model is
  never partly loaded from it, and a rejected dropout peer leaves the node its own model;
- local loss ``CE + μ ‖g_i(X_unit) − A_avg‖²`` with
  ``A_avg = (A_i + Σ_j A_j) / (|Q_i| + 1)`` over the peers that answered.

**Reading** (docs/algorithms.md, "UA-PDFL"): ``μ`` and one local epoch are defaults, not the
paper's; both are knobs. ``com`` peers are drawn among the node's live topology neighbours.

**Reading** (the divergence rule; README.md, "UA-PDFL's divergence rule"). The paper compares
``Div`` with a fixed ``th_I`` it never gives, and the scale of ``Div`` depends on the data, the
model, ``X_unit`` and the round: median gossiped ``Div`` 0.47–1.5 on CIFAR-10 Dir(0.5) and
0.06–0.009 at Dir(5) (CNN); 0.025 and 0.002 on Fashion-MNIST Dir(0.5) / Dir(5) (CNN); 0.006–0.03
with the MLP on Fashion-MNIST Dir(0.1), where the fixed 0.1 made every node adopt a random
peer's model every round. So the default rule (``divergence_rule: relative``) measures ``Div``
in a unit every node gets for free: its **drift** ``d_i = Div(I_i^pre, I_i)``, how far this
round's local training moved its own unit representation (``I_i^pre`` is taken after the
merge, ``I_i`` after training), gossiped with ``(I, A, n)``. The **relative divergence**

    D(i,j) = Div(i,j) / ((d_i + d_j) / 2)

replaces ``Div`` and a threshold ``kappa`` (2) replaces ``th_I`` in steps 4–5 (dropout when
``D ≤ kappa`` for every drawn peer, ``h`` from the peers with ``D < kappa``). For two nodes
that start a round from the same model and move by ``m_i``, ``m_j`` (in the metric ``Div``
induces), ``D = 2 − 4 m_i·m_j / (|m_i|² + |m_j|²)``: 0 for the same move, 2 for unrelated
moves, 4 for opposite ones, so ``kappa = 2`` reads "our representations differ by no more
than two unrelated rounds of drift would make them". Nodes with alike data share ``h`` (or
drop out) and stay together; nodes whose data pull their classifiers apart round after round
soon differ by many rounds of drift (``D ≫ 2``) and keep ``h`` to themselves. The ratio is
free of the scale of ``Div``: the learning rate, the model and ``X_unit`` scale ``Div`` and
``d`` alike. Until a drift is known (round 1, or a peer that does not gossip one) ``D`` is 0
for identical representations (``Div`` = 0, e.g. the common initial model) and infinite
otherwise. ``divergence_rule: fixed`` is the paper's rule with the number ``th_I``.

**Reading** (one output): a model of one output (``training.loss: bce``, or one value such as
a survival risk score) has no softmax to take; ``I_i`` is the Bernoulli ``[σ(f), 1 − σ(f)]``
of that output at ``X_unit``, the class probabilities of ``bce`` and, for a risk score, a
monotone map of it into (0, 1), so ``Div`` and the drift compare the same thing. A model of
several values (regression of k > 1 columns) is refused: no distribution is read off it.

**Reading** (the round's cut, ``order``): the paper's loop is gossip, merge, train, and it
names no point at which a node's model is scored. ``merge_first`` (default) cuts the loop
there, so each round ends on the model the node just trained, its personalized model;
``train_first`` cuts it after the merge (train, gossip, merge: the same loop from round 2
on, as DFedAvgM orders its round), so each round ends on, and is scored on, the model the
merge made, as FedAvg's and FedPer's rounds end on their aggregate. Round 1 then merges
after training and has no common-initial-model dropout. Where a round's last local steps
move a model far (FLamby's Fed-TCGA-BRCA at its settings: 100 steps at lr 0.1 on raw
features) the merged model is the better score; on Fashion-MNIST Dir(0.1) the trained one
is (README.md, "UA-PDFL's divergence rule").

**Reading** (scale of ``μ``): Eq. (12) is the squared L2 norm summed over the feature vector,
so the strength of a given ``μ`` grows with the feature dimension ``F``. Measured on the CNN
with Fashion-MNIST (``F`` = 3136, SGD lr 0.05): ``μ`` = 0.1 diverges within one epoch
(cross-entropy 191), ``μ`` = 0.01 trains normally, and is the default. ``aux_reduction: sum``
(default) is the paper's form; ``aux_reduction: mean`` divides by ``F`` so ``μ`` means the same
for any model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch.nn.modules.batchnorm import _BatchNorm

from p2pfl.algorithms.base import (
    AlgorithmContext,
    DecentralizedAlgorithm,
    ExtraLoss,
    PullPlan,
    State,
    check_keys,
    check_tensor,
    draw_peers,
    gossiped_count,
    peer_state_mismatch,
    register,
)
from p2pfl.algorithms.cards.uapdfl import CARD
from p2pfl.learning.split_model import SplitModel
from p2pfl.learning.state import select_part

# ----------------------------------------------------------------------------- pure math


def unit_tensor(input_shape: Iterable[int], value: float) -> torch.Tensor:
    """``X_unit``: a batch of one input-shaped tensor filled with ``value``."""
    return torch.full((1, *input_shape), float(value))


def unit_distribution(outputs: torch.Tensor) -> torch.Tensor:
    """``I``: the softmax of ``C`` logits; for a model of one output (``training.loss:
    bce``, or one value such as a risk score) the Bernoulli ``[σ(z), 1 − σ(z)]``
    (docs/algorithms.md, "UA-PDFL", the Reading for one output)."""
    if outputs.shape[-1] == 1:
        p = torch.sigmoid(outputs)
        return torch.cat([p, 1 - p], dim=-1)
    return torch.softmax(outputs, dim=-1)


def kl(p: torch.Tensor, q: torch.Tensor, eps: float = 1e-8) -> float:
    """``KL(p‖q) = Σ_o p_o log(p_o / q_o)``, both clamped below at ``eps``."""
    p = p.double().clamp_min(eps)
    q = q.double().clamp_min(eps)
    return float((p * (p.log() - q.log())).sum())


def symmetric_kl(p: torch.Tensor, q: torch.Tensor, eps: float = 1e-8) -> float:
    """``Div(i,j) = ½ KL(I_i‖I_j) + ½ KL(I_j‖I_i)``."""
    return 0.5 * kl(p, q, eps) + 0.5 * kl(q, p, eps)


def relative_divergence(div: float, drift_i: float | None, drift_j: float | None) -> float:
    """``D(i,j) = Div(i,j) / ((d_i + d_j) / 2)``: the divergence in units of the pair's mean
    drift. Without both drifts, or with zero drift, identical representations (``Div`` = 0)
    give 0 and any other ``Div`` gives infinity."""
    if div <= 0.0:
        return 0.0
    if drift_i is None or drift_j is None:
        return math.inf
    scale = 0.5 * (drift_i + drift_j)
    return div / scale if scale > 0.0 else math.inf


def gossiped_drift(gossip: dict[str, Any]) -> float | None:
    """A peer's gossiped drift ``d`` (a finite float ≥ 0), None when absent or malformed."""
    d = gossip.get("d")
    if isinstance(d, bool) or not isinstance(d, (int, float)) or not math.isfinite(d) or d < 0:
        return None
    return float(d)


def decide(
    divergences: dict[str, float], th_I: float, rng: np.random.Generator
) -> tuple[str | None, list[str]]:
    """Step 4/5: returns ``(dropout_peer, h_peers)``.

    ``dropout_peer`` is a random peer when every divergence is ``≤ th_I`` (client-wise
    dropout), else None and ``h_peers`` are those with ``Div < th_I`` (the set ``H_i``).
    With no peers at all there is nothing to do: ``(None, [])``.
    """
    if not divergences:
        return None, []
    peers = sorted(divergences)
    if all(divergences[j] <= th_I for j in peers):
        return peers[int(rng.integers(len(peers)))], []
    return None, [j for j in peers if divergences[j] < th_I]


# ----------------------------------------------------------------------------- the method


@register
class UAPDFL(DecentralizedAlgorithm):
    name = CARD.name
    shares = CARD.shares
    Params = CARD.Params
    # g to every chosen peer, h to the low-divergence ones, and the unit and auxiliary
    # representations in gossip; g may be empty (the identity: a model of one linear layer,
    # whose auxiliary term is then zero), h may not (nothing would be personalized)
    needs_parts = frozenset({"h"})

    @classmethod
    def task_problem(cls, loss: str, targets: str, outputs: int) -> str | None:
        if targets == "values" and outputs != 1:
            return (
                "its unit representation reads C logits as classes or one output as a "
                f"probability (its sigmoid); this model outputs {outputs} values a row"
            )
        return None

    def __init__(self, params: dict[str, Any], ctx: AlgorithmContext):
        super().__init__(params, ctx)
        # the round's cut (module docstring): train_first trains, then gossips and merges
        self.exchange_after_training = self.params.order == "train_first"
        self.x_unit = unit_tensor(ctx.input_shape, self.params.unit_value).to(ctx.device)
        self.A_avg: torch.Tensor | None = None
        self._dropout_peer: str | None = None
        self.drift: float | None = None  # d_i of the latest round; None before the first
        self._I_pre: torch.Tensor | None = None
        self._refresh_representations()

    @torch.no_grad()
    def _refresh_representations(self) -> None:
        was_training = self.model.training
        self.model.eval()
        feats, logits = self.model.features_and_logits(self.x_unit)
        self.I = unit_distribution(logits)[0].float().cpu()
        self.A = feats[0].float().cpu()
        self.model.train(was_training)

    def gossip(self) -> dict[str, Any]:
        message: dict[str, Any] = {"n": self.ctx.num_samples, "I": self.I, "A": self.A}
        if self.drift is not None:
            message["d"] = self.drift
        return message

    def choose_peers(self, candidates: list[str]) -> list[str]:
        """``Q_i``: ``com`` random peers among the live neighbours (step 1)."""
        return draw_peers(candidates, self.params.com, self.ctx.rng)

    def _valid_gossip(self, gossip: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Keep peers whose representations have the right shapes and a positive ``n``."""
        ok = {}
        for peer, g in gossip.items():
            if not isinstance(g, dict):
                continue
            I_j, A_j = g.get("I"), g.get("A")
            if (
                isinstance(I_j, torch.Tensor)
                and isinstance(A_j, torch.Tensor)
                and I_j.shape == self.I.shape
                and A_j.shape == self.A.shape
                and gossiped_count(g) is not None
                and bool(torch.isfinite(I_j).all())
                and bool(torch.isfinite(A_j).all())
            ):
                ok[peer] = g
        return ok

    def similarity(
        self, gossip: dict[str, dict[str, Any]], divs: dict[str, float]
    ) -> tuple[dict[str, float], float]:
        """The values steps 4–5 compare, and their threshold: ``(Div, th_I)`` for the fixed
        rule, ``(D, kappa)`` for the relative one (module docstring)."""
        if self.params.divergence_rule == "fixed":
            return divs, self.params.th_I
        rel = {j: relative_divergence(divs[j], self.drift, gossiped_drift(gossip[j])) for j in divs}
        return rel, self.params.kappa

    def plan(self, gossip: dict[str, dict[str, Any]]) -> tuple[PullPlan, dict[str, Any]]:
        gossip = self._valid_gossip(gossip)
        divs = {j: symmetric_kl(self.I, g["I"].float(), self.params.eps) for j, g in gossip.items()}
        compared, threshold = self.similarity(gossip, divs)
        dropout_peer, h_peers = decide(compared, threshold, self.ctx.rng)
        self._dropout_peer = dropout_peer
        if dropout_peer is not None:
            pull: PullPlan = {dropout_peer: "all"}
        else:
            pull = {j: ("all" if j in h_peers else "g") for j in gossip}
        # step 6, over the peers that answered
        if gossip:
            stacked = torch.stack([self.A] + [g["A"].float() for g in gossip.values()])
            self.A_avg = stacked.mean(dim=0)
        else:
            self.A_avg = None
        facts = {
            "divergence": {j: round(d, 6) for j, d in divs.items()},
            "drift": None if self.drift is None else round(self.drift, 8),
            "dropout": dropout_peer is not None,
            "dropout_peer": dropout_peer,
            "h_peers": h_peers,
        }
        if self.params.divergence_rule == "relative":
            facts["relative"] = {j: _finite_or_none(v, 4) for j, v in compared.items()}
        return pull, facts

    def merge(self, gossip: dict[str, dict[str, Any]], pulled: dict[str, State]) -> dict[str, Any]:
        """Step 4 (adopt the dropout peer's whole model) or step 5 (layer-wise average); then
        ``I_i^pre``, the unit representation training starts from (for the drift)."""
        facts = self._merge(gossip, pulled)
        self._refresh_representations()
        self._I_pre = self.I.clone()
        return facts

    def _merge(self, gossip: dict[str, dict[str, Any]], pulled: dict[str, State]) -> dict[str, Any]:
        own = self.model.state_dict()
        if self._dropout_peer is not None:
            peer = self._dropout_peer
            if peer not in pulled:  # its pull failed: keep the own model this round
                return {"merged_from": []}
            why = peer_state_mismatch(pulled[peer], own)
            if why is not None:  # as if its pull had failed
                return {"merged_from": [], "rejected": {peer: why}}
            # the defence's test of a single state (clip, centered_clip: its distance to
            # the own model)
            if not self.ctx.defence.screen(self.model_state(), {peer: pulled[peer]}):
                return {"merged_from": []}  # refused: named in the defence's rejections
            self.model.load_state_dict(pulled[peer])
            return {"merged_from": [peer]}
        if not pulled:
            return {"merged_from": []}
        g_own = select_part(own, "g")
        n: dict[str, int] = {}
        parts: dict[str, tuple[str, ...]] = {}  # peer -> the parts it sent
        rejected: dict[str, str] = {}
        for j in sorted(pulled):
            state = pulled[j]
            # a g pull holds the g keys only; anything else must be the whole model
            only_g = isinstance(state, Mapping) and all(
                isinstance(k, str) and k.startswith("g.") for k in state
            )
            why = peer_state_mismatch(state, g_own if only_g else own)
            count = gossiped_count(gossip.get(j))
            if why is None and count is None:
                why = "no usable sample count"
            if why is not None:
                rejected[j] = why
                continue
            n[j] = count
            parts[j] = ("g",) if only_g else ("g", "h")
        facts: dict[str, Any] = {"merged_from": sorted(n)}
        if rejected:
            facts["rejected"] = rejected
        if not n:  # every pulled state rejected: the node keeps its own model
            return facts
        new = dict(own)
        defence = self.ctx.defence
        for part in ("g", "h"):  # each over {i} ∪ the peers that sent it, own first
            mine = select_part(own, part)
            states, weights, who = [mine], [self.ctx.num_samples], [self.ctx.node_id]
            for j in sorted(n):
                if part in parts[j]:
                    states.append(select_part(pulled[j], part))
                    weights.append(n[j])
                    who.append(j)
            if sum(weights) > 0:  # else own alone with no samples: it keeps its part
                new.update(defence.combine(states, weights, who=who, own=0))
        self.model.load_state_dict(new)
        facts["merged_from"] = [j for j in sorted(n) if j not in defence.rejected]
        return facts

    def extra_loss(self) -> ExtraLoss | None:
        """``μ ‖g_i(X_unit) − A_avg‖²`` (step 7); none when no peer answered or μ = 0."""
        if self.A_avg is None or self.params.mu == 0:
            return None
        target = self.A_avg.to(self.ctx.device)
        mu = self.params.mu
        if self.params.aux_reduction == "mean":
            mu = mu / target.numel()

        def aux_term(model, x, y, logits):  # noqa: ARG001 - uniform signature
            return mu * (self._unit_features(model) - target).pow(2).sum()

        return aux_term

    def _unit_features(self, model: SplitModel) -> torch.Tensor:
        """``g(X_unit)`` as the auxiliary term needs it during training. **Reading** (a ``g``
        with batch normalisation, e.g. ResNet18 or a user's model): its batch-norm layers
        run on their running statistics (eval mode) for this one synthetic input, gradients
        still flowing to their affine weights. In training mode the constant ``X_unit`` would
        be normalised by its own statistics (a constant image has no variance: a
        ``BatchNorm1d`` refuses a batch of one) and every step would pull the running
        statistics the model is evaluated with towards ``X_unit``'s. Models without batch
        normalisation (the CNN, LeNet, the MLP) are unaffected."""
        norms = [m for m in model.modules() if isinstance(m, _BatchNorm) and m.training]
        for m in norms:
            m.eval()
        try:
            return model.features(self.x_unit)[0]
        finally:
            for m in norms:
                m.train()

    def after_train(self) -> dict[str, Any]:
        """Step 8, and the drift ``d_i = Div(I_i^pre, I_i)`` gossiped next round."""
        self._refresh_representations()
        if self._I_pre is not None:
            self.drift = symmetric_kl(self._I_pre, self.I, self.params.eps)
            self._I_pre = None
        return {}

    # -- checkpoints ---------------------------------------------------------------------
    _EXTRA = ("I", "A", "A_avg", "drift", "I_pre", "dropout_peer")

    def extra_state(self) -> dict[str, Any]:
        """``I_i`` and ``A_i`` as last gossiped (computed on this node's device, so kept
        rather than recomputed), the drift ``d_i`` gossiped next round, and this round's
        ``A_avg``, dropout peer and ``I_i^pre`` (set by plan and merge, used until
        after_train)."""
        return {
            "I": self.I.clone(),
            "A": self.A.clone(),
            "A_avg": None if self.A_avg is None else self.A_avg.detach().cpu().clone(),
            "drift": self.drift,
            "I_pre": None if self._I_pre is None else self._I_pre.clone(),
            "dropout_peer": self._dropout_peer,
        }

    def load_extra_state(self, extra: dict[str, Any]) -> None:
        extra = check_keys(extra, self._EXTRA, "uapdfl checkpoint extra")
        unit = check_tensor(extra["I"], self.I, "uapdfl checkpoint I")
        aux = check_tensor(extra["A"], self.A, "uapdfl checkpoint A")
        A_avg, I_pre = extra["A_avg"], extra["I_pre"]
        if A_avg is not None:
            A_avg = check_tensor(A_avg, self.A, "uapdfl checkpoint A_avg")
        if I_pre is not None:
            I_pre = check_tensor(I_pre, self.I, "uapdfl checkpoint I_pre")
        drift = extra["drift"]
        if drift is not None and (isinstance(drift, bool) or not isinstance(drift, (int, float))):
            raise ValueError(f"uapdfl checkpoint drift: {drift!r} is not a number")
        peer = extra["dropout_peer"]
        if peer is not None and not isinstance(peer, str):
            raise ValueError(f"uapdfl checkpoint dropout_peer: {peer!r} is not a str")
        self.I, self.A = unit.clone(), aux.clone()
        self.A_avg = None if A_avg is None else A_avg.clone()
        self._I_pre = None if I_pre is None else I_pre.clone()
        self.drift = None if drift is None else float(drift)
        self._dropout_peer = peer


def _finite_or_none(value: float, digits: int) -> float | None:
    """``round(value, digits)``, or None for an infinite value (JSON has no infinity)."""
    return round(value, digits) if math.isfinite(value) else None
