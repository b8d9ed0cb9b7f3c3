"""DFedAvgM: decentralized federated averaging with momentum (Sun et al., 2021).

Implements docs/algorithms.md, "DFedAvgM": each node runs local SGD with
heavy-ball momentum, then mixes with its neighbours (fp16 transfers are an option). The
round order is train-then-exchange (``exchange_after_training = True``): peers pull what this
node has just trained.

**Reading** (the rule; ``mixing``). Round ``t`` of node ``i``:

1. train from ``x_i`` with the training config's SGD (``training.momentum`` is the heavy-ball
   momentum, restarted every round: a fresh optimizer, as the paper's ``y^{-1} = y^0 = x_i``)
   to ``z_i``;
2. ``mixing: models`` (default, the paper's Algorithm 1): publish ``z_i``; then
   ``x_i ← Σ_j n_j z_j / Σ_j n_j`` over ``j ∈ {i} ∪ N_i'``;
   ``mixing: deltas``: publish ``Δ_i = z_i − x_i``; then ``x_i ← x_i + Σ_j n_j Δ_j / Σ_j n_j``,

where ``N_i'`` are the neighbours whose gossip and pull arrived this round (a neighbour whose
pull failed or whose tensors are malformed is left out, so the weights are renormalised over
who is present). The weights ``n_j / Σ n`` are row-stochastic per node, not the paper's
doubly-stochastic ``W``.

The two agree while neighbours hold the same ``x`` (round 1: every node starts from the same
model), since ``Σ_j w_j z_j = Σ_j w_j x_j + Σ_j w_j Δ_j``. Afterwards only model mixing pulls
the nodes towards consensus: delta mixing keeps each node's own ``x_i`` and adds updates that
were computed at the neighbours' points. Measured on the ``quick`` suite (Fashion-MNIST,
Dirichlet(0.1), 20 nodes, Adam): delta mixing fell from 50% to 29% mean accuracy over 10
rounds while the nodes' training loss stayed low, so the paper's model mixing is the
default; ``deltas`` stays for comparison (and for the literal wording of docs/algorithms.md,
"DFedAvgM").

**Reading** (neighbours). The paper mixes over a fixed graph; ``peers`` (default None: every
live neighbour) draws that many neighbours per round instead, for comparisons where every
method talks to ``com`` peers a round (UA-PDFL's setting on a full graph).

**Reading** (knobs). ``weighted`` (default True) weights by the training sample counts the
peers gossip; False averages uniformly. ``training.momentum = 0`` gives plain DFedAvg. The
UA-PDFL comparison's "twice the local iterations, half the rounds" is a topology choice
(``training.epochs``, ``rounds``), not a knob of this module.

**Reading** (fp16 deltas). With ``fp16_deltas`` what is published (the model ``z_i``, or the
delta ``Δ_i``) travels as float16, halving the bytes pulled; the receiver casts it back to
float32 before averaging (float64 accumulation).
float16 keeps 11 significant bits: each element's relative error is at most ``2^-11`` (about
5e-4) for magnitudes above ``6.1e-5``, and an absolute error of at most ``2^-25`` (about
3e-8) below, where float16 is subnormal. Magnitudes beyond the float16 range (65504) are
clamped to ±65504 rather than sent as ``inf``. The node's own contribution always uses its
exact tensors, so only the peers' terms carry the rounding. (Deltas are small, so their
absolute rounding error is far below that of whole weights.)

**Reading** (non-floating buffers, e.g. BatchNorm's ``num_batches_tracked``). They have no
meaningful delta: a "delta" carries the trained value itself, the average keeps the node's
own, and applying it sets the buffer to that value.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from p2pfl.algorithms.base import (
    AlgorithmContext,
    State,
    WholeModelExchange,
    check_keys,
    check_state,
    peer_state_mismatch,
    register,
)
from p2pfl.algorithms.cards.dfedavgm import CARD
from p2pfl.learning.defence import Combine
from p2pfl.learning.state import layout_mismatch, weighted_mean

FP16_MAX = float(torch.finfo(torch.float16).max)  # 65504
WIRE_FLOAT_DTYPES = (torch.float16, torch.float32)  # what a peer's delta may be sent as


# ----------------------------------------------------------------------------- pure math


def _check_same_layout(a: State, b: State, what: str) -> None:
    """``ValueError`` unless ``b`` has ``a``'s keys and shapes (dtypes may differ)."""
    why = layout_mismatch(b, a, dtype=False)
    if why is not None:
        raise ValueError(f"{what}: {why}")


def model_delta(after: State, before: State, fp16: bool) -> State:
    """``after − before`` for every floating tensor (in ``after``'s dtype, then float16 when
    ``fp16``, clamped to ±65504); a non-floating tensor carries ``after``'s value instead.
    Raises ``ValueError`` when the keys or shapes differ."""
    _check_same_layout(after, before, "model_delta")
    out: State = {}
    for key, a in after.items():
        if not torch.is_floating_point(a):
            out[key] = a.detach().clone()
            continue
        d = a.detach() - before[key].detach().to(device=a.device, dtype=a.dtype)
        if fp16:
            d = d.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
        out[key] = d
    return out


def average_deltas(
    deltas: list[State], weights: list[float], combine: Combine | None = None
) -> State:
    """``Σ w_u Δ_u / Σ w_u`` per floating key with the shared weighted mean
    (docs/algorithms.md, "Shared aggregation": float64 accumulation, a weight 0 left out),
    returned in the first delta's dtype promoted to at least float32 (float16 deltas come
    back as float32): every delta's floating tensors are first widened, exactly, to that
    dtype. Non-floating keys are taken from the first delta (the node's own). ``combine``
    (the node's defence, docs/design.md, "Robust aggregation") replaces the weighted mean.

    Raises ``ValueError`` for no deltas, a length mismatch, mismatched keys or shapes, a
    floating delta wider than that dtype or a non-floating one of another dtype than the
    first's, a negative or non-finite weight or a non-positive total."""
    if not deltas:
        raise ValueError("average_deltas needs at least one delta")
    if len(deltas) != len(weights):
        raise ValueError(f"average_deltas: {len(deltas)} deltas but {len(weights)} weights")
    first = deltas[0]
    for other in deltas[1:]:
        _check_same_layout(first, other, "average_deltas")
    wide = {
        k: torch.promote_types(t.dtype, torch.float32)
        for k, t in first.items()
        if torch.is_floating_point(t)
    }
    widened = [
        {
            k: t.to(torch.promote_types(wide[k], t.dtype))
            if k in wide and torch.is_floating_point(t)
            else t
            for k, t in d.items()
        }
        for d in deltas
    ]
    return (combine or weighted_mean)(widened, weights)


def apply_delta(base: State, delta: State) -> State:
    """``base + delta`` for floating keys (summed in float64, cast to ``base``'s dtype and
    device); a non-floating key takes ``delta``'s value (the trained buffer), cast likewise.
    Raises ``ValueError`` when the keys or shapes differ."""
    _check_same_layout(base, delta, "apply_delta")
    out: State = {}
    for key, b in base.items():
        d = delta[key].to(b.device)
        if torch.is_floating_point(b):
            out[key] = (b.to(torch.float64) + d.to(torch.float64)).to(b.dtype)
        else:
            out[key] = d.to(b.dtype).clone()
    return out


def check_peer_delta(own: State, peer: State) -> str | None:
    """Why a pulled delta cannot be averaged with ``own`` (None when it can): it must be a
    map with ``str`` keys, exactly ``own``'s, of tensors of ``own``'s shapes, floating
    entries float16 or float32 and finite, other entries of ``own``'s dtype."""
    why = peer_state_mismatch(peer, own, dtype=False)
    if why is not None:
        return why
    for key, ref in own.items():
        t = peer[key]
        if torch.is_floating_point(ref):
            if t.dtype not in WIRE_FLOAT_DTYPES:
                return f"{key}: dtype {t.dtype}, expected float16 or float32"
            if not bool(torch.isfinite(t).all()):
                return f"{key}: not finite"
        elif t.dtype != ref.dtype:
            return f"{key}: dtype {t.dtype}, expected {ref.dtype}"
    return None


def _norm(state: State) -> float:
    """L2 norm over every floating tensor of ``state``."""
    sq = sum(
        float(t.to(torch.float64).pow(2).sum()) for t in state.values() if t.is_floating_point()
    )
    return math.sqrt(sq)


# ----------------------------------------------------------------------------- the method


@register
class DFedAvgM(WholeModelExchange):
    name = CARD.name
    shares = CARD.shares
    Params = CARD.Params
    exchange_after_training = True

    def __init__(self, params: dict[str, Any], ctx: AlgorithmContext):
        super().__init__(params, ctx)
        self.x: State = self.model_state()  # x_i: where this round's training starts
        self._own: State | None = None  # this round's z_i or Δ_i, exact (own dtype)

    def _own_contribution(self) -> State:
        """This round's ``z_i`` (``models``) or ``Δ_i`` (``deltas``), exact; copied from the
        model once per round and shared, read-only, by the snapshot and the merge."""
        if self._own is None:
            z = self.model_state()
            self._own = z if self.params.mixing == "models" else model_delta(z, self.x, fp16=False)
        return self._own

    def snapshot(self) -> State:
        """What peers pull, called by the driver right after training: the trained model
        ``z_i`` (``mixing: models``) or ``Δ_i = z_i − x_i`` (``deltas``); float16 with
        ``fp16_deltas``."""
        self._own = None  # the model was trained since the last call
        own = self._own_contribution()
        if not self.params.fp16_deltas:
            return dict(own)  # nobody writes into these tensors
        return {
            k: v.clamp(-FP16_MAX, FP16_MAX).to(torch.float16) if v.is_floating_point() else v
            for k, v in own.items()
        }

    def merge(self, gossip: dict[str, dict[str, Any]], pulled: dict[str, State]) -> dict[str, Any]:
        """``x_i ← weighted mean of z over {i} and the valid pulled models`` (``models``) or
        ``x_i ← x_i + weighted mean of Δ over {i} and the valid pulled deltas`` (``deltas``);
        load it. Logs ``delta_norm = ‖x_i(new) − x_i(old)‖``."""
        models = self.params.mixing == "models"
        own = self._own_contribution()
        deltas = [own]
        weights = [float(self.ctx.num_samples) if self.params.weighted else 1.0]
        merged_from: list[str] = []
        rejected: dict[str, str] = {}
        for peer in sorted(pulled):
            w = self.peer_weight(gossip.get(peer))
            reason = "no usable sample count" if w is None else check_peer_delta(own, pulled[peer])
            if reason is not None:
                rejected[peer] = reason
                continue
            assert w is not None
            deltas.append(pulled[peer])
            weights.append(w)
            merged_from.append(peer)
        if sum(weights) <= 0:  # own count unusable (n = 0): fall back to uniform
            weights = [1.0] * len(deltas)
        defence = self.ctx.defence
        # deltas are measured against the model's norm (clip), not the own delta's
        scale = None if models else _norm(self.x)
        avg = average_deltas(
            deltas,
            weights,
            lambda states, w: defence.combine(
                states, w, who=[self.ctx.node_id, *merged_from], own=0, scale=scale
            ),
        )
        merged_from = [p for p in merged_from if p not in defence.rejected]
        if models:  # the mean in float32 or wider, back in the model's dtypes
            new_x = {k: v.to(self.x[k].dtype) for k, v in avg.items()}
            step = model_delta(new_x, self.x, fp16=False)
        else:
            new_x, step = apply_delta(self.x, avg), avg
        self.model.load_state_dict(new_x)
        self.x = new_x
        self._own = None
        facts: dict[str, Any] = {"merged_from": merged_from, "delta_norm": round(_norm(step), 6)}
        if rejected:
            facts["rejected"] = rejected
        return facts

    # -- checkpoints ---------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        """``x_i``, where the next training starts and what ``Δ_i`` and ``delta_norm`` are
        measured from; None when it equals the model bit for bit (after the merge, i.e. at the
        end of every round), so a checkpoint holds one copy of the weights. The round's
        cached ``z_i`` / ``Δ_i`` is not kept: it is recomputed from the model and ``x_i``.
        Momentum needs nothing: training makes a fresh optimizer every round."""
        model = self.model.state_dict()
        same = all(
            v.dtype == model[k].dtype and torch.equal(v, model[k].detach().cpu())
            for k, v in self.x.items()
        )
        return {
            "x": None if same else {k: v.detach().to("cpu", copy=True) for k, v in self.x.items()}
        }

    def load_extra_state(self, extra: dict[str, Any]) -> None:
        extra = check_keys(extra, ("x",), "dfedavgm checkpoint extra")
        x = extra["x"]
        if x is None:
            self.x = self.model_state()  # the checkpoint's weights, already loaded
        else:
            x = check_state(x, self.model.state_dict(), "dfedavgm checkpoint x")
            self.x = {k: v.to("cpu", copy=True) for k, v in x.items()}  # x_i lives on the CPU
        self._own = None
