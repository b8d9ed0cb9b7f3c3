"""Whose presence a centralized member hears (docs/wire.md, "Topics").

Every member hears every gossip topic, but presence only as far as its part in the round
needs: every member's while it may aggregate or audit (it waits on the participants, pulls
their uploads and draws the next roster from live presence), while it observes, and from
the start until its first round; the presence of the round's first :data:`HEADS`
aggregators (and their auditors) only, otherwise. A broker thus delivers ``O(N)`` presence
messages a round instead of ``N²``. Each change of hearing waits (:data:`FRESH_S` at most)
for the retained presence of the peers newly heard, so the view a member decides on is live.
"""

from __future__ import annotations

from p2pfl.rounds.rotation.audit import auditor_of
from p2pfl.rounds.rotation.election import succession
from p2pfl.rounds.rotation.plans import RoundPlan
from p2pfl.services.bundle import NodeServices

# a member hears the presence of the aggregators of its current attempt and of the next one
HEADS = 2
FRESH_S = 3.0  # how long a change of hearing waits for the retained presence of new peers


class Hearing:
    """Whose presence one node hears; ``audited``: whether rounds are audited (their
    auditors are heard too)."""

    def __init__(self, services: NodeServices, audited: bool) -> None:
        self.services = services
        self.id = services.id
        self.seed = services.cfg.seed
        self.members = sorted(set(services.cfg.node_ids))
        self.audited = audited

    def of(self, plan: RoundPlan, attempt: int) -> list[str] | None:
        """Whose presence this node needs at attempt ``attempt`` of ``plan``'s round: None
        (every member's) when it aggregates or audits one of the attempts up to
        ``attempt + HEADS - 1``; otherwise those attempts' aggregators and auditors, whose
        presence says when to fail over and whose results it pulls."""
        return self._in(plan.round, plan.roster, attempt)

    def at_start(self) -> list[str] | None:
        """Whose presence this node hears from its start until its first round (and waits
        for at the startup barrier): round 1's, as :meth:`of` gives it on round 1's roster
        (the topology's members); every member's when it resumes (it observes first)."""
        if self.services.ledger.resumed_round >= 1:
            return None
        return self._in(1, self.members, 0)

    def _in(self, r: int, roster: list[str], attempt: int) -> list[str] | None:
        order = succession(r, roster)
        heads = order[: attempt + HEADS]
        auditors = (
            {auditor_of(self.seed, r, a, roster, agg) for a, agg in enumerate(heads)}
            if self.audited
            else set()
        )
        if self.id in heads or self.id in auditors:
            return None
        return sorted((set(heads) | auditors) - {self.id})

    async def hear(self, peers: list[str] | None) -> None:
        """Hear the presence of ``peers`` (None: every member's) and no other's
        (:meth:`~p2pfl.services.exchange.Exchange.hear`)."""
        await self.services.exchange.hear(peers, FRESH_S, members=self.members)
