"""The round driver contract and the registry the daemon picks a driver from.

A driver runs one node's rounds of one kind of method over the node's
:class:`~p2pfl.services.bundle.NodeServices`. It declares what the daemon would otherwise
ask by branching on the method: which configuration selects it (:meth:`RoundDriver.selects`),
whom a node talks to (:meth:`RoundDriver.peers_of`), whose messages it hears
(:meth:`RoundDriver.listens_to`) and whom it awaits at start (:meth:`RoundDriver.start`).
A new kind of round adds one module beside :mod:`p2pfl.rounds.gossip` and
:mod:`p2pfl.rounds.rotation` and one entry to :data:`DRIVERS`; the daemon does not change.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from p2pfl.algorithms.base import Method
from p2pfl.config.schema import TopologyConfig
from p2pfl.rounds.gossip.asynchronous import AsyncDecentralizedRounds
from p2pfl.rounds.gossip.decentralized import DecentralizedRounds
from p2pfl.rounds.rotation.centralized import CentralizedRounds
from p2pfl.wire.envelope import Envelope


@runtime_checkable
class RoundDriver(Protocol):
    """The interface between the daemon and a round driver. The daemon picks the driver
    class (:func:`driver_for`), asks it whom the node talks to and hears, builds it over the
    node's services, calls :meth:`start` once before connecting and :meth:`run` once after
    the startup barrier, and routes the transport's callbacks here."""

    @classmethod
    def selects(cls, method: type[Method], cfg: TopologyConfig) -> bool:
        """Whether this driver runs ``method`` under ``cfg`` (exactly one driver does)."""

    @classmethod
    def peers_of(cls, cfg: TopologyConfig, node_id: str) -> list[str]:
        """The peers node ``node_id`` talks to: its neighbours."""

    @classmethod
    def listens_to(cls, neighbours: list[str]) -> list[str] | None:
        """Whose messages the transport hands this node (None: every node's)."""

    async def start(self) -> list[str]:
        """Called once, before the transport connects (it may set whose presence the node
        hears); returns the peers whose presence the startup barrier waits for."""

    async def run(self) -> None:
        """Run every round of the swarm this node takes part in; records go through the
        ledger (:meth:`~p2pfl.services.ledger.Ledger.finish_round`)."""

    def on_gossip(self, env: Envelope) -> None:
        """A message on a peer's gossip topic (gossip, announcements)."""

    def on_inbox(self, env: Envelope) -> None:
        """A small message addressed to this node (e.g. a ``report``)."""

    async def serve_pull(self, env: Envelope) -> None:
        """Answer a peer's ``pull`` request: send the state or refuse."""

    def on_peer_online(self, peer: str) -> None:
        """A neighbour came online (it joined late or reconnected)."""


# every round driver, by name (``decentralized-async``: a decentralized method under
# ``timing.mode: async``)
DRIVERS: dict[str, type[RoundDriver]] = {
    "decentralized": DecentralizedRounds,
    "decentralized-async": AsyncDecentralizedRounds,
    "centralized": CentralizedRounds,
}


def driver_for(method: type[Method], cfg: TopologyConfig) -> type[RoundDriver]:
    """The one driver of :data:`DRIVERS` that runs ``method`` under ``cfg``."""
    chosen = [d for d in DRIVERS.values() if d.selects(method, cfg)]
    if len(chosen) != 1:
        names = [n for n, d in DRIVERS.items() if d in chosen]
        raise ValueError(f"method {method.name!r}: {len(chosen)} round drivers select it {names}")
    return chosen[0]
