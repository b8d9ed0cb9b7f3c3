"""Whose presence a centralized member hears (docs/wire.md, "Topics").

Every member hears every gossip topic, but presence only as far as its part in the round
needs:

- a **lead** of the round (the aggregator of its current attempt, or that attempt's
  auditor) hears the round's participants (it waits on them and pulls their uploads) and
  the other leads, and every member's only while it draws the next roster
  (:meth:`Hearing.hear_all`);
- any other member hears the leads only: their presence says when to fail over, and whose
  results it pulls; after it settles a round it hears nobody until it starts the next
  (:meth:`Hearing.between`), so the next leads' reports of the round reach it in their
  retained presence rather than each as it is published;
- every member's while it observes, and from the start until its first round as the
  leads of round 1 would.

A broker thus delivers about one presence a member and round, plus the participants' and
every member's retained presence to the round's lead, instead of ``N²``. Each change of
hearing waits (:data:`FRESH_S` at most) for the retained presence of the peers newly heard,
so the view a member decides on is live.
"""

from __future__ import annotations

from p2pfl.rounds.rotation.audit import auditor_of
from p2pfl.rounds.rotation.election import succession
from p2pfl.rounds.rotation.plans import RoundPlan
from p2pfl.services.bundle import NodeServices

FRESH_S = 3.0  # how long a change of hearing waits for the retained presence of new peers


class Hearing:
    """Whose presence one node hears; ``audited``: whether rounds are audited (their
    auditors are leads too)."""

    def __init__(self, services: NodeServices, audited: bool) -> None:
        self.services = services
        self.id = services.id
        self.seed = services.cfg.seed
        self.members = sorted(set(services.cfg.node_ids))
        self.audited = audited

    def leads(self, r: int, roster: list[str], attempt: int) -> set[str]:
        """The aggregator of attempt ``attempt`` of round ``r`` on ``roster``, and its
        auditor when rounds are audited."""
        agg = succession(r, roster)[attempt % len(roster)] if roster else None
        out = {agg} if agg is not None else set()
        if self.audited and agg is not None:
            auditor = auditor_of(self.seed, r, attempt, roster, agg)
            if auditor is not None:
                out.add(auditor)
        return out

    def of(self, plan: RoundPlan, attempt: int) -> list[str]:
        """Whose presence this node needs at attempt ``attempt`` of ``plan``'s round: the
        attempt's leads and, when it is one of them, the round's participants."""
        leads = self.leads(plan.round, plan.roster, attempt)
        peers = leads | set(plan.participants) if self.id in leads else leads
        return sorted(peers - {self.id})

    def between(self, nxt: RoundPlan) -> list[str]:
        """Whose presence this node hears from settling a round until it starts ``nxt``,
        the next: :meth:`of` attempt 0 of ``nxt`` when it leads it (it gathers its
        participants' presence early); nobody's otherwise."""
        return self.of(nxt, 0) if self.id in self.leads(nxt.round, nxt.roster, 0) else []

    def at_start(self) -> list[str] | None:
        """Whose presence this node hears from its start until its first round (and waits
        for at the startup barrier): round 1's leads, and every member's for a lead of
        round 1 (the topology's members take part) or a node that resumes (it observes
        first)."""
        leads = self.leads(1, self.members, 0)
        if self.services.ledger.resumed_round >= 1 or self.id in leads:
            return None
        return sorted(leads)

    async def hear(self, peers: list[str] | None) -> None:
        """Hear the presence of ``peers`` (None: every member's) and no other's
        (:meth:`~p2pfl.services.exchange.Exchange.hear`)."""
        await self.services.exchange.hear(peers, FRESH_S, members=self.members)

    async def hear_all(self) -> None:
        """Hear every member's presence, waiting (:data:`FRESH_S` at most) for the retained
        presence of those newly heard: the live view a lead draws the next roster from."""
        await self.hear(None)
