"""The robust-combination layer every method uses in place of its plain mean.

A method combines states with :meth:`Defence.combine` (``Σ w_i s_i / Σ w_i`` under the
``mean`` rule, bit-identical to :func:`~p2pfl.learning.state.weighted_mean`) and screens a
state it would adopt whole with :meth:`Defence.screen`. The rule comes from the topology's
``defence:`` section (docs/design.md, "Robust aggregation"):

- ``mean``: today's weighted mean, nothing refused;
- ``median``, ``trimmed_mean`` (β): coordinate-wise, unweighted (sample counts are claims a
  peer controls);
- ``multikrum`` (f, m): Blanchard et al.'s scores over the ``n − f − 2`` nearest, the ``m``
  best averaged with their weights; the others are refused;
- ``bulyan`` (f): El Mhamdi et al.'s Krum selection then a trimmed coordinate mean;
- ``clip``: a peer's state is accepted when ``‖w_j − w_i‖ ≤ γ·e^(−κt/T)·‖w_i‖`` (the
  BALANCE family), around the node's own state ``w_i`` (index ``own``), then mixed by the
  weighted mean. Under ``privacy.dp`` the bound adds what the round's DP noise alone puts
  between two honest states over the ``m`` coordinates compared,
  ``NOISE_MARGIN·√2·s·√m`` (:attr:`DefenceInputs.noise_spread` ``s``;
  :mod:`p2pfl.privacy.noise_spread`; docs/algorithms.md, "DP and the defence"): without it
  every DP-noised neighbour lies beyond the bound and a DP swarm never merges.
- ``centered_clip`` (the default): a state beyond the round's radius is pulled onto it,
  ``w_i + (w_j − w_i)·τ/‖w_j − w_i‖`` (Karimireddy et al.'s centered clipping, one step),
  never refused: an honest site far from the node still counts, with its pull bounded;
  named in :attr:`Defence.clipped` (the record's ``clipped``). The radius ``τ`` is learnt
  from the round: ``defence.radius`` (2) times the (lower) median distance of the round's
  other states to the reference, so honest sites that all sit far apart (a real
  cross-silo task) count whole while one state far from the others (a sign flip) is
  pulled in close; with fewer than :data:`MEDIAN_INPUTS` other states, BALANCE's bound
  above. A non-finite state is refused (admission refuses it first), and so is a whole
  model to adopt beyond BALANCE's bound (:meth:`Defence.screen`).
- ``defence.spread`` (``k``, ``clip`` only; 0 by default): ``clip``'s bound widens to ``k``
  times the median distance of the round's other states when that is larger.

  Without an own state (an aggregator that did not train) the reference is
  :attr:`DefenceInputs.reference` (its current model's part), else the coordinate-wise
  median of the inputs: a median of one honest and one flipped state is near zero, so a
  trusted reference is what separates them.

In asynchronous rounds (``timing.mode: async``) each input's weight is first multiplied by its
peer's staleness weight ``(1 + τ)^-a`` (:attr:`DefenceInputs.staleness`, docs/algorithms.md,
"Asynchronous rounds"), so every method's mean discounts a stale peer the same way.

The maths is :mod:`p2pfl.learning.robust`'s. What a round measures with (its number, the
reference, the DP noise spread, the staleness weights) is one value, :class:`DefenceInputs`,
which the round code builds and hands over (:meth:`Defence.begin_round`,
:meth:`Defence.take`) before it merges or aggregates, and which an auditor rebuilds from the
round's announcement; the :class:`Defence` holds the configured rule, that value and its
outputs, the peers refused so far in the round and the fallbacks, which the round driver
records (``rejected``, ``defence_fallbacks``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from p2pfl.config.schema import DefenceConfig
from p2pfl.learning import robust
from p2pfl.learning.state import State, weighted_mean

Combine = Callable[..., State]
"""``combine(states, weights, **kw) -> State``: a combination that stands in for the weighted
mean (a :meth:`Defence.combine` with its names bound; ``kw`` as ``weighted_mean`` takes)."""

COORDINATE_RULES = ("median", "trimmed_mean", "bulyan")
"""Rules that build each coordinate from several states: they cannot honour masks, and a
method with its own arithmetic cannot use them (:meth:`Defence.select`)."""
SELECTING_RULES = ("clip", "centered_clip", "multikrum")
"""Rules that keep some of the states (``centered_clip``: pulled within its radius) and mix
those with the weighted mean."""
CLIP_RULES = ("clip", "centered_clip")
"""Rules that measure each state's distance to the reference against the round's bound."""
MEDIAN_INPUTS = 3
"""``centered_clip`` takes its radius from the round's other states when there are at least
this many: a median of fewer is one of them (a lone far peer would set its own radius)."""
CLIPPED_RATIO_MAX = 1e6
"""The largest distance-over-bound ratio recorded in ``clipped`` (finite, for the wire)."""
NOISE_MARGIN = 1.5
"""How many times the DP noise expected between two honest states ``clip`` tolerates: the
noise of a peer whose σ, steps or batch differ from the node's own (its sample count sets
them) may be larger than the node's estimate from its own."""


@dataclass(frozen=True, eq=False)
class DefenceInputs:
    """What the defence measures with in one round, as one value: the round code builds it
    where it merges or aggregates, and an auditor rebuilds the aggregator's from the
    round's announcement (``noise_spread``) and the state the aggregator serves as its
    upload (``reference``), so both measure alike, bit for bit. Compared by identity: it
    holds tensors."""

    round: int = 0
    """The round, which ``clip``'s bound ``γ·e^(−κt/T)`` follows (``t``)."""
    reference: State | None = None
    """A trusted state to measure from when no input is the node's own (an aggregator that
    did not train: its current model's part); not copied, never changed."""
    noise_spread: float = 0.0
    """Under ``privacy.dp``: the standard deviation per coordinate of the noise one round
    leaves in an honest node's weights; 0 without DP."""
    staleness: Mapping[str, float] = field(default_factory=dict)
    """Asynchronous rounds: each stale peer's weight multiplier ``(1 + τ)^-a``
    (docs/algorithms.md, "Asynchronous rounds"); a peer not named counts 1; read-only."""

    def __post_init__(self) -> None:
        # a copy behind a read-only view: the caller's dict cannot change the round's value
        object.__setattr__(self, "staleness", MappingProxyType(dict(self.staleness)))

    def __reduce__(self) -> tuple[type[DefenceInputs], tuple[Any, ...]]:
        # a read-only view neither pickles nor deep-copies (a method's checkpoint does both)
        return DefenceInputs, (self.round, self.reference, self.noise_spread, dict(self.staleness))


class Defence:
    """The configured robust rule of one node, with the round's inputs
    (:class:`DefenceInputs`) and refusals."""

    def __init__(self, cfg: DefenceConfig | None = None, rounds: int = 1):
        self.cfg = cfg if cfg is not None else DefenceConfig(rule="mean")
        self.rounds = max(1, rounds)
        self._inputs = DefenceInputs()
        self.rejected: dict[str, str] = {}  # this round's refusals, peer -> reason
        self.clipped: dict[str, float] = {}  # centered_clip: peer -> its distance / the bound
        self.fallbacks = 0  # combinations with too few inputs for the rule, this round

    @property
    def rule(self) -> str:
        return self.cfg.rule

    @property
    def inputs(self) -> DefenceInputs:
        """The round's inputs, as last handed over."""
        return self._inputs

    def begin_round(self, inputs: DefenceInputs) -> None:
        """Start round ``inputs.round`` measuring with ``inputs``: refusals and fallbacks
        start empty."""
        self._inputs = inputs
        self.rejected = {}
        self.clipped = {}
        self.fallbacks = 0

    def take(self, inputs: DefenceInputs) -> None:
        """Measure the rest of the round with ``inputs``: the round's value with what the
        round code learnt after it began (the aggregator's reference, the staleness of an
        asynchronous round's peers). The refusals and fallbacks so far stand. ``ValueError``
        when ``inputs`` is of another round than the one begun."""
        if inputs.round != self._inputs.round:
            raise ValueError(
                f"defence: inputs of round {inputs.round} in round {self._inputs.round}"
            )
        self._inputs = inputs

    def clip_ratio(self) -> float:
        """``γ·e^(−κt/T)``, the ``clip`` bound of this round relative to ``‖w_i‖``."""
        return robust.clip_bound(self.cfg.gamma, self.cfg.kappa, self._inputs.round, self.rounds)

    def noise_allowance(self, elements: int) -> float:
        """What DP noise alone may put between two honest states over ``elements``
        coordinates (0 without DP): ``clip``'s bound grows by it."""
        return robust.noise_slack(self._inputs.noise_spread, elements, NOISE_MARGIN)

    def _reference(self, states: Sequence[State], names: list[str]) -> State | None:
        """The round's reference over ``names``, when it has the inputs' layout there."""
        return _usable(self._inputs.reference, states[0], names)

    def _refuse(self, peer: str, reason: str) -> None:
        self.rejected.setdefault(peer, reason)

    # ------------------------------------------------------------------ adoption
    def screen(
        self, own: State, candidates: Mapping[str, State], *, scale: float | None = None
    ) -> dict[str, State]:
        """The candidates a node may adopt whole (e.g. UA-PDFL's client-wise dropout): under
        ``clip`` and ``centered_clip``, those within ``clip``'s distance bound of ``own``;
        every other rule has no test for a single state and keeps them all (admission has
        already screened each one). A whole model beyond the bound is refused under
        ``centered_clip`` too: pulled onto the bound it would be a model no peer holds (a
        sign-flipped one pulled onto ``γ‖w_i‖`` is near zero), and a single state gives
        no round to learn a radius from."""
        if self.rule not in CLIP_RULES or not candidates:
            return dict(candidates)
        keys = _floating_keys(own)
        ref = robust.norm(own, keys) if scale is None else scale
        bound = self.clip_ratio() * ref + self.noise_allowance(_elements(own, keys))
        peers = sorted(candidates)
        dists = robust.distances(own, [candidates[p] for p in peers], keys)
        kept: dict[str, State] = {}
        for peer, d in zip(peers, dists, strict=True):
            if math.isfinite(d) and d <= bound:
                kept[peer] = candidates[peer]
            else:
                self._refuse(peer, f"clip: distance {d:.4g} > {bound:.4g}")
        return kept

    # ------------------------------------------------------------------ combination
    def combine(
        self,
        states: Sequence[State],
        weights: Sequence[float],
        *,
        who: Sequence[str],
        own: int | None = 0,
        keys: Iterable[str] | None = None,
        masks: Sequence[Mapping[str, torch.Tensor]] | None = None,
        scale: float | None = None,
    ) -> State:
        """The rule's combination of ``states`` (named by ``who``, weighted by ``weights``;
        ``states[own]`` is the node's own, never refused; ``own=None`` when none is).
        ``keys`` and ``masks`` as :func:`~p2pfl.learning.state.weighted_mean` takes them;
        ``scale`` replaces ``‖w_i‖`` in ``clip``'s bound (e.g. the model's norm when the
        states are deltas). Refused inputs are left out and named in :attr:`rejected`.
        Raises ``ValueError`` as ``weighted_mean`` does, and for masks under a coordinate
        rule."""
        if len(who) != len(states):
            raise ValueError(f"defence: {len(states)} states but {len(who)} names")
        staleness = self._inputs.staleness
        if staleness:  # a stale peer counts less: w_j (1 + τ_j)^-a
            weights = [w * staleness.get(p, 1.0) for w, p in zip(weights, who, strict=True)]
        names = list(states[0]) if keys is None and states else list(keys or [])
        rule = self.rule
        if rule == "mean" or (len(states) == 1 and own == 0):
            return weighted_mean(states, weights, keys, masks=masks)
        if masks is not None and rule in COORDINATE_RULES:
            raise ValueError(f"defence.rule {rule} cannot combine masked states")
        n, f = len(states), self.cfg.f
        try:
            robust.check_bounds(rule, n, f, self.cfg.m, self.cfg.beta)
        except ValueError:
            self.fallbacks += 1  # too few inputs this round: the median still bounds them
            if masks is not None:
                return weighted_mean(states, weights, keys, masks=masks)
            return _own_first(robust.coordinate_median(states, names), states, own, names)
        if rule in SELECTING_RULES:
            chosen = self.select(states, who=who, own=own, keys=names, scale=scale, masks=masks)
            if not chosen:  # no own state and every input too far
                self.fallbacks += 1
                ref = self._reference(states, names)
                if ref is not None:  # nothing trusted came in: the reference stands
                    return {k: v.detach().clone() for k, v in ref.items()}
                return robust.coordinate_median(states, names)
            sel_masks = None if masks is None else [masks[i] for i in chosen]
            return weighted_mean(
                list(chosen.values()), [weights[i] for i in chosen], keys, masks=sel_masks
            )
        if rule == "median":
            return _own_first(robust.coordinate_median(states, names), states, own, names)
        if rule == "trimmed_mean":
            out = robust.trimmed_mean(states, self.cfg.beta, names)
            return _own_first(out, states, own, names)
        if rule == "bulyan":
            out, chosen = robust.bulyan(states, f, names)
            for i in range(n):
                if i not in chosen and i != own:
                    self._refuse(who[i], "bulyan: not selected")
            return _own_first(out, states, own, names)
        raise ValueError(f"defence.rule {rule!r} is unknown")

    def select(
        self,
        states: Sequence[State],
        *,
        who: Sequence[str],
        own: int | None = 0,
        keys: Sequence[str] | None = None,
        scale: float | None = None,
        masks: Sequence[Mapping[str, torch.Tensor]] | None = None,
    ) -> dict[int, State]:
        """The states the rule keeps, by index (ascending), each as it is kept, for a
        method that combines them with its own arithmetic (FedSA, DiversiFed) and for
        :meth:`combine`; the others are named in :attr:`rejected`. ``mean`` keeps all;
        ``clip`` those within the round's bound of ``states[own]`` (or of the reference,
        else the coordinate-wise median, without one); ``centered_clip`` every finite one,
        a state beyond the bound pulled onto it (named in :attr:`clipped`); ``multikrum``
        the ``m`` best scored (the own state always among them). With ``masks`` (sparse
        states, DisPFL's), the clip rules compare each state with the reference on the
        elements both masks hold, and bound by the reference's norm there: an element one
        of them lacks is a zero, not a difference. Rules that build each coordinate from
        several states do not select: ``ValueError``."""
        n = len(states)
        if len(who) != n:
            raise ValueError(f"defence: {n} states but {len(who)} names")
        names = list(states[0]) if keys is None else list(keys)
        rule = self.rule
        if rule == "mean" or (n == 1 and own == 0):
            return dict(enumerate(states))
        if rule in CLIP_RULES:
            return self._clip(states, who, own, names, scale, masks)
        if rule == "multikrum":
            f = self.cfg.f
            try:
                robust.check_bounds(rule, n, f, self.cfg.m, self.cfg.beta)
            except ValueError:
                self.fallbacks += 1  # too few inputs to score: all of them this round
                return dict(enumerate(states))
            m = self.cfg.m if self.cfg.m is not None else n - f
            ranked = robust.multikrum_select(states, f, n, names)  # best score first
            if own is not None:  # the node's own state always counts
                ranked = [own] + [i for i in ranked if i != own]
            chosen = sorted(ranked[: min(m, n)])
            for i in range(n):
                if i not in chosen:
                    self._refuse(who[i], "multikrum: not among the best scored")
            return {i: states[i] for i in chosen}
        raise ValueError(f"defence.rule {rule} does not select states")

    def _clip(
        self,
        states: Sequence[State],
        who: Sequence[str],
        own: int | None,
        names: list[str],
        scale: float | None,
        masks: Sequence[Mapping[str, torch.Tensor]] | None,
    ) -> dict[int, State]:
        """``clip`` and ``centered_clip`` (:meth:`select`): each state's distance to the
        reference against ``clip``'s bound (widened to ``defence.spread`` times the median
        distance of the round's other states when that is larger), or against
        ``centered_clip``'s radius learnt from the round (module docstring)."""
        floating = [k for k in names if torch.is_floating_point(states[0][k])]
        ref = states[own] if own is not None else self._reference(states, names)
        if ref is None:
            ref = robust.coordinate_median(states, names)
        ref_norm = robust.norm(ref, floating) if scale is None else scale
        ratio = self.clip_ratio()
        if masks is None or own is None:
            bound = ratio * ref_norm + self.noise_allowance(_elements(ref, floating))
            pairs = [(d, bound) for d in robust.distances(ref, states, floating)]
        else:
            pairs = []
            for s, m in zip(states, masks, strict=True):
                d, bound, elements = _masked_pair(ref, masks[own], s, m, floating, ratio, scale)
                pairs.append((d, bound + self.noise_allowance(elements)))
        others = [d for i, (d, _) in enumerate(pairs) if i != own]
        radius = None  # centered_clip: the round's own radius, when it has enough states
        if self.rule == "centered_clip":
            radius = robust.median_radius(others, self.cfg.radius, MEDIAN_INPUTS)
        widest = 0.0  # clip: its bound widened to defence.spread medians (0: not at all)
        if radius is None and self.cfg.spread > 0:
            widest = robust.median_radius(others, self.cfg.spread, 1) or 0.0
        kept: dict[int, State] = {}
        for i, (d, bound) in enumerate(pairs):
            bound = max(bound, widest) if radius is None else radius
            if i == own or (math.isfinite(d) and d <= bound):
                kept[i] = states[i]
            elif self.rule == "centered_clip" and math.isfinite(d):
                # every element moves by the factor measured where both masks hold: an
                # element only the peer holds is its claim too, and is bounded alike
                kept[i] = robust.centered_clip(ref, states[i], d, bound, floating)
                self._clip_noted(who[i], d, bound)
            else:
                self._refuse(who[i], f"{self.rule}: distance {d:.4g} > {bound:.4g}")
        return kept

    def _clip_noted(self, peer: str, distance: float, bound: float) -> None:
        """``peer``'s state was pulled onto ``bound``: its distance over the bound, at most
        :data:`CLIPPED_RATIO_MAX` (a bound of 0 when every other state equals the node's)."""
        ratio = distance / bound if bound > 0 else CLIPPED_RATIO_MAX
        self.clipped.setdefault(peer, round(min(ratio, CLIPPED_RATIO_MAX), 4))


def _usable(reference: State | None, like: State, names: list[str]) -> State | None:
    """``reference`` restricted to ``names`` when it holds each with ``like``'s shape."""
    if reference is None:
        return None
    if not all(k in reference and reference[k].shape == like[k].shape for k in names):
        return None
    return {k: reference[k] for k in names}


def _masked_pair(
    ref: State,
    ref_mask: Mapping[str, torch.Tensor],
    state: State,
    mask: Mapping[str, torch.Tensor],
    floating: list[str],
    ratio: float,
    scale: float | None,
) -> tuple[float, float, int]:
    """``(‖(s − ref) ⊙ both‖, ratio · ‖ref ⊙ both‖, elements of both)`` where ``both`` is
    where the two masks hold an element (a key without masks counts whole); ``scale``
    replaces the norm."""
    d2 = r2 = 0.0
    elements = 0
    for k in floating:
        a = ref[k].detach().to(torch.float64)
        b = state[k].detach().to(device=a.device, dtype=torch.float64)
        if k in ref_mask and k in mask:
            both = ref_mask[k].to(a.device).bool() & mask[k].to(a.device).bool()
            a, b = a * both, b * both
            elements += int(both.sum())
        else:
            elements += a.numel()
        d2 += float((b - a).pow(2).sum())
        r2 += float(a.pow(2).sum())
    d = math.sqrt(d2) if math.isfinite(d2) else math.inf
    return d, ratio * (math.sqrt(r2) if scale is None else scale), elements


def _elements(state: State, keys: Iterable[str]) -> int:
    """The coordinates of ``state``'s tensors under ``keys``."""
    return sum(state[k].numel() for k in keys)


def _floating_keys(state: State) -> list[str]:
    return [k for k, v in state.items() if torch.is_floating_point(v)]


def _own_first(out: State, states: Sequence[State], own: int | None, names: list[str]) -> State:
    """Non-floating tensors (counters) come from the node's own state when it has one, as
    the weighted mean takes them from the state put first."""
    if own is None:
        return out
    for k in names:
        if not torch.is_floating_point(states[own][k]):
            out[k] = states[own][k].detach().clone()
    return out
