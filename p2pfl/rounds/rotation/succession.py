"""The succession of a centralized round for one member (docs/design.md, "Rotating
aggregator"): attempts ``0, 1, …`` of round ``r``, each aggregated by
``succession(r, roster)[a]`` (:mod:`p2pfl.rounds.rotation.election`), until one result is applied or
every candidate is gone.

At each attempt a member takes an announcement already heard (its own attempt's or a
later one's), aggregates itself (:class:`~p2pfl.rounds.rotation.aggregator.AggregatorRole`), or
reports to the attempt's aggregator and waits for its announcement. It **fails over** to
the next attempt (a :class:`Failover`, in the record's ``failovers``) when the aggregator
is convicted by an audit, is offline or cut off (:mod:`p2pfl.rounds.rotation.reach`), misses
``aggregator_timeout``, is taken over (a peer reported to a later attempt), when a later
attempt is announced (``superseded``), or when its result is refused (admission, or the
audit: :class:`~p2pfl.rounds.rotation.auditor.AuditRole`). A member that finds the swarm settled the
round without it raises :class:`~p2pfl.rounds.rotation.rotation.Behind` (the driver catches up).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from p2pfl.learning.state import State
from p2pfl.rounds.rotation.aggregator import AggregatorFacts, AggregatorRole
from p2pfl.rounds.rotation.auditor import AuditRole
from p2pfl.rounds.rotation.election import succession
from p2pfl.rounds.rotation.hearing import Hearing
from p2pfl.rounds.rotation.late import LateOffer
from p2pfl.rounds.rotation.lineage import fork_name
from p2pfl.rounds.rotation.member import Member
from p2pfl.rounds.rotation.plans import RoundPlan, waits_on
from p2pfl.rounds.rotation.reach import Reachability
from p2pfl.rounds.rotation.rotation import Behind, Rotation
from p2pfl.rounds.rotation.secure_round import SecureRounds
from p2pfl.services.bundle import NodeServices

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Failover:
    """Attempt ``attempt`` of a round, aggregated by ``aggregator``, failed over: ``why``."""

    attempt: int
    aggregator: str
    why: str

    def record(self) -> dict[str, Any]:
        """The entry of the record's ``failovers``."""
        return {"attempt": self.attempt, "aggregator": self.aggregator, "why": self.why}


@dataclass(frozen=True)
class Settled:
    """How a round settled for this member: the attempt that did and its aggregator (None:
    no aggregator finished the round), the announcement taken (None: none), what this node
    received of it to apply (None: nothing), the attempts failed over before it; and, as
    far as they apply, this node's late offer of its upload, its facts as the aggregator
    with its server rule's facts, and the audit's record."""

    round: int
    aggregator: str | None
    attempt: int
    announcement: dict[str, Any] | None
    received: State | None
    failovers: list[Failover] = field(default_factory=list)
    offered_late: LateOffer | None = None
    aggregated: AggregatorFacts | None = None
    server_facts: dict[str, Any] | None = None
    audit: dict[str, Any] | None = None


class Succession:
    """Runs the attempts of each round for one node, over its view of the rotation."""

    def __init__(
        self,
        services: NodeServices,
        rotation: Rotation,
        hearing: Hearing,
        member: Member,
        role: AggregatorRole,
        audit: AuditRole,
        reach: Reachability,
        secure: SecureRounds | None,
    ) -> None:
        self.services = services
        self.alg = member.alg
        self.id = services.id
        self.cfg = services.cfg
        self.rotation = rotation
        self.hearing = hearing
        self.member = member
        self.role = role
        self.audit = audit
        self.reach = reach
        self.secure = secure

    def _secure_member(
        self, plan: RoundPlan, attempt: int, agg: str, own: dict[str, Any] | None
    ) -> None:
        """privacy.secagg: this member's side of attempt ``attempt`` runs while it waits
        (not for an aggregator it will fail over from at once)."""
        gone = agg != self.id and (
            agg in self.audit.convicted or not self.services.peers.is_online(agg)
        )
        if self.secure is not None and not gone:
            n = None if own is None else own["n"]
            self.secure.start_member(plan, attempt, agg, n, self.role.upload(plan.round))

    async def settle(
        self, plan: RoundPlan, participated: bool, own: dict[str, Any] | None
    ) -> Settled:
        """Attempts 0, 1, … of round ``plan.round`` until one result is applied (or every
        candidate is gone); ``own`` is this node's report (None when it did not train)."""
        svc, cfg, r, rot = self.services, self.cfg, plan.round, self.rotation
        order = succession(r, plan.roster)
        failovers: list[Failover] = []
        late_offer: LateOffer | None = None  # where this round's late upload went
        attempt = 0
        while attempt < len(order):
            rot.current = (r, attempt)
            announced = {a: h for a, h in rot.announced.get(r, {}).items() if a >= attempt}
            if announced:  # this attempt or a later one is over: take its result
                attempt = max(announced)
                rot.current = (r, attempt)
            await self.hearing.hear(self.hearing.of(plan, attempt))
            if announced:
                heard = announced[attempt]
                sender, body = heard.sender, heard.body
                if body.get("lineage") == fork_name(r, attempt, sender):
                    self.reach.told_partition()
                if participated and own is not None and self.id in body.get("closed_without", []):
                    # the round closed at its quorum without this node: offer the upload on
                    if late_offer is None:
                        late_offer = await self.member.offer_late(r, body, own)
                needs = self.alg.needs_result(
                    participated, self.id in body["participants"], r >= cfg.rounds
                )
                audits = rot.auditor(r, attempt) == self.id  # it checks what it is served
                received = None
                if (needs or audits) and (self.id in body["receivers"] or body["common"]):
                    pulled = await self.member.pull_result(sender, r, attempt)
                    if pulled.error is not None:
                        log.warning(
                            "%s: round %d: result pull failed: %s", self.id, r, pulled.error
                        )
                        failovers.append(Failover(attempt, sender, pulled.error))
                        attempt += 1
                        continue
                    received = pulled.state
                sent = self.member.late.sent(r, body, own)
                check = await self.audit.check(
                    plan, attempt, sender, body, received, sent, rot.superseded_at(r, attempt)
                )
                if check.failover is not None:
                    failovers.append(Failover(attempt, sender, check.failover))
                    attempt += 1
                    continue
                return Settled(
                    r,
                    sender,
                    attempt,
                    body,
                    received if needs else None,
                    failovers,
                    offered_late=late_offer,
                    audit=check.record,
                )
            agg = order[attempt]
            self._secure_member(plan, attempt, agg, own)
            if agg == self.id:
                out = await self.role.aggregate(plan, attempt, own, rot.superseded_at(r, attempt))
                if out is None:
                    later = rot.superseding(r, attempt) or attempt + 1
                    failovers.append(Failover(attempt, agg, "superseded"))
                    attempt = later
                    continue
                sent = self.member.late.sent(r, out.announcement, own)
                check = await self.audit.check(
                    plan, attempt, agg, out.announcement, None, sent, rot.superseded_at(r, attempt)
                )
                if check.failover is not None:  # the swarm fails the round over: so does this node
                    failovers.append(Failover(attempt, agg, check.failover))
                    attempt += 1
                    continue
                return Settled(
                    r,
                    agg,
                    attempt,
                    out.announcement,
                    out.received,
                    failovers,
                    aggregated=out.facts,
                    server_facts=out.server_facts,
                    audit=check.record,
                )
            if agg in self.audit.convicted:  # an auditor caught it: every member skips it alike
                failovers.append(Failover(attempt, agg, "convicted"))
                attempt += 1
                continue
            cut_off = await self.reach.check(agg)  # presence, the direct lane, bridges
            if cut_off is not None:
                failovers.append(Failover(attempt, agg, cut_off))
                attempt += 1
                continue
            svc.ledger.publish_status(r, "waiting")  # for this attempt's aggregator
            await self.member.report(agg, r, attempt, own)
            deadline = time.monotonic() + cfg.timing.aggregator_timeout

            def settled(attempt: int = attempt, agg: str = agg) -> bool:
                return (
                    any(a >= attempt for a in rot.announced.get(r, {}))
                    or not waits_on(svc, agg, r)
                    or self.reach.cut_off(agg) is not None
                    or rot.wanted.get(r, 0) > attempt
                    or rot.behind(r) is not None
                )

            async with self.reach.watching(lambda agg=agg: [agg]):
                await svc.peers.wait_for(settled, deadline)
            rot.check_behind(r)
            if any(a >= attempt for a in rot.announced.get(r, {})):
                continue  # taken at the top of the loop
            if rot.wanted.get(r, 0) > attempt:
                failovers.append(Failover(attempt, agg, "taken over"))
                attempt = rot.wanted[r]
                continue
            if (svc.peers.reported_round(agg) or 0) >= r:  # it settled the round without us
                raise Behind(r)
            why = self.reach.cut_off(agg) or "deadline"
            log.warning("%s: round %d: aggregator %s %s; next peer", self.id, r, agg, why)
            failovers.append(Failover(attempt, agg, why))
            attempt += 1
        log.warning("%s: round %d: no aggregator finished the round", self.id, r)
        return Settled(r, None, attempt, None, None, failovers)
