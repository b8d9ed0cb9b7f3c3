"""Rotating aggregator election (docs/design.md, "Rotating aggregator").

The aggregator of round ``r`` is a pure function of ``r``, the attempt number and the live
membership (from retained presence), so every peer that sees the same members agrees without
a vote. It rotates every round; when the aggregator of an attempt is gone (Last Will) or
misses the deadline, attempt ``a + 1`` falls to the next member in order.
"""

from __future__ import annotations

from collections.abc import Iterable


def aggregator_for(round_no: int, members: Iterable[str], attempt: int = 0) -> str:
    """``sorted(members)[(round_no + attempt) mod n]``; ValueError when nobody is live."""
    ordered = sorted(set(members))
    if not ordered:
        raise ValueError("no live members to elect an aggregator from")
    if round_no < 0 or attempt < 0:
        raise ValueError("round and attempt must be non-negative")
    return ordered[(round_no + attempt) % len(ordered)]


def succession(round_no: int, members: Iterable[str]) -> list[str]:
    """Every member in the order they would take round ``round_no`` over (attempt 0, 1, …)."""
    ordered = sorted(set(members))  # one sort: aggregator_for's order, rotated
    if round_no < 0:
        raise ValueError("round and attempt must be non-negative")
    start = round_no % len(ordered) if ordered else 0
    return ordered[start:] + ordered[:start]
