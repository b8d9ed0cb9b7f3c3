"""Emulated links: what a node receives arrives as if it had crossed the topology's
network (``network:``, :mod:`p2pfl.config.emulation`; docs/wire.md, "Emulated links").

**Where.** The receiver emulates: every message this node receives from peer ``a``, on
either lane (an MQTT message, a direct pull request, a direct answer with its state), is
held back by the emulated path ``a → this node`` before the receive pipeline
(:mod:`p2pfl.wire.receive`) dispatches it. The sender is never delayed, and received bytes
count when they reach this node's socket (:class:`~p2pfl.wire.stats.TransportStats`).
Emulating at the receiver keeps the emulation in one place for broadcasts (one gossip
publish reaches each neighbour over its own path) and for both lanes, and needs no
cooperation from the broker or the sender.

**The model.** A message of ``B`` bytes arriving at time ``t`` over a path with latency
``L``, jitter ``σ``, bandwidth ``W`` and packet loss ``p`` (:class:`EmulatedLink`):

- transmission ``B / W``, starting once the link has finished the previous message
  (``start = max(t, busy_until)``): a link serialises its transfers;
- each of its ``⌈B / 1500⌉`` packets is lost with probability ``p`` and costs one
  retransmission timeout, ``max(200 ms, 2 L)``. Both lanes are TCP: a message is delayed,
  never lost; the link is busy during the wait (a stalled stream sends nothing after it);
- then ``L`` plus a normal draw of standard deviation ``σ``, cut at 0, so a message never
  arrives before ``L``;
- delivery keeps each link's order (FIFO): a message never overtakes an earlier one from
  the same peer, whatever the draws.

Draws come from one generator per link, seeded with (topology seed, this node, the peer):
a run replays the same delays given the same arrivals.

**Who is delayed.** A message whose envelope names a topology node other than this one as
its sender, once admitted (decoded, of this swarm, signature checked). Presence is
delayed too, though the broker stores and sends it: a retained presence then arrives one
path later than it would (only at start-up), and a peer's ``done`` or Last Will never
overtakes the gossip and chunks it sent before. Anything else (this node's own messages,
a sender outside the topology) is not delayed.

**Cost.** With no ``network:`` section the transport holds no emulator and the pipeline
dispatches at once, as without this module. With ``network.kernel: true`` the kernel
shapes each node's uplink (:mod:`p2pfl.wire.shaping`) and the emulator leaves bandwidth
out: latency, jitter and loss stay here.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from p2pfl.config.emulation import LinkParams, paths_to

if TYPE_CHECKING:
    from p2pfl.config.schema import TopologyConfig

PACKET_BYTES = 1500
MIN_RTO_S = 0.2


def link_rng(seed: int, node: str, peer: str) -> np.random.Generator:
    """The generator of the path ``peer → node`` (stable across runs and machines)."""
    digest = hashlib.sha256(f"{seed}\0{node}\0{peer}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:16], "little"))


@dataclass
class EmulatedLink:
    """One emulated path into this node and its state. :meth:`schedule` is the whole
    model (pure but for the link's own state and generator)."""

    params: LinkParams
    rng: np.random.Generator
    busy_until: float = -math.inf  # when the link finishes its last transmission
    last_due: float = -math.inf  # delivery time of the last message (FIFO)
    # (delivery time, callback) of the messages in flight, in order
    queue: deque[tuple[float, Callable[[], None]]] = field(default_factory=deque)
    timer: asyncio.TimerHandle | None = None

    def schedule(self, now: float, nbytes: int) -> float:
        """The delivery time of ``nbytes`` that reached this node at ``now`` (seconds, any
        clock), advancing the link: its busy time and the order of deliveries."""
        p = self.params
        latency = p.latency_ms / 1000
        send = 0.0 if p.bandwidth_mbps is None else nbytes * 8 / (p.bandwidth_mbps * 1e6)
        if p.loss > 0:
            packets = max(1, -(-nbytes // PACKET_BYTES))
            send += int(self.rng.binomial(packets, p.loss)) * max(MIN_RTO_S, 2 * latency)
        jitter = 0.0
        if p.jitter_ms > 0:
            jitter = max(0.0, float(self.rng.normal(0.0, p.jitter_ms / 1000)))
        self.busy_until = max(now, self.busy_until) + send
        self.last_due = max(self.busy_until + latency + jitter, self.last_due)
        return self.last_due


class LinkEmulator:
    """Holds back what this node receives from each peer by that peer's emulated path.
    ``paths``: peer → :class:`~p2pfl.config.emulation.LinkParams` of the path into this
    node; a peer absent from it is not delayed."""

    def __init__(self, node_id: str, paths: dict[str, LinkParams], seed: int = 0):
        self.node_id = node_id
        self.links = {
            peer: EmulatedLink(params, link_rng(seed, node_id, peer))
            for peer, params in paths.items()
            if peer != node_id
        }
        self._waiters: set[asyncio.Future] = set()

    @classmethod
    def from_topology(cls, cfg: TopologyConfig, node_id: str) -> LinkEmulator | None:
        """``node_id``'s emulator for ``cfg.network``; None when it emulates no path into
        this node (no emulation at all: the pipeline's path is unchanged). Under
        ``network.kernel`` the bandwidth is the kernel's and is left out here."""
        paths = paths_to(node_id, cfg.network, cfg.seed, cfg.node_hosts)
        if cfg.network.kernel:
            paths = {a: p.model_copy(update={"bandwidth_mbps": None}) for a, p in paths.items()}
        return cls(node_id, paths, cfg.seed) if paths else None

    def delays(self, peer: str) -> bool:
        """Whether what ``peer`` sends this node crosses an emulated path."""
        return peer in self.links

    def deliver(
        self, peer: str, nbytes: int, callback: Callable[[], None], now: float | None = None
    ) -> None:
        """Call ``callback`` (which must not raise) once ``nbytes`` from ``peer``, which
        reached this node at loop time ``now`` (default: now), have crossed its path, after
        everything that peer sent before. ``peer`` must be one :meth:`delays`."""
        loop = asyncio.get_running_loop()
        link = self.links[peer]
        due = link.schedule(loop.time() if now is None else now, nbytes)
        link.queue.append((due, callback))
        if link.timer is None:
            link.timer = loop.call_at(due, self._flush, link)

    async def crossed(self, peer: str, nbytes: int, now: float | None = None) -> None:
        """Return once ``nbytes`` from ``peer`` (reached at loop time ``now``) have crossed
        its path, in order with its other messages; at once for a peer not delayed.
        Cancelled by :meth:`close`."""
        if peer not in self.links:
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.add(fut)
        fut.add_done_callback(self._waiters.discard)
        self.deliver(peer, nbytes, lambda: fut.done() or fut.set_result(None), now)
        await fut

    def _flush(self, link: EmulatedLink) -> None:
        """Deliver the head of ``link``'s queue (its timer fired) and whatever else is due,
        in order; arm the timer for the next."""
        loop = asyncio.get_running_loop()
        link.timer = None
        _, callback = link.queue.popleft()
        callback()
        now = loop.time()
        while link.queue and link.queue[0][0] <= now:
            link.queue.popleft()[1]()
        if link.queue:
            link.timer = loop.call_at(link.queue[0][0], self._flush, link)

    def close(self) -> None:
        """Deliver nothing more: drop what is in flight and cancel the waiters."""
        for link in self.links.values():
            if link.timer is not None:
                link.timer.cancel()
                link.timer = None
            link.queue.clear()
        for fut in list(self._waiters):
            fut.cancel()
