"""A member's side of semi-asynchronous centralized rounds (``timing.quorum``;
docs/algorithms.md, "Semi-asynchronous rounds"): what each round it applied counted, and
the uploads it offered late. A participant whose round closed without it offers its upload
to the round after the newest one announced (:meth:`LateOffers.offer`); an aggregator asks
:meth:`LateOffers.counted_before` whether an upload offered late was counted already. The
aggregator's side is :mod:`p2pfl.rounds.rotation.quorum_close`; the rules, :mod:`p2pfl.rounds.rotation.quorum`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from p2pfl.rounds.rotation.election import succession
from p2pfl.rounds.rotation.rotation import Rotation
from p2pfl.services.bundle import NodeServices
from p2pfl.wire.errors import TransportError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Counted:
    """What one applied round counted: its participants (None when this node observed it),
    the uploads aggregated, and each late one's staleness."""

    participants: list[str] | None
    aggregated: list[str]
    late: dict[str, int]


@dataclass(frozen=True)
class LateOffer:
    """This node's upload of round ``trained`` offered late to round ``round``
    (``staleness`` rounds after its own) as ``report`` (``{n, report, late}``), sent to
    ``aggregator``, the first aggregator of that round."""

    round: int
    trained: int
    staleness: int
    report: dict[str, Any]
    aggregator: str

    def record(self) -> dict[str, int]:
        """The record's ``offered_late``."""
        return {"round": self.round, "staleness": self.staleness}


class LateOffers:
    """The rounds one node applied (:attr:`counted`) and its late offers (:attr:`offers`,
    round offered to → report message). ``max_late``: the most rounds a late upload may be
    counted after its own."""

    def __init__(self, services: NodeServices, rotation: Rotation, max_late: int) -> None:
        self.services = services
        self.id = services.id
        self.cfg = services.cfg
        self.rotation = rotation
        self.max_late = max_late
        self.counted: dict[int, Counted] = {}
        self.offers: dict[int, dict[str, Any]] = {}

    def note(self, round_no: int, counted: Counted) -> None:
        """Round ``round_no`` was applied, counting ``counted``."""
        self.counted[round_no] = counted

    def counted_before(self, peer: str, trained: int) -> bool:
        """Whether ``peer``'s upload of round ``trained`` was counted already, fresh in that
        round or late in a later one, or cannot be one (``peer`` was not among that round's
        participants), as far as the rounds this node applied tell; True, so the upload is
        refused, when this node did not take part in round ``trained`` (it cannot tell)."""
        this = self.counted.get(trained, Counted(None, [], {}))
        if this.participants is None or peer not in this.participants:
            return True
        if peer in this.aggregated and peer not in this.late:
            return True
        return any(c.late.get(peer) == k - trained for k, c in self.counted.items())

    def target(self, trained: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """The round a late upload of ``trained`` goes to (the one after the newest one
        announced by its rightful aggregator; each round's roster comes from the
        announcement before it, ``body`` the announcement of ``trained``), with the
        announcement that gives its roster."""
        announced = self.rotation.announced
        newest = trained
        while newest + 1 in announced:  # the swarm may be further on already
            later = announced[newest + 1]
            attempt = max(later)
            order = succession(newest + 1, body["roster"])
            if attempt >= len(order) or later[attempt].sender != order[attempt]:
                break
            newest, body = newest + 1, later[attempt].body
        return newest + 1, body

    def offer(self, trained: int, body: dict[str, Any], own: dict[str, Any]) -> LateOffer | None:
        """This node's upload of round ``trained`` missed its round's close: the offer of
        ``{n, report, late: trained}`` to round :meth:`target`'s first aggregator, kept in
        :attr:`offers`, when that round exists and is at most ``max_late`` rounds later;
        None when not offered. The caller sends it (:meth:`send`)."""
        target, body = self.target(trained, body)
        staleness = target - trained
        if target > self.cfg.rounds or staleness > self.max_late:
            return None
        roster = body["roster"]
        self.rotation.rosters.setdefault(target, roster)  # the plan of ``target`` will hold it too
        report = {"n": own["n"], "report": own["report"], "late": trained}
        self.offers[target] = report
        return LateOffer(target, trained, staleness, report, succession(target, roster)[0])

    async def send(self, to: str, round_no: int, report: dict[str, Any], attempt: int) -> None:
        """Send the late offer ``report`` to ``to``, the aggregator of ``(round_no,
        attempt)``; a failure is logged (the offer is lost)."""
        try:
            await self.services.exchange.send(to, "report", round_no, report, attempt=attempt)
        except TransportError as exc:
            log.warning("%s: round %d: late offer to %s failed: %s", self.id, round_no, to, exc)

    def sent(
        self, round_no: int, body: dict[str, Any], own: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        """What this node sent for the upload ``body`` counted of it: its late offer when the
        announcement counts that one, else its report of the round (for the audit's own
        entry check)."""
        if self.id in body.get("late", {}):
            return self.offers.get(round_no)
        return own

    def forget(self, floor: int) -> None:
        """Drop what was kept of round ``floor`` and before."""
        for d in (self.counted, self.offers):
            for r in [r for r in d if r <= floor]:
                del d[r]
