"""The aggregator's side of semi-asynchronous centralized rounds (``timing.quorum``;
docs/algorithms.md, "Semi-asynchronous rounds"), applying the pure rules of
:mod:`p2pfl.rounds.rotation.quorum`: when an attempt's collection closes (:meth:`QuorumClose.close`),
which late offers it counts (:meth:`QuorumClose.late_offers_for`), and the report latency
its announcement carries (:meth:`QuorumClose.latency`), from what it keeps: the late
offers heard, when each report arrived and each round began here, and the latencies
recent announcements carried. The aggregator's role
(:class:`~p2pfl.rounds.rotation.aggregator.AggregatorRole`) owns one.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from p2pfl.learning.state import State
from p2pfl.rounds.rotation.late import LateOffers
from p2pfl.rounds.rotation.plans import RoundPlan, waits_on
from p2pfl.rounds.rotation.quorum import (
    LATENCY_WINDOW,
    close_deadline,
    close_reason,
    median_latency,
    quorum_count,
)
from p2pfl.services.bundle import NodeServices
from p2pfl.wire.envelope import Envelope

Key = tuple[int, int]  # (round, attempt)


@dataclass(frozen=True)
class Closing:
    """How an attempt's collection closed: the reports its quorum needed, what closed it
    (``all``, ``quorum`` or ``deadline``) and the deadline it had, in seconds."""

    needed: int
    closed_by: str
    deadline_s: float

    def record(self) -> dict[str, Any]:
        """The record's ``quorum``."""
        return {"needed": self.needed, "closed_by": self.closed_by, "deadline_s": self.deadline_s}


class QuorumClose:
    """One node's quorum rounds as an aggregator. ``late``: the node's late offers, whose
    :meth:`~p2pfl.rounds.rotation.late.LateOffers.counted_before` says whether an upload offered late
    was counted already (or cannot be told: then it is refused; None: nothing can be told),
    and whose ``max_late`` is the most rounds a late upload may be counted after its own
    (0 without)."""

    def __init__(
        self,
        services: NodeServices,
        late: LateOffers | None = None,
    ) -> None:
        self.services = services
        self.id = services.id
        self.cfg = services.cfg
        self.late = late
        self.max_late = 0 if late is None else late.max_late
        self.late_reports: dict[Key, dict[str, dict[str, Any]]] = {}
        self.offers: dict[int, tuple[int, dict[str, Any]]] = {}  # round -> (t, report)
        self.arrived: dict[Key, dict[str, float]] = {}
        self.started: dict[int, float] = {}
        self.ready: dict[int, float] = {}  # when this node's own upload of a round was kept
        self.latencies: deque[float] = deque(maxlen=LATENCY_WINDOW)

    # ------------------------------------------------------------------ what it keeps
    def round_started(self, round_no: int) -> None:
        """This node began round ``round_no`` (its report latencies are measured from now)."""
        self.started.setdefault(round_no, time.monotonic())

    def upload_kept(self, round_no: int) -> None:
        """This node's own upload of round ``round_no`` is ready now."""
        self.ready[round_no] = time.monotonic()

    def arrived_now(self, key: Key, sender: str) -> None:
        """A fresh report of ``sender`` to ``key`` arrived now (its first one counts)."""
        self.arrived.setdefault(key, {}).setdefault(sender, time.monotonic())

    def keep_late(self, env: Envelope, n: int, report: dict[str, Any]) -> bool:
        """Keep the late report in ``env`` (its sample count ``n`` and method's ``report``
        checked); drop it and return False when late reports have no meaning (no quorum) or
        its round is not one a late upload may come from."""
        trained = env.body["late"]
        if self.cfg.timing.quorum is None:
            self.services.ledger.drop("malformed", f"late report from {env.sender}: no quorum")
            return False
        if not isinstance(trained, int) or isinstance(trained, bool):
            self.services.ledger.drop("malformed", f"late report from {env.sender}: bad round")
            return False
        if not 1 <= env.round - trained <= self.max_late:
            self.services.ledger.drop(
                "stale_upload", f"late report {trained} for {env.round} from {env.sender}"
            )
            return False
        late = {"n": n, "report": report, "trained": trained}
        self.late_reports.setdefault((env.round, env.attempt), {})[env.sender] = late
        return True

    def offer_late(self, round_no: int, trained: int, report: dict[str, Any]) -> None:
        """This node offers its upload of round ``trained`` (its ``report`` message) to
        round ``round_no``."""
        self.offers[round_no] = (trained, report)

    def offered(self, round_no: int) -> int | None:
        """The round whose upload this node offered late to ``round_no`` (None: none)."""
        offer = self.offers.get(round_no)
        return None if offer is None else offer[0]

    def forget(self, floor: int) -> None:
        """Drop what was kept of round ``floor`` and before."""
        for d in (self.late_reports, self.arrived):
            for key in [k for k in d if k[0] <= floor]:
                del d[key]
        for d2 in (self.offers, self.started, self.ready):
            for r in [r for r in d2 if r <= floor]:
                del d2[r]

    # ------------------------------------------------------------------ one attempt
    async def close(
        self,
        plan: RoundPlan,
        attempt: int,
        fresh: bool,
        superseded: Callable[[], bool],
        t0: float,
        expected: list[str],
        got: Callable[[], Mapping[str, Any]],
    ) -> Closing:
        """Wait until :func:`~p2pfl.rounds.rotation.quorum.close_reason` closes attempt ``attempt``:
        every live expected uploader reported (``got()``: the reports in so far), or
        ``ceil(quorum · live)`` of them (this node counts when it trained, ``fresh``), or the
        deadline adapted from :attr:`latencies`, measured from this node's start of the
        round, passed (never later than ``round_timeout_s`` after the collection began,
        ``t0``)."""
        svc, cfg, r = self.services, self.cfg, plan.round
        quorum = float(cfg.timing.quorum or 1.0)
        deadline_s = close_deadline(list(self.latencies), cfg.timing.round_timeout_s)
        start = self.started.get(r, t0)
        close_at = min(start + deadline_s, t0 + cfg.timing.round_timeout_s)
        mine = [self.id] if fresh else []

        def reason() -> tuple[str | None, int]:
            reports = got()
            live = [*mine, *(p for p in expected if waits_on(svc, p, r))]
            reported = {*mine, *(p for p in expected if p in reports)}
            why = close_reason(live, reported, quorum, time.monotonic(), close_at)
            return why, quorum_count(quorum, len(live))

        await svc.peers.wait_for(lambda: superseded() or reason()[0] is not None, close_at)
        why, needed = reason()
        return Closing(needed, why or "deadline", round(deadline_s, 4))

    def late_offers_for(
        self,
        r: int,
        attempt: int,
        reports: Mapping[str, Any],
        fresh: bool,
        uploads: Mapping[int, State],
    ) -> dict[str, dict[str, Any]]:
        """The late offers attempt ``attempt`` of round ``r`` counts: from members whose
        fresh upload of the round is not in (``reports``), trusted, whose offered upload was
        not counted already; this node's own offer when it has no fresh upload of the round
        (``fresh``; ``uploads``: this node's uploads by round)."""
        out: dict[str, dict[str, Any]] = {}
        for peer, late in sorted(self.late_reports.get((r, attempt), {}).items()):
            if peer in reports or peer == self.id or not self.services.robust.trusted(peer, r):
                continue
            if self._counted(peer, late["trained"]):
                self.services.ledger.drop(
                    "stale_upload", f"late {late['trained']} from {peer}: counted"
                )
                continue
            out[peer] = late
        offer = self.offers.get(r)
        if not fresh and offer is not None:
            trained, report = offer
            if trained in uploads and not self._counted(self.id, trained):
                out[self.id] = {"n": report["n"], "report": report["report"], "trained": trained}
        return out

    def _counted(self, peer: str, trained: int) -> bool:
        return self.late is None or self.late.counted_before(peer, trained)

    def latency(
        self, r: int, attempt: int, reports: Mapping[str, Any], own: dict[str, Any] | None
    ) -> float | None:
        """The median latency of the round's counted fresh reports (and of this node's own
        upload when it reported, ``own``), each from this node's start of the round to its
        arrival, in seconds."""
        start = self.started.get(r)
        if start is None:
            return None
        arrived = self.arrived.get((r, attempt), {})
        times = [arrived[p] for p in reports if p in arrived]
        if own is not None and r in self.ready:
            times.append(self.ready[r])
        return median_latency([max(0.0, t - start) for t in times])
