"""Observing and catching up, for a centralized member (docs/wire.md, "Rounds and
catch-up"). A member that starts while the swarm is past round 1, that an announcement left
out of the next roster, or that fell behind the swarm *observes*: it waits for the next
announcement, pulls what any non-uploader receives (:attr:`Aggregate.common`) from that
aggregator, and is in the roster of the round after. The newest announcement heard too
far ahead to use is kept (:meth:`Observer.keep_newest`), so that a member that finds it
fell behind starts from it rather than waiting for the next one, which may wait on it
(after a partition heals: docs/wire.md, "Partitions").
"""

from __future__ import annotations

import logging
import time

from p2pfl.rounds.rotation.hearing import Hearing
from p2pfl.rounds.rotation.member import Member
from p2pfl.rounds.rotation.roster import MissingBase
from p2pfl.rounds.rotation.rotation import Heard, Rotation
from p2pfl.rounds.rotation.succession import Settled
from p2pfl.services.bundle import NodeServices
from p2pfl.wire.envelope import Envelope

log = logging.getLogger(__name__)


class Observer:
    """One node's observing: the newest far-ahead announcement (:attr:`newest`), the wait
    for the next announcement and the pull of its common result."""

    def __init__(
        self, services: NodeServices, rotation: Rotation, hearing: Hearing, member: Member
    ) -> None:
        self.services = services
        self.id = services.id
        self.cfg = services.cfg
        self.rotation = rotation
        self.hearing = hearing
        self.member = member
        self.newest: Heard | None = None

    def keep_newest(self, env: Envelope) -> None:
        """Keep the announcement in ``env``, too far ahead to use now, when it is the newest
        heard (one, checked, of a round live presence reports at most one ahead). Raises
        :class:`~p2pfl.rounds.rotation.roster.MissingBase` when its roster came by difference
        against a base this node lacks."""
        if self.newest is not None and self.newest.round >= env.round:
            return
        if env.round > self.rotation.swarm_round() + 1:
            return
        try:
            body = self.rotation.check(env.round, env.body)
        except MissingBase:
            raise  # the driver asks for the roster whole, then hands it back
        except ValueError:
            return
        self.newest = Heard(env.round, env.attempt, env.sender, body)

    async def start(self, after: int) -> None:
        """Skip to observing the round after ``after``: announcements of the rounds before are
        stale, and peers learn not to wait on this node before round ``after + 2``."""
        rot = self.rotation
        rot.applied = max(rot.applied, after)
        rot.current = (after, 0)
        await self.services.ledger.report_round(after, joined=after + 2)

    async def observe(self, after: int) -> Settled | None:
        """Wait for the first announcement of a round after ``after`` (any member may have
        sent it: this node does not know that round's roster) and pull what a non-uploader
        gets. Returns how the round settled, or None when nothing came before the deadline;
        raises :class:`~p2pfl.rounds.rotation.rotation.Behind` when presence shows the swarm
        :data:`~p2pfl.services.bundle.LAG_ROUNDS` past ``after``."""
        svc, cfg, rot = self.services, self.cfg, self.rotation
        await self.hearing.hear(None)  # the next roster is unknown: any member may aggregate
        if self.newest is not None and self.newest.round > after:  # heard while behind
            rot.note(self.newest)
        deadline = time.monotonic() + cfg.timing.startup_timeout_s + cfg.timing.aggregator_timeout
        while True:
            # the swarm may be further on than ``after`` said (a node that resumes from a
            # freeze decides on the presence it held before its reconnect): announcements of
            # its rounds are then too far to keep, so presence that shows it ahead restarts
            # the catch-up from there rather than waiting for an announcement never kept
            def heard() -> bool:
                return any(r > after for r in rot.announced) or rot.behind(after + 1) is not None

            if not await svc.peers.wait_for(heard, deadline):
                return None
            if not any(r > after for r in rot.announced):
                rot.check_behind(after + 1)  # raises Behind: the run loop catches up
            r = max(r for r in rot.announced if r > after)  # the newest: the current model
            attempt = max(rot.announced[r])
            taken = rot.announced[r][attempt]
            rot.current = (r, attempt)
            received = None
            if taken.body["common"] or self.id in taken.body["receivers"]:
                pulled = await self.member.pull_result(taken.sender, r, attempt)
                if pulled.error is not None:
                    log.warning("%s: catching up on round %d: %s", self.id, r, pulled.error)
                    rot.unnote(taken)
                    continue
                received = pulled.state
            return Settled(r, taken.sender, attempt, taken.body, received)
