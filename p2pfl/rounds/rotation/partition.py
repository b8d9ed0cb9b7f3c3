"""A centralized member's view of a partition, wired to its node (docs/wire.md,
"Partitions"): the :class:`~p2pfl.rounds.rotation.reach.Reachability` of its peers over this node's
presence, direct lane and broker bridges, the bridges' state followed from the broker, and
the lineage an aggregator names its result after. The rules are pure and live in
:mod:`p2pfl.rounds.rotation.reach` and :mod:`p2pfl.rounds.rotation.lineage`."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from p2pfl.rounds.rotation.lineage import Lineage, result_lineage
from p2pfl.rounds.rotation.reach import UNREACHABLE, Reachability
from p2pfl.services.bundle import NodeServices
from p2pfl.wire.errors import TransportError

log = logging.getLogger(__name__)


def member_reach(services: NodeServices) -> Reachability:
    """The reachability of ``services``' peers: presence (``online``), the direct lane (a
    probe, and any pull that went that way) and the bridges of its broker; a flip of a
    verdict wakes every wait of the node (:meth:`~p2pfl.services.peers.PeerView.notify`).
    Each is looked up at its use. Its helpers' ``probe_req`` and ``probe_ack`` go to their
    inbox (a send that fails is logged: an ack not sent is an ack not counted); no helper
    is asked while this node speaks protocol 3 (a peer of the previous release is heard:
    :attr:`~p2pfl.services.exchange.Exchange.speaks_4`), so a suspicion is then confirmed
    by its own probe, as that release confirms it; nor ever a peer heard running
    protocol 3 (:meth:`~p2pfl.services.exchange.Exchange.runs_4`)."""
    exchange = services.exchange

    async def ask(helper: str, kind: str, body: dict[str, Any]) -> None:
        try:
            await services.exchange.send(helper, kind, 0, body)
        except TransportError as exc:
            log.debug("%s: %s to %s not sent: %s", services.id, kind, helper, exc)

    return Reachability(
        services.id,
        online=lambda peer: services.peers.is_online(peer),
        probe=lambda peer, timeout: exchange.probe(peer, timeout),
        bridge_down=lambda: exchange.bridge_down,
        changed=lambda: services.peers.notify(),
        answered=lambda peer: exchange.answered_directly(peer),
        members=lambda: services.cfg.node_ids,
        ask=ask,
        may_ask=lambda helper: exchange.speaks_4 and exchange.runs_4(helper),
    )


def abandon_when_cut(
    services: NodeServices, reach: Reachability, running: set[str]
) -> Callable[[str], Awaitable[str]]:
    """For :meth:`~p2pfl.services.exchange.Exchange.pull_many`: a wait that ends, with why,
    once a peer is found cut off while its pull runs (``offline``, or a suspicion confirmed
    by helpers), so that the pull ends then rather than after its timeout (a cut link drops
    packets silently). The verdict is re-read at every notify of ``services``' peer view;
    the caller keeps it fresh by watching ``running``
    (:meth:`~p2pfl.rounds.rotation.reach.Reachability.watching`), which a peer leaves when
    its wait ends."""

    async def abandon(peer: str) -> str:
        try:
            while not await services.peers.wait_for(
                lambda: reach.cut_off(peer) is not None, time.monotonic() + 60.0
            ):
                pass  # a long pull: keep waiting, its own timeout ends it
            return f"{peer} is cut off ({reach.cut_off(peer)})"
        finally:
            running.discard(peer)

    return abandon


async def follow_bridges(services: NodeServices) -> None:
    """Follow the state of this node's broker's bridges (a change wakes every wait); a
    broker that will not tell (no bridge, or an ACL that keeps ``$SYS`` from nodes) leaves
    every bridge counted up."""

    def changed(_name: str, _up: bool) -> None:
        services.peers.notify()

    try:
        await services.exchange.follow_bridges(changed)
    except TransportError as exc:  # the next connection subscribes
        log.debug("%s: bridge state not followed yet: %s", services.id, exc)


def name_result(
    lineage: Lineage | None,
    reach: Reachability | None,
    announcement: dict[str, Any],
    reports: dict[str, dict[str, Any]],
    round_no: int,
    attempt: int,
    node_id: str,
) -> list[str]:
    """Name the lineage of an aggregator's result in its ``announcement`` (``lineage``;
    :func:`~p2pfl.rounds.rotation.lineage.result_lineage`) from the lineage of each aggregated report
    (``reports``: member → kept report) and this node's own; returns the other lineages the
    result merged. Nothing without a lineage to follow (``lineage`` None)."""
    if lineage is None:
        return []
    reporters = {
        p: reports[p]["lineage"]
        for p in announcement["aggregated"]
        if p != node_id and "lineage" in reports.get(p, {})
    }

    def cut_off(member: str) -> bool:
        return reach is not None and reach.cut_off(member) == UNREACHABLE

    name, merged = result_lineage(
        lineage.name, lineage.followers, reporters, cut_off, round_no, attempt, node_id
    )
    announcement["lineage"] = name
    if merged or name != lineage.name:
        how = f", merging {merged}" if merged else f" (forked from {lineage.name})"
        log.warning("%s: round %d: lineage %s%s", node_id, round_no, name, how)
    return merged
