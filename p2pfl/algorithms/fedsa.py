"""FedSA: parameter-skew-aware aggregation (one global model).

Implements docs/algorithms.md, "FedSA" (Wang, Liao, Yuan, Zhang: "The Key of Parameter Skew in
Federated Learning", 2024), a server rule replacing FedAvg's mean. For each floating parameter
tensor, stacked as ``w ∈ R^{K×M}`` (K clients, M elements):

1. ``μ = mean_k w``, ``s = (w − μ)²``, ``cv = sqrt(mean_k s) / |μ|`` (paper eq. 2–4);
2. ``cv`` min–max normalised over the tensor; ``r_h = cv_norm > cv_t``, ``r_l`` the rest,
   ``ŵ_l = r_l ⊙ μ`` (eq. 5–7);
3. MIC: each client's normalised squared deviation binned into ``C_mic`` categories on the
   ``r_h`` positions (eq. 8–9);
4. ``SIM(a,b) = 1 − #(mic_a ≠ mic_b) / #r_h`` (eq. 10);
5. MAC: greedy agglomerative clustering into at most ``S`` clusters (paper §"Macro-Classes");
6. per cluster: ``MAC^s`` = most frequent category per position, ``w̄^s`` = its clients' mean
   (eq. 11–12);
7. ``ŵ_h = r_h ⊙ Σ_s α_s ⊙ w̄^s`` (eq. 15) with the reading of ``α_s`` below;
8. ``ŵ = ŵ_l + ŵ_h`` (eq. 13).

**Reading** (``α_s``, eq. 14 is garbled; docs/algorithms.md, "FedSA"): at each high position
``α_s`` is proportional to the number of clusters (``s`` included) whose MAC category equals
cluster ``s``'s there, normalised to sum to 1 over the clusters. ŵ is therefore a convex
combination of the clients' values at every position.

**Reading** (MIC binning, eq. 8): ``I_c = 𝕀(c/N ≥ s > (c−1)/N)`` needs ``s`` in [0, 1] and
does not define ``N``. Here ``N = C_mic`` and ``s`` is min–max normalised *per position over
the K clients* (as eq. 5 does for ``cv``), so category ``c ∈ 1..C`` says where a client's
deviation lies between the closest (category 1, the first bin closed at 0) and the farthest
client (category ``C``) at that position. A tensor-wide normalisation would be dominated by a
few extreme positions and put nearly every client in category 1. Where the clients' deviations
are all equal (range ``≤ eps · max_k s``, which absorbs rounding noise) every client gets
category 1. Off the high positions the id is 0 (the ``r_h ⊙`` of eq. 9).

**Reading** (MAC clustering): the greedy loop repeatedly takes the single most similar option
among "free client joins a cluster" (cluster similarity = mean similarity to its members) and,
while fewer than ``S`` clusters exist, "two free clients form a new cluster"; ties go to the
join, then to the lower index. ``sim_t`` applies to every merge (docs/algorithms.md, "FedSA":
"a client whose best similarity is below ``sim_t`` stays unclustered"; the paper states it only
once ``S`` clusters exist): the loop stops when the best option is ``< sim_t``. Unclustered
clients are **excluded** from ``ŵ_h`` (the paper's sensitivity study: a high ``sim_t`` "reduces
the number of training clients"); they still count in ``μ``, in ``cv`` and in ``ŵ_l``. When no
cluster forms at all, the high positions fall back to the low-region mean. Clustering is per
tensor (the paper works on "the j-th layer").

**Reading** (guards): ``cv = sqrt(mean_k s) / max(|μ|, eps)``, so a position where every
client holds 0 has ``cv = 0``; a position with ``μ ≈ 0`` but spread gets a huge (finite) ``cv``
and, through the min–max normalisation, may leave few other positions above ``cv_t`` — that is
eq. 4–5 as written (``high_fraction`` in the facts shows it). Measured: the ``cnn`` with 10
clients each perturbed by 2% Gaussian noise gives ``high_fraction`` ≈ 2e-5, i.e. FedSA is then
almost exactly FedAvg. A ``cv`` range ``≤ eps`` means no
high positions. A position where all clients agree returns exactly their common value.

**Reading** (``weighted``): the paper's ``ŵ_l`` is the plain client mean; ``weighted: true``
uses the sample-weighted mean there instead (``cv``, MIC and ``w̄^s`` stay unweighted).
Non-floating tensors (BatchNorm's ``num_batches_tracked``) are taken from the client with the
largest sample count. Arithmetic is in float64, cast back to each tensor's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from p2pfl.algorithms.base import (
    Aggregate,
    CentralizedAlgorithm,
    State,
    Upload,
    kept_uploads,
    register,
)
from p2pfl.algorithms.cards.fedsa import CARD, FedSAParams
from p2pfl.algorithms.fedavg import check_received
from p2pfl.learning.defence import SELECTING_RULES

# ----------------------------------------------------------------------------- pure math

_CHUNK_ELEMS = 1 << 24  # K × columns per one-hot matmul chunk (64 MiB of float32)


def dispersion_split(w: torch.Tensor, cv_t: float, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1–2: ``(μ, r_h)`` for ``w`` (K×M). ``cv = sqrt(mean_k (w − μ)²) / max(|μ|, eps)``,
    min–max normalised over the M positions; ``r_h = cv_norm > cv_t`` (bool, M). A cv range
    ``≤ eps`` gives no high positions."""
    mu = w.mean(dim=0)
    std = (w - mu).pow(2).mean(dim=0).sqrt()
    cv = std / mu.abs().clamp_min(eps)
    lo, hi = cv.min(), cv.max()
    span = hi - lo
    if not bool(span > eps):
        return mu, torch.zeros_like(mu, dtype=torch.bool)
    return mu, (cv - lo) / span > cv_t


def mic_categories(
    w: torch.Tensor, mu: torch.Tensor, high_mask: torch.Tensor, c_mic: int, eps: float
) -> torch.Tensor:
    """Step 3: MIC map (long, K×M): category ``1..c_mic`` on the high positions, 0 elsewhere.

    ``s = (w − μ)²`` is min–max normalised per position over the clients and binned as
    ``c = ceil(s_norm · C)`` clamped to ``[1, C]`` (bins ``((c−1)/C, c/C]``, the first closed at
    0). Positions whose deviation range is ``≤ eps · max_k s`` put every client in category 1."""
    s = (w - mu).square_()
    lo = s.amin(dim=0)
    hi = s.amax(dim=0)
    span = hi - lo
    flat = span <= eps * hi  # also true where every client agrees (hi = 0)
    span = torch.where(flat, torch.ones_like(span), span)
    s.sub_(lo).div_(span).mul_(c_mic).ceil_().clamp_(1, c_mic)
    s.masked_fill_(flat.expand_as(s), 1)
    cat = s.to(torch.long)
    return cat.masked_fill_(~high_mask.expand_as(cat), 0)


def client_similarity(mic: torch.Tensor, high_mask: torch.Tensor) -> torch.Tensor:
    """Step 4: ``SIM(a,b) = 1 − #(mic_a ≠ mic_b on r_h) / #r_h`` (float64, K×K). With no high
    positions every pair is fully similar."""
    k = mic.shape[0]
    cols = mic if bool(high_mask.all()) else mic[:, high_mask]
    n_high = cols.shape[1]
    if n_high == 0:
        return torch.ones(k, k, dtype=torch.float64)
    matches = torch.zeros(k, k, dtype=torch.float64)
    chunk_cols = max(1, _CHUNK_ELEMS // k)  # ≤ 2^24 columns: float32 counts stay exact
    first, last = int(cols.min()), int(cols.max())
    for start in range(0, n_high, chunk_cols):  # matches = Σ_c E_c E_cᵀ, E_c one-hot of c
        chunk = cols[:, start : start + chunk_cols]
        for c in range(first, last + 1):
            e = (chunk == c).to(torch.float32)
            matches += (e @ e.T).double()
    return 1.0 - (n_high - matches) / n_high


def mac_clusters(sim: torch.Tensor, s_mac: int, sim_t: float) -> list[list[int]]:
    """Step 5: greedy agglomerative clustering of the K clients by ``sim`` (K×K).

    Repeatedly takes the most similar option: a free client joins a cluster (similarity = mean
    over the cluster's members) or, while fewer than ``s_mac`` clusters exist, two free clients
    form a new one; ties prefer the join, then lower indices. Stops when the best option is
    ``< sim_t`` (those clients stay unclustered) or every client is placed. K = 1: ``[[0]]``."""
    s = sim.detach().to("cpu", torch.float64).numpy()
    k = s.shape[0]
    if k <= 1:
        return [list(range(k))]
    clusters: list[list[int]] = []
    free = list(range(k))
    while free:
        best_val, best = -np.inf, None
        for ci, members in enumerate(clusters):
            scores = s[np.ix_(free, members)].mean(axis=1)
            j = int(np.argmax(scores))
            if scores[j] > best_val:
                best_val, best = float(scores[j]), ("join", free[j], ci)
        if len(clusters) < s_mac and len(free) >= 2:
            sub = s[np.ix_(free, free)].copy()
            np.fill_diagonal(sub, -np.inf)
            a, b = np.unravel_index(int(np.argmax(sub)), sub.shape)
            if sub[a, b] > best_val:
                best_val, best = float(sub[a, b]), ("pair", free[min(a, b)], free[max(a, b)])
        if best is None or best_val < sim_t:
            break
        if best[0] == "join":
            clusters[best[2]].append(best[1])
            free.remove(best[1])
        else:
            clusters.append([best[1], best[2]])
            free.remove(best[1])
            free.remove(best[2])
    return [sorted(c) for c in clusters]


def mac_alpha(mic: torch.Tensor, clusters: list[list[int]], c_mic: int) -> torch.Tensor:
    """Steps 6–7: ``α`` (float64, S×M). ``MAC^s`` = most frequent MIC category of cluster s per
    position (ties: the lower id); ``α_s`` ∝ the number of clusters sharing ``MAC^s`` there,
    normalised to sum to 1 over the clusters (the reading of docs/algorithms.md, "FedSA")."""
    m = mic.shape[1]
    macs = []
    for members in clusters:
        counts = torch.zeros(c_mic + 1, m, dtype=torch.int32)
        ones = torch.ones(1, 1, dtype=torch.int32).expand(len(members), m)
        counts.scatter_add_(0, mic[members], ones)
        macs.append(counts.argmax(dim=0))
    mac = torch.stack(macs)  # S×M
    per_cat = torch.zeros(c_mic + 1, m, dtype=torch.float64)
    per_cat.scatter_add_(0, mac, torch.ones_like(mac, dtype=torch.float64))
    share = per_cat.gather(0, mac)  # clusters sharing cluster s's category, s included
    return share / share.sum(dim=0, keepdim=True)


def _fedsa_tensor(
    w: torch.Tensor,
    cv_t: float,
    sim_t: float,
    c_mic: int,
    s_mac: int,
    eps: float,
    weights: torch.Tensor | None,
) -> tuple[torch.Tensor, int, list[list[int]] | None]:
    """:func:`fedsa_tensor` plus ``(#high positions, clusters or None when not clustered)``."""
    w = w.to(torch.float64)
    k = w.shape[0]
    if k == 1:
        return w[0].clone(), 0, None
    mu, high = dispersion_split(w, cv_t, eps)
    base = mu
    if weights is not None:
        wt = weights.to(torch.float64)
        if float(wt.sum()) > 0:
            base = (wt[:, None] * w).sum(dim=0) / wt.sum()
    out = base.clone()
    n_high = int(high.sum())
    clusters: list[list[int]] | None = None
    if n_high > 0:
        wh = w[:, high]  # work on the high columns only
        all_high = torch.ones(n_high, dtype=torch.bool)
        mic = mic_categories(wh, mu[high], all_high, c_mic, eps)
        clusters = mac_clusters(client_similarity(mic, all_high), s_mac, sim_t)
        if clusters:
            alpha = mac_alpha(mic, clusters, c_mic)
            means = torch.stack([wh[c].mean(dim=0) for c in clusters])  # w̄^s, S×M_h
            out[high] = (alpha * means).sum(dim=0)
    lo, hi = w.min(dim=0).values, w.max(dim=0).values
    out = torch.minimum(torch.maximum(out, lo), hi)  # a no-op in exact arithmetic
    out = torch.where(lo == hi, w[0], out)  # all clients agree: exactly their value
    return out, n_high, clusters


def fedsa_tensor(
    w: torch.Tensor,
    cv_t: float = 0.2,
    sim_t: float = 0.2,
    c_mic: int = 4,
    s_mac: int = 4,
    eps: float = 1e-12,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Steps 1–8 for one tensor ``w`` (K×M): the aggregated values (float64, M).

    ``weights`` (K sample counts) switches ``ŵ_l`` to the weighted mean; None: the paper's
    plain mean. K = 1 returns that client's values; no high positions: the mean."""
    return _fedsa_tensor(w, cv_t, sim_t, c_mic, s_mac, eps, weights)[0]


def fedsa_aggregate_states(
    states: Sequence[State],
    weights: Sequence[float],
    params: FedSAParams,
    stats: dict[str, Any] | None = None,
) -> State:
    """Apply :func:`fedsa_tensor` to every floating tensor of ``states`` (same keys/shapes).

    Each tensor is flattened to K×M and the result cast back to its dtype and shape.
    Non-floating tensors come from the client with the largest weight (first on ties).
    ``stats``, when given, receives ``high_fraction`` (share of high-dispersion positions over
    all floating elements), ``clusters`` and ``unclustered`` (means over the tensors that were
    clustered; 0 when none)."""
    if not states:
        raise ValueError("fedsa_aggregate_states needs at least one state")
    if len(weights) != len(states):
        raise ValueError("one weight per state is required")
    k = len(states)
    lead = max(range(k), key=lambda i: (float(weights[i]), -i))
    wt = torch.tensor([float(x) for x in weights], dtype=torch.float64)
    p = params
    out: State = {}
    total = high = 0
    n_clusters: list[int] = []
    n_unclustered: list[int] = []
    for key, ref in states[0].items():
        if not torch.is_floating_point(ref):
            out[key] = states[lead][key].clone()
            continue
        w = torch.stack([st[key].reshape(-1).to(torch.float64) for st in states])
        agg, n_high, found = _fedsa_tensor(
            w, p.cv_t, p.sim_t, p.c_mic, p.s_mac, p.eps, wt if p.weighted else None
        )
        out[key] = agg.to(ref.dtype).reshape(ref.shape)
        total += w.shape[1]
        high += n_high
        if found is not None:
            n_clusters.append(len(found))
            n_unclustered.append(k - sum(len(c) for c in found))
    if stats is not None:
        stats["high_fraction"] = high / total if total else 0.0
        stats["clusters"] = float(np.mean(n_clusters)) if n_clusters else 0.0
        stats["unclustered"] = float(np.mean(n_unclustered)) if n_unclustered else 0.0
    return out


# ----------------------------------------------------------------------------- the method


@register
class FedSA(CentralizedAlgorithm):
    name = CARD.name
    shares = CARD.shares
    Params = CARD.Params
    upload_part = "all"
    defences = ("mean", *SELECTING_RULES)  # its own arithmetic: over the states kept

    def aggregate(
        self,
        uploads: dict[str, Upload],
        server: dict[str, Any],
        roster: list[str],
        round_no: int,
    ) -> Aggregate:
        """One global model from the uploads the aggregator's defence keeps (docs/design.md,
        "Robust aggregation"); every uploader receives it (the same object)."""
        everyone = sorted(uploads)
        kept = kept_uploads(uploads, self.ctx.defence, self.ctx.node_id)
        nodes = sorted(kept)
        stats: dict[str, Any] = {}
        glob = fedsa_aggregate_states(
            [kept[n].state for n in nodes], [kept[n].n for n in nodes], self.params, stats
        )
        facts = {
            "high_fraction": round(float(stats["high_fraction"]), 6),
            "clusters": round(float(stats["clusters"]), 4),
            "unclustered": round(float(stats["unclustered"]), 4),
        }
        return Aggregate(results={n: glob for n in everyone}, common=glob, facts=facts)

    def apply(self, received: State, announcement: dict[str, Any]) -> dict[str, Any]:
        """Install the global model (whole state, strict). Raises ``ValueError``, before
        anything changes, unless ``received`` has the model's keys, shapes and dtypes."""
        own = self.model.state_dict()
        check_received(list(own), received, own, "all")
        dev = self.ctx.device
        self.model.load_state_dict({k: v.to(dev) for k, v in received.items()}, strict=True)
        return {}
