"""Asynchronous rounds for decentralized methods (``timing.mode: async``; docs/algorithms.md,
"Asynchronous rounds").

Each node runs its own round counter and never waits for a neighbour. Round ``r`` of node
``i`` is the synchronous round (:mod:`p2pfl.rounds.gossip.decentralized`) with one step changed: the
node hears no gossip of round ``r``; it takes, for each neighbour, the latest gossip that
neighbour sent (whatever its round ``r_j``), and pulls the state that neighbour served for
that round (or a newer one, when the neighbour no longer keeps it).

- **Staleness** ``τ_j = max(0, r − r_j)``: a neighbour whose latest gossip is more than
  ``timing.max_staleness`` rounds behind is left out of the draw; the others are drawn as
  the method draws (:meth:`DecentralizedAlgorithm.choose_peers`), and each one's weight in
  the method's means is multiplied by ``(1 + τ_j)^-a`` (``a = timing.staleness_exponent``;
  :attr:`DefenceInputs.staleness`). The record's ``staleness`` holds ``τ_j`` of every drawn peer.
- Candidates are the neighbours whose presence is ``online`` or ``done`` (a node that
  finished its rounds keeps serving its last snapshot while it lingers) and that this node
  trusts.
- A node that falls :data:`~p2pfl.services.peers.LAG_ROUNDS` behind its neighbours catches up
  as in synchronous rounds; a slow node's states still reach its neighbours, with its
  staleness.
"""

from __future__ import annotations

from typing import Any

from p2pfl.algorithms.base import Method
from p2pfl.config.schema import TopologyConfig
from p2pfl.rounds.gossip.decentralized import DecentralizedRounds, cap_gossiped_counts
from p2pfl.rounds.rotation import quorum
from p2pfl.wire.envelope import Envelope


def staleness_weight(tau: int, exponent: float) -> float:
    """``(1 + τ)^-a``: the weight multiplier of a peer ``τ`` rounds stale (1 at τ = 0); the
    quorum rounds' discount (:func:`~p2pfl.rounds.rotation.quorum.staleness_weight`) of a unit weight."""
    return float(quorum.staleness_weight(1.0, tau, exponent))


def fresh_peers(latest_rounds: dict[str, int], round_no: int, max_staleness: int) -> dict[str, int]:
    """The peers whose latest round is at most ``max_staleness`` behind ``round_no``, with
    their staleness ``max(0, round_no − r_j)``, in sorted order."""
    out: dict[str, int] = {}
    for peer in sorted(latest_rounds):
        tau = max(0, round_no - latest_rounds[peer])
        if tau <= max_staleness:
            out[peer] = tau
    return out


class AsyncDecentralizedRounds(DecentralizedRounds):
    """:class:`DecentralizedRounds` that uses each neighbour's latest gossip and state."""

    @classmethod
    def selects(cls, method: type[Method], cfg: TopologyConfig) -> bool:
        """A decentralized method under ``timing.mode: async``."""
        return method.kind == "decentralized" and cfg.timing.mode == "async"

    def on_gossip(self, env: Envelope) -> None:
        """Keep each neighbour's latest gossip (no round window: rounds are not aligned)."""
        svc = self.services
        if env.kind != "gossip" or env.sender not in svc.neighbours:
            return
        latest = self._latest.get(env.sender)
        if latest is None or env.round > latest[0]:
            self._latest[env.sender] = (env.round, env.body)
            svc.peers.notify()

    def served_round(self, requested: int) -> int | None:
        """The requested snapshot, or the newest kept one when it was let go (a neighbour
        that pulls a stale round gets a fresher state, never none)."""
        if requested in self._snapshots:
            return requested
        newer = [r for r in self._snapshots if r >= requested]
        return max(newer) if newer else None

    async def _gather(
        self, round_no: int, t_comm: float
    ) -> tuple[list[str], dict[str, dict[str, Any]], dict[str, int] | None]:
        """Publish this round's gossip; draw among the fresh, live, trusted neighbours and
        take their latest gossip at once, with its staleness."""
        svc, timing = self.services, self.services.cfg.timing
        if not await self._publish(round_no):
            return [], {}, {}
        live = {
            p: r
            for p, (r, _) in self._latest.items()
            if svc.peers.status(p) in ("online", "done") and svc.robust.trusted(p, round_no)
        }
        fresh = fresh_peers(live, round_no, timing.max_staleness)
        chosen = self.alg.choose_peers(list(fresh))
        got = cap_gossiped_counts(svc, {p: self._latest[p][1] for p in chosen})
        staleness = {p: fresh[p] for p in chosen}
        svc.robust.measure_with(
            staleness={
                p: staleness_weight(t, timing.staleness_exponent) for p, t in staleness.items() if t
            }
        )
        del t_comm  # nothing is waited on
        return chosen, got, staleness

    def pull_round(self, peer: str, round_no: int) -> int:
        """The round to ask ``peer`` for: the one its latest gossip came from."""
        latest = self._latest.get(peer)
        return latest[0] if latest is not None else round_no
