"""Admission: what every state and sample count from a peer must pass before a method sees it.

Always on, whatever the ``defence.rule`` (docs/design.md, "Robust aggregation"). A state a
peer serves is checked against the node's own matching state (the reference):

1. **layout**: the same names, shapes and dtypes (:func:`~p2pfl.learning.state.layout_mismatch`);
2. **finite**: no NaN or infinity in any floating tensor;
3. **norm**: ``‖s‖ ≤ ρ · ‖s_own‖`` over the floating tensors (``defence.max_norm_ratio``);
   a zero reference norm bounds nothing.

A claimed sample count is capped at ``max_sample_ratio × median(own n, the round's claims)``
(the median is what one liar cannot move far) and at ``max_samples`` when set, so no member
can claim the weight of the swarm.

Pure functions: the node calls them on every pull (:meth:`~p2pfl.services.exchange.Exchange.pull_many`),
with its reference's norm cached for the round (:class:`ReferenceNorms`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping

import torch

from p2pfl.learning.state import State, TensorStamp, layout_mismatch


def state_norm(state: Mapping[str, torch.Tensor], keys: list[str] | None = None) -> float:
    """The L2 norm of the floating tensors of ``state`` (those of ``keys`` when given), in
    float64; ``inf`` when any of them holds a non-finite value."""
    total = 0.0
    for k in state if keys is None else keys:
        t = state[k]
        if isinstance(t, torch.Tensor) and torch.is_floating_point(t):
            total += float(t.detach().to(torch.float64).pow(2).sum())
    return math.sqrt(total) if math.isfinite(total) else math.inf


def nonfinite_key(state: Mapping[str, torch.Tensor]) -> str | None:
    """The first key whose floating tensor holds a NaN or an infinity, None when all are finite."""
    for k, t in state.items():
        if isinstance(t, torch.Tensor) and torch.is_floating_point(t):
            if not bool(torch.isfinite(t).all()):
                return k
    return None


def admit_state(
    state: object,
    reference: State,
    max_norm_ratio: float,
    *,
    layout: bool = True,
    reference_norm: Callable[[State, list[str]], float] = state_norm,
) -> str | None:
    """None when ``state`` may reach a method, else the reason it may not (for the record,
    the log and the drop counters). ``layout=False`` skips the layout check (a method's
    ``apply`` checks a result's layout itself) and compares norms over the keys both hold.
    ``reference_norm(reference, keys)``: the reference's norm over ``keys`` (default
    :func:`state_norm`; a caller admitting many states against one reference caches it:
    :class:`ReferenceNorms`)."""
    if not isinstance(state, Mapping):
        return "not a map"
    if layout:
        why = layout_mismatch(state, reference)
        if why is not None:
            return why
    elif any(not isinstance(v, torch.Tensor) for v in state.values()):
        return "a value is not a tensor"
    bad = nonfinite_key(state)
    if bad is not None:
        return f"non-finite values in {bad!r}"
    shared = [
        k for k in reference if k in state and tuple(state[k].shape) == tuple(reference[k].shape)
    ]
    ref_norm = reference_norm(reference, shared)
    if ref_norm > 0 and math.isfinite(ref_norm):
        mine = state_norm(state, shared)
        if mine > max_norm_ratio * ref_norm:
            return f"norm {mine:.4g} > {max_norm_ratio:g} x own {ref_norm:.4g}"
    return None


class ReferenceNorms:
    """:func:`state_norm` of references, each computed once: a node admits every peer's
    state of a round against the same reference (its own snapshot's part), so its norm is
    cached by the reference's tensors (the same objects, unchanged: torch's version
    counters) and the keys. :meth:`clear` forgets them (each round)."""

    def __init__(self) -> None:
        self._norms: dict[tuple[str, ...], tuple[TensorStamp, float]] = {}

    def clear(self) -> None:
        self._norms = {}

    def __call__(self, reference: State, keys: list[str]) -> float:
        stamp = TensorStamp.of(reference[k] for k in keys)
        if stamp is None:
            return state_norm(reference, keys)
        hit = self._norms.get(tuple(keys))
        if hit is not None and stamp.matches(hit[0]):
            return hit[1]
        norm = state_norm(reference, keys)
        self._norms[tuple(keys)] = (stamp, norm)
        return norm


def sample_cap(own_n: int, claims: Mapping[str, int], ratio: float, cap: int | None) -> int:
    """The largest sample count a peer may claim this round: ``ratio × median`` of the
    node's own count and the claims, at most ``cap`` when set (at least 1)."""
    counts = [max(own_n, 1), *claims.values()]
    bound = int(ratio * statistics.median(counts))
    if cap is not None:
        bound = min(bound, cap)
    return max(bound, 1)


def cap_claims(
    own_n: int, claims: Mapping[str, int], ratio: float, cap: int | None
) -> tuple[dict[str, int], dict[str, int]]:
    """``(claims capped at sample_cap, the claims that were capped as claimed)``."""
    bound = sample_cap(own_n, claims, ratio, cap)
    capped = {p: n for p, n in claims.items() if n > bound}
    return {p: min(n, bound) for p, n in claims.items()}, capped
