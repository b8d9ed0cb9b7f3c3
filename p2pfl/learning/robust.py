"""The pure maths of the robust aggregation rules (:mod:`p2pfl.learning.defence` applies them).

- **Coordinate-wise median and trimmed mean**: Yin, Chen, Ramchandran, Bartlett, "Byzantine-
  Robust Distributed Learning: Towards Optimal Statistical Rates", ICML 2018.
- **Krum / Multi-Krum**: Blanchard, El Mhamdi, Guerraoui, Stainer, "Machine Learning with
  Adversaries: Byzantine Tolerant Gradient Descent", NeurIPS 2017. A state's score sums the
  squared distances to its ``n − f − 2`` nearest *other* states, not to all of them.
- **Bulyan**: El Mhamdi, Guerraoui, Rouault, "The Hidden Vulnerability of Distributed
  Learning in Byzantium", ICML 2018.
- **Clip bound** ``γ·e^(−κt/T)``: Fang, Liu, Jia, Gong, "Byzantine-Robust Decentralized
  Federated Learning" (BALANCE), ACM CCS 2024.
- **Centered clipping** ``v + clip_τ(x − v)``: Karimireddy, He, Jaggi, "Learning from
  History for Byzantine Robust Optimization", ICML 2021 (one clipping step, around the
  node's own state ``v``; :mod:`p2pfl.learning.defence` chooses ``τ``).

Conventions, shared with :func:`~p2pfl.learning.state.weighted_mean`:

- A *state* is a ``state_dict``: name → tensor. ``keys`` picks the names used (default: every
  key of the first state, in its order). The inputs of one call share a layout (same keys,
  shapes and dtypes, :func:`~p2pfl.learning.state.layout_mismatch`), else ``ValueError``.
- Only **floating** tensors enter distances, norms and coordinate statistics. In a combined
  state, non-floating tensors (integer buffers such as BatchNorm's ``num_batches_tracked``)
  are a copy of the **first** state's.
- All arithmetic is in **float64**; results are cast back to each tensor's own dtype, live
  on the first state's device and share no storage with the inputs.
- The order of the arithmetic is fixed, so results are **bit-identical** for the same
  inputs on the same device, whatever torch's CPU thread count: every long sum of squares
  goes through :func:`_row_sums`, which reduces fixed 4096-element blocks one output per
  thread (torch never splits a reduction that has several outputs, nor one below its
  32768-element grain, across threads). Scores are summed in Python floats in a stated order.
- **Non-finite states**: a distance or norm involving a NaN or ±inf entry is ``inf`` (never
  NaN), so such a state ranks last and fails every bound. Coordinate rules sort with
  ``torch.sort``, which places NaN above +inf: a NaN coordinate counts as the largest value
  (a trimmed or median statistic can therefore discard it, where ``numpy.median`` would
  return NaN).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from p2pfl.learning.state import State, layout_mismatch

RULES = ("mean", "clip", "centered_clip", "median", "trimmed_mean", "multikrum", "bulyan")

_BLOCK = 4096
"""Length of the blocks :func:`_row_sums` reduces (below torch's 32768-element grain)."""
_ROW_BUDGET = 1 << 24
"""Elements of the float64 difference matrix built at once (128 MiB) in pairwise distances."""

_F64 = torch.float64


# ----------------------------------------------------------------------------- helpers


def _row_sums(x: Tensor) -> Tensor:
    """Sums of the rows of a 2-D ``x``, in an order fixed by the row length alone: each row is
    cut into 4096-element blocks (the last one shorter), every block is summed, and the
    block sums are reduced the same way until at most 4096 remain, then summed. Each single
    sum covers at most 4096 elements, so torch computes it in one thread: the result does
    not depend on the thread count (a plain ``x.sum()`` of a long vector does)."""
    while x.shape[1] > _BLOCK:
        rows, d = x.shape
        full = d // _BLOCK
        head = x[:, : full * _BLOCK].reshape(rows, full, _BLOCK).sum(dim=2)
        if d > full * _BLOCK:
            tail = x[:, full * _BLOCK :].sum(dim=1, keepdim=True)
            head = torch.cat([head, tail], dim=1)
        x = head
    return x.sum(dim=1)


def _names(fn: str, first: Mapping[str, Tensor], keys: Sequence[str] | None) -> list[str]:
    """``keys`` as a list (default: every key of ``first``), each one a tensor of ``first``."""
    names = list(first) if keys is None else list(keys)
    missing = [k for k in names if k not in first]
    if missing:
        raise ValueError(f"{fn}: state 0 lacks {missing[:3]}")
    odd = [k for k in names if not isinstance(first[k], Tensor)]
    if odd:
        raise ValueError(f"{fn}: state 0: {odd[:3]} are not tensors")
    return names


def _checked(
    fn: str, states: Sequence[Mapping[str, Tensor]], keys: Sequence[str] | None
) -> tuple[list[str], list[str]]:
    """The names used and their floating subset; ``ValueError`` unless there is a state and
    every state has the first one's layout on those names (with ``keys=None``: equal key
    sets), as :func:`~p2pfl.learning.state.weighted_mean` checks."""
    if not states:
        raise ValueError(f"{fn} needs at least one state")
    first = states[0]
    if not isinstance(first, Mapping):
        raise ValueError(f"{fn}: state 0: not a map")
    names = _names(fn, first, keys)
    template = first if keys is None else {k: first[k] for k in names}
    for i, state in enumerate(states[1:], start=1):
        view = state
        if keys is not None and isinstance(state, Mapping):
            view = {k: state[k] for k in names if k in state}
        why = layout_mismatch(view, template)  # type: ignore[arg-type]
        if why is not None:
            raise ValueError(f"{fn}: state {i}: {why}")
    return names, [k for k in names if torch.is_floating_point(first[k])]


def _matrix(
    states: Sequence[Mapping[str, Tensor]], floating: Sequence[str], device: torch.device
) -> Tensor:
    """The ``(n, d)`` float64 matrix whose row ``i`` is state ``i``'s floating tensors of
    ``floating``, flattened and concatenated in that order, on ``device``."""
    sizes = [states[0][k].numel() for k in floating]
    x = torch.empty((len(states), sum(sizes)), dtype=_F64, device=device)
    for i, state in enumerate(states):
        at = 0
        for k, size in zip(floating, sizes, strict=True):
            x[i, at : at + size].copy_(state[k].detach().reshape(-1))
            at += size
    return x


def _device(states: Sequence[State], names: Sequence[str]) -> torch.device:
    return states[0][names[0]].device if names else torch.device("cpu")


def _finite_rows(x: Tensor) -> list[bool]:
    return torch.isfinite(x).all(dim=1).tolist()


def _pairwise_sq(x: Tensor) -> list[list[float]]:
    """Squared L2 distances between the rows of ``x``: ``D[i][j] = Σ (x_i − x_j)²`` (summed
    by :func:`_row_sums`), computed once per pair ``i < j`` and mirrored, so ``D`` is exactly
    symmetric with a zero diagonal. A pair with a non-finite row is ``inf``. (``torch.cdist``
    is avoided: its matrix-product shortcut is neither exact nor bit-stable.)"""
    n, d = x.shape
    finite = _finite_rows(x)
    dist = [[0.0] * n for _ in range(n)]
    step = max(1, _ROW_BUDGET // max(1, d))
    for i in range(n - 1):
        for lo in range(i + 1, n, step):
            hi = min(n, lo + step)
            diff = x[lo:hi] - x[i]
            sums = _row_sums(diff.mul_(diff)).tolist()
            for j, s in zip(range(lo, hi), sums, strict=True):
                v = s if finite[i] and finite[j] and not math.isnan(s) else math.inf
                dist[i][j] = dist[j][i] = v
    return dist


def _score(dist: list[list[float]], i: int, among: Sequence[int], nearest: int) -> float:
    """The sum of the ``nearest`` smallest ``dist[i][j]``, ``j`` in ``among`` other than
    ``i``, added in ascending order."""
    row = sorted(dist[i][j] for j in among if j != i)
    total = 0.0
    for v in row[:nearest]:
        total += v
    return total


def _sorted_columns(states: Sequence[State], key: str, device: torch.device) -> Tensor:
    """The ``(n, numel)`` float64 values of ``key`` across ``states``, each column sorted
    ascending (stable, NaN last)."""
    v = torch.stack([s[key].detach().reshape(-1).to(device=device, dtype=_F64) for s in states])
    return torch.sort(v, dim=0, stable=True).values


def _median_of_sorted(srt: Tensor) -> Tensor:
    """Middle row of column-sorted ``srt``; for an even count, the mean of the two middle."""
    n = srt.shape[0]
    if n % 2:
        return srt[n // 2]
    return (srt[n // 2 - 1] + srt[n // 2]) / 2


def _combine(states: Sequence[State], names: Sequence[str], per_key: dict[str, Tensor]) -> State:
    """The output state: ``per_key`` (flat float64) reshaped and cast to each floating key's
    dtype, a copy of the first state's tensor for each non-floating key."""
    first = states[0]
    out: State = {}
    for k in names:
        ref = first[k]
        if k in per_key:
            out[k] = per_key[k].reshape(ref.shape).to(dtype=ref.dtype, copy=True)
        else:
            out[k] = ref.detach().clone()
    return out


# ----------------------------------------------------------------------------- distances


def norm(state: Mapping[str, Tensor], keys: Sequence[str] | None = None) -> float:
    """``‖state‖₂`` over the floating tensors of ``keys`` (default: every key of ``state``,
    in its order; non-floating keys are skipped), in float64 with the fixed summation order
    of the module. ``inf`` when an entry is NaN or ±inf (or the float64 sum overflows);
    ``0.0`` when there is no floating entry. ``ValueError`` for a key ``state`` lacks."""
    names = _names("norm", state, keys)
    floating = [k for k in names if torch.is_floating_point(state[k])]
    if not floating:
        return 0.0
    x = _matrix([state], floating, state[floating[0]].device)
    if not _finite_rows(x)[0]:
        return math.inf
    total = float(_row_sums(x * x)[0])
    return math.sqrt(total) if not math.isnan(total) else math.inf


def distances(
    ref: Mapping[str, Tensor],
    states: Sequence[Mapping[str, Tensor]],
    keys: Sequence[str] | None = None,
) -> list[float]:
    """``‖s − ref‖₂`` for each ``s`` of ``states``, in order, over the floating tensors of
    ``keys`` (default: the floating keys of ``ref``, in its order; a key that is not floating
    in ``ref`` is skipped), computed in float64 on ``ref``'s device. Each state must hold
    every such key with ``ref``'s shape (its dtype may differ: it is cast to float64), else
    ``ValueError``. A state (or ``ref``) with a NaN or ±inf entry is at distance ``inf``."""
    names = _names("distances", ref, keys)
    floating = [k for k in names if torch.is_floating_point(ref[k])]
    template = {k: ref[k] for k in floating}
    for i, state in enumerate(states):
        if not isinstance(state, Mapping):
            raise ValueError(f"distances: state {i}: not a map")
        view = {k: state[k] for k in floating if k in state}
        why = layout_mismatch(view, template, dtype=False)  # type: ignore[arg-type]
        if why is not None:
            raise ValueError(f"distances: state {i}: {why}")
    if not states:
        return []
    if not floating:
        return [0.0] * len(states)
    device = ref[floating[0]].device
    r = _matrix([ref], floating, device)[0]
    if not _finite_rows(r.unsqueeze(0))[0]:
        return [math.inf] * len(states)
    x = _matrix(states, floating, device)
    finite = _finite_rows(x)
    step = max(1, _ROW_BUDGET // max(1, x.shape[1]))
    out: list[float] = []
    for lo in range(0, len(states), step):
        diff = x[lo : lo + step] - r
        out.extend(_row_sums(diff.mul_(diff)).tolist())
    return [
        math.sqrt(s) if ok and not math.isnan(s) else math.inf
        for s, ok in zip(out, finite, strict=True)
    ]


def clip_bound(gamma: float, kappa: float, round_no: int, rounds: int) -> float:
    """BALANCE's acceptance radius relative to ``‖w_i‖`` (Fang et al. 2024):
    ``γ·exp(−κ·t/T)`` with ``t = round_no`` and ``T = rounds`` (``ValueError`` unless
    ``rounds >= 1``). A peer's state ``w_j`` is accepted when
    ``‖w_j − w_i‖ ≤ clip_bound(...)·‖w_i‖``."""
    if rounds < 1:
        raise ValueError(f"clip_bound: rounds must be >= 1 (got {rounds})")
    return float(gamma) * math.exp(-float(kappa) * round_no / rounds)


def median_radius(distances: Sequence[float], factor: float, min_inputs: int) -> float | None:
    """``factor`` times the lower median of the finite ``distances`` (the round's other
    states to the reference), or None when fewer than ``min_inputs`` are finite: a radius
    learnt from the round's own spread, which one far state among several cannot widen
    (the lower median of an even count: one far state of two cannot set it to itself)."""
    finite = sorted(d for d in distances if math.isfinite(d))
    if len(finite) < max(1, min_inputs):
        return None
    return factor * finite[(len(finite) - 1) // 2]


def centered_clip(
    ref: Mapping[str, Tensor],
    state: Mapping[str, Tensor],
    distance: float,
    radius: float,
    keys: Sequence[str],
) -> dict[str, Tensor]:
    """``state`` pulled to within ``radius`` of ``ref`` (Karimireddy et al. 2021's centered
    clipping, one step): ``ref + (state − ref)·radius/distance`` on the floating tensors of
    ``keys`` when ``distance`` (``‖state − ref‖``, as :func:`distances` measures it) exceeds
    ``radius``; ``state`` itself (the same object) otherwise. Other tensors are
    ``state``'s. Computed in float64, cast back to each tensor's dtype, on
    ``state``'s device; ``ValueError`` for a non-finite ``distance`` (nothing finite lies
    on the segment) or a negative ``radius``."""
    if not math.isfinite(distance) or not math.isfinite(radius) or radius < 0:
        raise ValueError(f"centered_clip: distance {distance} and radius {radius} must be finite")
    if distance <= radius:
        return state  # type: ignore[return-value]
    factor = radius / distance
    out = dict(state)
    for k in keys:
        s = state[k]
        if not torch.is_floating_point(s):
            continue
        s64 = s.detach().to(_F64)
        r64 = ref[k].detach().to(device=s.device, dtype=_F64)
        out[k] = (r64 + (s64 - r64) * factor).to(s.dtype)
    return out


# ----------------------------------------------------------------------------- coordinate rules


def coordinate_median(states: Sequence[State], keys: Sequence[str] | None = None) -> State:
    """The coordinate-wise median of ``states`` (Yin et al. 2018), unweighted: per entry of
    each floating tensor, the middle of the ``n`` sorted values, for an even ``n`` the mean
    of the two middle ones (as ``numpy.median`` and Flower's ``aggregate_median``), computed
    in float64 and cast back to the tensor's dtype. NaN sorts above +inf (module docstring).
    Non-floating tensors are copied from the first state. ``ValueError`` for no states or a
    layout mismatch."""
    names, floating = _checked("coordinate_median", states, keys)
    device = _device(states, names)
    per_key = {k: _median_of_sorted(_sorted_columns(states, k, device)) for k in floating}
    return _combine(states, names, per_key)


def trimmed_mean(states: Sequence[State], beta: float, keys: Sequence[str] | None = None) -> State:
    """The coordinate-wise trimmed mean (Yin et al. 2018), unweighted: per entry, the ``n``
    values are sorted, ``k = floor(β·n)`` are cut from each end and the rest averaged — as
    ``scipy.stats.trim_mean(proportiontocut=β)`` and Flower's ``aggregate_trimmed_avg``.
    The kept values are summed in ascending order in float64, divided by ``n − 2k`` and cast
    back to the tensor's dtype; ``β = 0`` is the plain unweighted mean (to rounding: its
    summation order is by value, not by state). NaN sorts above +inf (module docstring).
    Non-floating tensors are copied from the first state. ``ValueError`` unless ``β`` is
    finite and non-negative and ``2k < n``, and for a layout mismatch."""
    names, floating = _checked("trimmed_mean", states, keys)
    n = len(states)
    beta = float(beta)
    if not math.isfinite(beta) or beta < 0:
        raise ValueError(f"trimmed_mean: beta must be finite and >= 0 (got {beta})")
    k = math.floor(beta * n)
    if 2 * k >= n:
        raise ValueError(f"trimmed_mean: cutting {k} of {n} values from each end leaves none")
    device = _device(states, names)
    per_key: dict[str, Tensor] = {}
    for key in floating:
        srt = _sorted_columns(states, key, device)
        acc = srt[k].clone()
        for row in srt[k + 1 : n - k]:
            acc += row
        per_key[key] = acc / (n - 2 * k)
    return _combine(states, names, per_key)


# ----------------------------------------------------------------------------- Krum family


def krum_scores(states: Sequence[State], f: int, keys: Sequence[str] | None = None) -> list[float]:
    """Krum scores (Blanchard et al. 2017): ``score_i`` is the sum of the squared L2
    distances from state ``i`` to its ``n − f − 2`` nearest *other* states (not to all of
    them), over the floating tensors of ``keys``, in float64. Each squared distance is
    ``Σ (x_i − x_j)²`` over the flattened entries (fixed order, see the module docstring);
    a score adds its distances in ascending order. A pair involving a non-finite state is at
    distance ``inf``, so such a state scores ``inf``. ``ValueError`` unless ``f >= 0`` and
    ``n − f − 2 >= 1``, and for a layout mismatch."""
    names, floating = _checked("krum_scores", states, keys)
    n = len(states)
    nearest = n - f - 2
    if f < 0 or nearest < 1:
        raise ValueError(f"krum_scores needs f >= 0 and n >= f + 3 (n = {n}, f = {f})")
    dist = _pairwise_sq(_matrix(states, floating, _device(states, names)))
    everyone = range(n)
    return [_score(dist, i, everyone, nearest) for i in everyone]


def multikrum_select(
    states: Sequence[State], f: int, m: int, keys: Sequence[str] | None = None
) -> list[int]:
    """Multi-Krum's selection (Blanchard et al. 2017): the indexes of the ``m`` states with
    the lowest :func:`krum_scores`, best score first, ties broken by the lower index.
    ``ValueError`` unless ``1 <= m <= n``, and as :func:`krum_scores` raises."""
    scores = krum_scores(states, f, keys)
    n = len(states)
    if not 1 <= m <= n:
        raise ValueError(f"multikrum_select needs 1 <= m <= n (n = {n}, m = {m})")
    return sorted(range(n), key=lambda i: (scores[i], i))[:m]


def bulyan(
    states: Sequence[State], f: int, keys: Sequence[str] | None = None
) -> tuple[State, list[int]]:
    """Bulyan (El Mhamdi et al. 2018) over Krum. Returns ``(state, selected)``.

    1. **Selection**: ``θ = n − 2f`` times, Krum-score the states not yet selected (over
       that remaining set, with the same ``f``) and move the best one (lowest score, ties to
       the lower index) into the selection. Scores use the ``r − f − 2`` nearest of the
       ``r`` remaining states; once ``r − f − 2 < 1`` they use the nearest one (the largest
       valid count, as Flower's ``aggregate_krum``'s ``max(1, ·)``), and a lone remaining
       state (only when ``f = 0``) scores 0. Distances are computed once, as in
       :func:`krum_scores`.
    2. **Aggregation**: per entry of each floating tensor, among the ``θ`` selected values,
       the ``β = θ − 2f`` closest to their coordinate-wise median (as
       :func:`coordinate_median`) are averaged, unweighted: ties in ``|v − median|`` go to
       the state of lower index; the ``β`` values are summed in order of closeness in
       float64, divided by ``β`` and cast back to the tensor's dtype.

    ``selected`` holds the selected indexes, ascending. Non-floating tensors are copied from
    the first state. ``ValueError`` unless ``f >= 0`` and ``n >= 4f + 3``, and for a layout
    mismatch."""
    names, floating = _checked("bulyan", states, keys)
    n = len(states)
    if f < 0 or n < 4 * f + 3:
        raise ValueError(f"bulyan needs f >= 0 and n >= 4f + 3 (n = {n}, f = {f})")
    device = _device(states, names)
    dist = _pairwise_sq(_matrix(states, floating, device))
    remaining = list(range(n))
    chosen: list[int] = []
    for _ in range(n - 2 * f):
        r = len(remaining)
        nearest = min(max(1, r - f - 2), r - 1)
        scores = {i: _score(dist, i, remaining, nearest) for i in remaining}
        best = min(remaining, key=lambda i: (scores[i], i))
        chosen.append(best)
        remaining.remove(best)
    selected = sorted(chosen)
    beta = len(selected) - 2 * f
    picked = [states[i] for i in selected]
    per_key: dict[str, Tensor] = {}
    for key in floating:
        v = torch.stack([s[key].detach().reshape(-1).to(device=device, dtype=_F64) for s in picked])
        med = _median_of_sorted(torch.sort(v, dim=0, stable=True).values)
        order = torch.sort((v - med).abs(), dim=0, stable=True).indices[:beta]
        closest = v.gather(0, order)
        acc = closest[0].clone()
        for row in closest[1:]:
            acc += row
        per_key[key] = acc / beta
    return _combine(states, names, per_key), selected


# ----------------------------------------------------------------------------- bounds


def check_bounds(rule: str, n: int, f: int, m: int | None, beta: float) -> None:
    """``ValueError`` (naming the rule, ``n`` and ``f``) unless ``n`` inputs suffice for
    ``rule`` with ``f`` tolerated Byzantine inputs:

    - ``mean``, ``clip``, ``centered_clip``, ``median``: ``n >= 1``;
    - ``trimmed_mean``: ``2·floor(β·n) < n`` (``β`` finite, ``>= 0``), and ``floor(β·n) >= 1``
      when ``β > 0`` (a trimmed mean that trims nothing is a plain mean: the flaw of a
      trimmed mean built with a β too small for its inputs);
    - ``multikrum``: ``n >= 2f + 3`` and, when ``m`` is given, ``1 <= m <= n``;
    - ``bulyan``: ``n >= 4f + 3``.

    ``f < 0`` and an unknown rule are ``ValueError`` too."""
    where = f"(n = {n}, f = {f})"
    if rule not in RULES:
        raise ValueError(f"defence.rule {rule!r} is unknown; expected one of {', '.join(RULES)}")
    if f < 0:
        raise ValueError(f"defence.rule {rule} needs f >= 0 {where}")
    if n < 1:
        raise ValueError(f"defence.rule {rule} needs n >= 1 inputs {where}")
    if rule == "trimmed_mean":
        b = float(beta)
        if not math.isfinite(b) or b < 0:
            raise ValueError(
                f"defence.rule trimmed_mean needs beta >= 0 (n = {n}, f = {f}, beta = {beta})"
            )
        if 2 * math.floor(b * n) >= n:
            raise ValueError(
                f"defence.rule trimmed_mean needs 2*floor(beta*n) < n inputs "
                f"(n = {n}, f = {f}, beta = {beta})"
            )
        if b > 0 and math.floor(b * n) < 1:  # a trimmed mean that trims nothing is the mean
            raise ValueError(
                f"defence.rule trimmed_mean with beta = {beta} trims nothing from n = {n} "
                f"inputs (f = {f}): beta must be at least 1/n"
            )
    elif rule == "multikrum":
        if n < 2 * f + 3:
            raise ValueError(f"defence.rule multikrum needs n >= 2f + 3 inputs {where}")
        if m is not None and not 1 <= m <= n:
            raise ValueError(
                f"defence.rule multikrum needs 1 <= m <= n (n = {n}, f = {f}, m = {m})"
            )
    elif rule == "bulyan" and n < 4 * f + 3:
        raise ValueError(f"defence.rule bulyan needs n >= 4f + 3 inputs {where}")


def noise_slack(spread: float, elements: int, margin: float) -> float:
    """The distance DP noise alone may put between two honest states over ``elements``
    coordinates: ``margin·√2·s·√elements`` (two independent noises differ by ``√2·s`` per
    coordinate; ``margin`` covers peers whose σ, steps or batch differ from the node's
    own)."""
    if spread <= 0 or elements <= 0:
        return 0.0
    return margin * math.sqrt(2.0) * spread * math.sqrt(elements)
