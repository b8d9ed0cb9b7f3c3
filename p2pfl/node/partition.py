"""A centralized member's view of a partition, wired to its node (docs/wire.md,
"Partitions"): the :class:`~p2pfl.node.reach.Reachability` of its peers over this node's
presence, direct lane and broker bridges, and the bridges' state followed from the broker.
The rules are pure and live in :mod:`p2pfl.node.reach` and :mod:`p2pfl.node.lineage`."""

from __future__ import annotations

import logging

from p2pfl.node.reach import Reachability
from p2pfl.node.services import NodeServices
from p2pfl.wire.transport import TransportError

log = logging.getLogger(__name__)


def member_reach(services: NodeServices) -> Reachability:
    """The reachability of ``services``' peers: presence (``online``), the direct lane (a
    probe, and any pull that went that way) and the bridges of its broker; a flip of a
    verdict wakes every wait of the node (:meth:`NodeServices.notify`). The transport is
    looked up at each use (a node builds it after its driver)."""

    async def probe(peer: str, timeout: float) -> bool | None:
        return await services.transport.probe(peer, timeout)

    return Reachability(
        services.id,
        online=services.is_online,
        probe=probe,
        bridge_down=lambda: services.transport.bridge_down,
        changed=services.notify,
        answered=lambda peer: peer in services.transport.direct_answered,
    )


async def follow_bridges(services: NodeServices) -> None:
    """Follow the state of this node's broker's bridges (a change wakes every wait); a
    broker that will not tell (no bridge, or an ACL that keeps ``$SYS`` from nodes) leaves
    every bridge counted up."""

    def changed(_name: str, _up: bool) -> None:
        services.notify()

    services.transport.on_bridge = changed
    try:
        await services.transport.follow_bridges()
    except TransportError as exc:  # the next connection subscribes
        log.debug("%s: bridge state not followed yet: %s", services.id, exc)
