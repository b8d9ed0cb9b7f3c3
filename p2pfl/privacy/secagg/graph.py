"""The masking graph of SecAgg+ (Bell et al. 2020) and the threshold it allows.

Bonawitz et al. 2017 mask every pair of members and share every secret with everyone:
``O(n²)`` key agreements and mask expansions. SecAgg+ masks and shares only along a sparse
graph: member ``u`` agrees pairwise masks with, and hands its Shamir shares to, its
neighbours ``N(u)``, and ``t`` of ``N(u)`` can unmask or recover ``u``.

The graph here is the Harary graph ``H(k, n)`` on a pseudo-random cycle:

1. the ``n`` members are ordered by ``SHA-256(context.info("graph", id))``, a permutation
   every member computes alike and that changes with every round and attempt;
2. the member at position ``i`` is linked to the positions ``i ± 1, ..., i ± ⌈k/2⌉``
   (mod ``n``): a symmetric graph, every member of degree ``2⌈k/2⌉`` (``k`` rounded up to
   even);
3. ``k = None``, or ``2⌈k/2⌉ ≥ n − 1``, gives the complete graph (Bonawitz et al.).

Trade-off: a smaller ``k`` costs ``O(n k)`` instead of ``O(n²)`` work and traffic, but a
member's privacy then rests on its ``k`` neighbours, not on all ``n − 1`` others: an
adversary that controls (or sees drop out) enough of ``N(u)`` learns more, and a member is
recoverable only while ``t`` of its ``k`` neighbours survive. Bell et al. pick
``k = O(log n)`` for a random graph against a fraction of corrupt members; this module
keeps the graph deterministic for a context so no randomness needs to be agreed.

Threshold: ``⌊k/2⌋ < t ≤ k`` (:func:`check_threshold`). ``t > k/2`` means no two
disjoint sets of ``t`` neighbours exist, so an aggregator that tells some members "``u``
survived" and others "``u`` dropped" cannot collect both ``t`` shares of ``u``'s self-mask
seed and ``t`` shares of its masking key; ``t ≤ k`` so ``u`` can be recovered at all. The
round tolerates up to ``k − t`` silent neighbours per member.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from p2pfl.privacy.secagg.context import RoundContext
from p2pfl.privacy.secagg.errors import SecAggError


def roster(node_ids: Iterable[str]) -> tuple[str, ...]:
    """The sorted, duplicate-free members; :class:`SecAggError` on fewer than 2 or a
    non-string id."""
    ids = list(node_ids)
    if any(not isinstance(i, str) or not i for i in ids):
        raise SecAggError("members: every id must be a non-empty string")
    if len(set(ids)) != len(ids):
        raise SecAggError("members: an id appears twice")
    if len(ids) < 2:
        raise SecAggError("members: secure aggregation needs at least 2 members")
    return tuple(sorted(ids))


def neighbourhoods(
    members: Iterable[str], context: RoundContext, neighbours: int | None = None
) -> dict[str, tuple[str, ...]]:
    """``{u: N(u)}`` (each ``N(u)`` sorted, without ``u``) for the members and context."""
    ids = roster(members)
    n = len(ids)
    if neighbours is not None and (
        isinstance(neighbours, bool) or not isinstance(neighbours, int) or neighbours < 1
    ):
        raise SecAggError(f"neighbours must be a positive int or None, got {neighbours!r}")
    half = n if neighbours is None else -(-neighbours // 2)
    if 2 * half >= n - 1:
        return {u: tuple(v for v in ids if v != u) for u in ids}
    cycle = sorted(ids, key=lambda u: hashlib.sha256(context.info("graph", u)).digest())
    position = {u: i for i, u in enumerate(cycle)}
    return {
        u: tuple(
            sorted(
                cycle[(position[u] + sign * step) % n]
                for step in range(1, half + 1)
                for sign in (1, -1)
            )
        )
        for u in ids
    }


def check_threshold(threshold: int, degree: int) -> None:
    """:class:`SecAggError` unless ``⌊degree/2⌋ < threshold ≤ degree``."""
    if isinstance(threshold, bool) or not isinstance(threshold, int):
        raise SecAggError(f"threshold must be an int, got {threshold!r}")
    if not degree // 2 < threshold <= degree:
        raise SecAggError(
            f"threshold {threshold} with {degree} neighbours: it must be more than half "
            f"of them (so no two disjoint sets can unmask both secrets of a member) and at "
            f"most all of them, i.e. in [{degree // 2 + 1}, {degree}]"
        )
