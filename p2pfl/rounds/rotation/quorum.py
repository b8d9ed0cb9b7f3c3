"""The pure rules of semi-asynchronous centralized rounds (``timing.quorum``;
docs/algorithms.md, "Semi-asynchronous rounds"): when the aggregator closes a round, and
how much a late upload weighs.

- **Quorum**: the round closes once ``ceil(q · L)`` of its ``L`` live expected uploaders
  (the round's participants that are in step, the aggregator included when it trained)
  have reported (:func:`quorum_count`, :func:`close_reason`);
- **deadline**: or once ``min(round_timeout_s, max(MIN_DEADLINE_S, DEADLINE_FACTOR ·
  median(h)))`` seconds have passed since the aggregator's round began, ``h`` the report
  latencies announced by the last :data:`LATENCY_WINDOW` rounds (:func:`close_deadline`;
  ``round_timeout_s`` while there are none);
- **staleness**: an upload trained for round ``t`` and counted in round ``c > t`` weighs
  ``n · (1 + s)^-a`` with ``s = c − t`` and ``a`` = ``timing.staleness_exponent``
  (:func:`staleness_weight`, FedBuff's polynomial discount).

The round driver (:mod:`p2pfl.rounds.rotation.centralized`) and the aggregator's role
(:mod:`p2pfl.rounds.rotation.aggregator`) apply them; the audit (:mod:`p2pfl.rounds.rotation.audit`) recomputes
the weights with :func:`staleness_weight`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Sequence

DEADLINE_FACTOR = 2.0  # the deadline is this multiple of the median report latency
MIN_DEADLINE_S = 1.0  # ... but never shorter (scheduling jitter on a busy host)
LATENCY_WINDOW = 5  # how many recent rounds' announced latencies the deadline reads


def quorum_count(quorum: float, live: int) -> int:
    """``ceil(quorum · live)`` reports close a round of ``live`` live expected uploaders
    (0 when there are none). The product is rounded to 9 decimals first, so that
    ``0.7 · 10`` asks for 7 reports, not 8."""
    if live <= 0:
        return 0
    return max(1, math.ceil(round(quorum * live, 9)))


def close_deadline(latencies: Sequence[float], round_timeout_s: float) -> float:
    """Seconds after the aggregator's round began at which it closes the round without its
    quorum: ``min(round_timeout_s, max(MIN_DEADLINE_S, DEADLINE_FACTOR · median))`` of the
    recent rounds' report ``latencies`` (non-finite or negative values ignored);
    ``round_timeout_s`` when none is known."""
    usable = [float(x) for x in latencies if math.isfinite(x) and x >= 0]
    if not usable:
        return float(round_timeout_s)
    adapted = max(MIN_DEADLINE_S, DEADLINE_FACTOR * statistics.median(usable))
    return float(min(round_timeout_s, adapted))


def close_reason(
    live: Collection[str],
    reported: Collection[str],
    quorum: float,
    now: float,
    close_at: float,
) -> str | None:
    """Why the aggregator closes its round now, or None to keep waiting: ``all`` (every
    ``live`` expected uploader has reported), ``quorum`` (``quorum_count(quorum, |live|)`` of
    them have) or ``deadline`` (``now >= close_at``). ``reported``: the uploaders whose
    report (or, for the aggregator, own upload) is in."""
    got = sum(1 for p in live if p in reported)
    if got >= len(live):
        return "all"
    if got >= quorum_count(quorum, len(live)):
        return "quorum"
    if now >= close_at:
        return "deadline"
    return None


def staleness_weight(n: float, staleness: int, exponent: float) -> float:
    """The weight ``n · (1 + staleness)^-exponent`` of an upload counted ``staleness``
    rounds after the round it was trained for; ``n`` itself (unchanged, an int stays an
    int) when it is fresh (``staleness`` 0), so a round without late uploads weighs as
    before."""
    if staleness <= 0:
        return n
    return float(n) * (1.0 + staleness) ** -float(exponent)


def median_latency(latencies: Sequence[float]) -> float | None:
    """The median of a round's report ``latencies`` (seconds, 4 decimals), None without."""
    if not latencies:
        return None
    return round(float(statistics.median(latencies)), 4)
