"""The transport: the one object a node sends and receives through (docs/wire.md).

Topics live under ``p2pfl/<swarm>/`` (docs/wire.md, "Topics"):

- ``presence/<id>``: retained ``{status, ...}``; the MQTT Last Will sets ``offline``;
- ``gossip/<id>``: small per-round messages (representations) for the neighbours;
- ``inbox/<id>``: requests (``pull``) and replies (``xfer_meta``, ``xfer_chunk``,
  ``pull_error``) addressed to one node;
- ``status/<id>``: live telemetry for observers (:meth:`Transport.publish_status`), which
  no node subscribes to.

Every message is an :class:`~p2pfl.wire.envelope.Envelope` — swarm, sender, round, kind, id,
body — packed with :mod:`p2pfl.wire.codec`. :class:`Transport` is a facade over one module
per job:

- :mod:`p2pfl.wire.mqtt_lane`: the broker connection (reconnect loop, subscriptions,
  presence and Last Will, publishing, outages);
- :mod:`p2pfl.wire.direct_lane`: pulls straight between peers over TCP (mutual TLS when
  the swarm uses TLS), with :mod:`p2pfl.wire.direct` for framing;
- :mod:`p2pfl.wire.receive`: the one receive pipeline both lanes feed. Anything
  oversized, undecodable, from another swarm, of an unknown kind, duplicated, or otherwise
  malformed is dropped with a log line and counted in :attr:`Transport.dropped`; it never
  raises into the node.

The transport itself makes this node's envelopes (signed for their topic when the swarm
signs) and chooses the lane. Weights move on request only (:meth:`Transport.pull`): the
owner answers with a metadata message (transfer id, total size, digest, tensor index)
followed by the bytes, verified before use (:mod:`p2pfl.wire.transfers`). A pull first goes
straight to the serving peer over the direct lane when it announces one; the MQTT lane
(numbered ~1 MiB chunks through the broker) is the fallback when the peer announces no
direct address or cannot be reached. :attr:`Transport.pull_lanes` says which lane each
pull used (the latest :data:`PULL_LANES_KEPT`; :attr:`Transport.pulls` counts them all).

A node subscribes to the presence and gossip of every node (``+`` wildcards) unless it is
given ``listen_to``, the peers it talks to: then it subscribes to their topics only, so in a
sparse graph the broker delivers each presence and gossip message to a node's neighbours
instead of to the whole swarm (``N·k`` deliveries a round instead of ``N²``). Whose
presence it hears can change while it runs (:meth:`Transport.hear_presence`): a centralized
member hears the round's aggregators only, and every member while it may aggregate.

Given ``links`` (a :class:`~p2pfl.wire.emulation.LinkEmulator`, from the topology's
``network:``), what this node receives from a peer, on either lane, is held back by the
emulated path from that peer before it is dispatched; without it nothing is delayed.

Use as ``async with Transport(...) as t:``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
import uuid
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import aiomqtt

from p2pfl import PROTOCOL_VERSION
from p2pfl.wire import direct
from p2pfl.wire.compress import CompressError
from p2pfl.wire.digest import transfer_digest
from p2pfl.wire.direct_lane import DirectEndpoint
from p2pfl.wire.emulation import LinkEmulator
from p2pfl.wire.envelope import GOSSIP_KINDS, Envelope
from p2pfl.wire.errors import BrokerLostError, TransportError
from p2pfl.wire.mqtt_lane import PUBLISH_WINDOW, MqttLane, Topics
from p2pfl.wire.receive import ReceivePipeline
from p2pfl.wire.stats import TransportStats
from p2pfl.wire.streams import ReceivedStreams
from p2pfl.wire.transfers import CHUNK_BYTES, IncomingTransfers, PreparedState, State, TransferError

if TYPE_CHECKING:
    from p2pfl.security.signing import MessageSecurity

__all__ = [
    "PUBLISH_WINDOW",
    "PULL_LANES_KEPT",
    "BrokerLostError",
    "Transport",
    "TransportError",
    "TransportStats",
]

log = logging.getLogger(__name__)

BRIDGE_STATE_PREFIX = "$SYS/broker/connection/"  # Mosquitto's bridge notifications
PULL_LANES_KEPT = 4096  # lanes of the latest pulls kept (a round's records read them)


def _handler(name: str) -> property:
    """A handler of the receive pipeline, read and set through the transport."""
    return property(
        lambda self: getattr(self.inbound, name),
        lambda self, value: setattr(self.inbound, name, value),
        doc=f"``{name}``: see :class:`~p2pfl.wire.receive.ReceivePipeline`.",
    )


class Transport:
    """One node's transport. Callbacks (the receive pipeline's handlers):

    - ``on_gossip(envelope)`` for gossip and announcements from other nodes,
    - ``on_request(envelope)`` (a coroutine) for ``pull`` requests addressed to this node,
    - ``on_inbox(envelope)`` for other small messages addressed to this node (``report``),
    - ``on_presence(node_id, status_dict)`` when a presence changes.

    ``async with`` connects: it retries the first connection for ``startup_timeout``
    seconds (default ``connect_timeout``: a broker still starting, or slow), then fails
    with :class:`TransportError`. A publish while the connection is lost waits for it up to
    ``connect_timeout``; :meth:`watch_broker` gives up after ``broker_timeout``.
    """

    on_gossip = _handler("on_gossip")
    on_request = _handler("on_request")
    on_inbox = _handler("on_inbox")
    on_presence = _handler("on_presence")

    def __init__(
        self,
        swarm: str,
        node_id: str,
        host: str,
        port: int,
        *,
        presence: dict[str, Any] | None = None,
        max_message_bytes: int = 4 << 20,
        max_transfer_bytes: int = 2 << 30,
        chunk_bytes: int = CHUNK_BYTES,
        connect_timeout: float = 30.0,
        startup_timeout: float | None = None,
        broker_timeout: float | None = None,
        client_factory: Callable[..., aiomqtt.Client] | None = None,
        security: MessageSecurity | None = None,
        tls_context: ssl.SSLContext | None = None,
        direct_lane: direct.DirectLane | None = None,
        listen_to: Sequence[str] | None = None,
        links: LinkEmulator | None = None,
    ):
        self.swarm = swarm
        self.node_id = node_id
        self.host, self.port = host, port
        self.topics = Topics(swarm)
        self.prefix = self.topics.prefix
        self.presence_info = dict(presence or {})
        # the protocol this node runs, whatever version it speaks (p2pfl.wire.versions)
        self.presence_info.setdefault("protocol", PROTOCOL_VERSION)
        self.status = "online"
        self.max_message_bytes = max_message_bytes
        self.max_transfer_bytes = max_transfer_bytes
        self.chunk_bytes = chunk_bytes
        self.connect_timeout = connect_timeout
        # how long the first connection is retried (None: connect_timeout)
        self.startup_timeout = connect_timeout if startup_timeout is None else startup_timeout
        self.security = security  # sign what we send, verify what we receive
        self.stats = TransportStats()
        self.inbound = ReceivePipeline(
            node_id, self.topics, max_message_bytes, self.stats, security=security, links=links
        )
        # the pipeline's own objects, under the names the node reads
        self.dropped: Counter[str] = self.inbound.dropped
        self.peers: dict[str, dict[str, Any]] = self.inbound.peers
        self.transfers: IncomingTransfers = self.inbound.transfers
        self.inbound.presence_heard = self._presence_heard
        self._awaited: set[str] = set()  # newly heard peers whose presence has not come yet
        self._presence_came = asyncio.Event()
        self.inbound.speak_changed = self._speak_changed
        self.mqtt = MqttLane(
            node_id,
            self.topics,
            host,
            port,
            stats=self.stats,
            presence=lambda: self._presence_payload(self.status),
            will=self._will,
            on_message=self._mqtt_message,
            listen_to=listen_to,
            connect_timeout=connect_timeout,
            broker_timeout=broker_timeout,
            client_factory=client_factory,
            tls_context=tls_context,
        )
        self.direct_lane = direct_lane  # None: no direct lane (serve and pull over MQTT)
        self.direct = (
            None
            if direct_lane is None
            else DirectEndpoint(
                node_id,
                direct_lane,
                self.inbound,
                self.stats,
                max_message_bytes,
                self._refuse_unanswered,
            )
        )
        # (peer, "direct" | "mqtt") of the latest pulls, oldest first; ``pulls`` counts all
        self.pull_lanes: deque[tuple[str, str]] = deque(maxlen=PULL_LANES_KEPT)
        self.pulls = 0
        self.direct_answered: set[str] = set()  # peers a pull ever reached on the direct lane
        # top-k streams pulled (``transfer.compress: topk``; None: none): each pull names
        # the base held of the peer's stream, and a top-k answer is decoded with it
        self.streams: ReceivedStreams | None = None
        # the state of the bridges of this node's broker to other sites' brokers, by
        # connection name (:meth:`follow_bridges`): True up, False down; ``on_bridge``
        # (name, up) is called on each change
        self.bridges: dict[str, bool] = {}
        self.on_bridge: Callable[[str, bool], None] | None = None

    # ------------------------------------------------------------------ lifecycle
    def topic(self, kind: str, node: str) -> str:
        return self.topics.of(kind, node)

    def subscriptions(self) -> list[str]:
        """The topic filters this node subscribes to (:meth:`MqttLane.subscriptions`)."""
        return self.mqtt.subscriptions()

    def hears_presence(self, peer: str) -> bool:
        """Whether this node hears ``peer``'s presence now (its view of it is live)."""
        return self.mqtt.hears_presence(peer)

    async def hear_presence(
        self, peers: Sequence[str] | None, fresh_within: float, members: Sequence[str] = ()
    ) -> None:
        """Hear the presence of ``peers`` from now on (None: of every node) and no other's
        (:meth:`MqttLane.hear_presence`). Returns once the presence of every newly heard
        peer (of ``members``, when ``peers`` is None) has arrived (the broker's retained
        copy, handed over on subscription), so the node's view of them is live, or after
        ``fresh_within`` seconds (a peer that never connected has no retained presence).
        Of a peer not heard, :attr:`peers` keeps the last presence heard: a view that may
        be stale."""
        candidates = set(members if peers is None else peers) - {self.node_id}
        added = {p for p in candidates if not self.mqtt.hears_presence(p)}
        if fresh_within > 0:  # before subscribing: a retained copy may come before SUBACK
            self._awaited |= added
        await self.mqtt.hear_presence(peers)
        if not added or fresh_within <= 0:
            return
        deadline = time.monotonic() + fresh_within
        while self._awaited & added:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._presence_came.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._presence_came.wait(), left)
        self._awaited -= added

    def _presence_heard(self, peer: str) -> None:
        if peer in self._awaited:
            self._awaited.discard(peer)
            self._presence_came.set()

    # ------------------------------------------------------------------ reachability
    def _mqtt_message(self, topic: str, payload: Any) -> None:
        """The broker's bridge state (:meth:`follow_bridges`), else the receive pipeline."""
        if topic.startswith(BRIDGE_STATE_PREFIX):
            self._bridge_state(topic, payload)
            return
        self.inbound.mqtt_message(topic, payload)

    def _bridge_state(self, topic: str, payload: Any) -> None:
        parts = topic.split("/")
        if len(parts) != 5 or parts[4] != "state" or payload not in (b"0", b"1"):
            self.drop("foreign_topic", topic)
            return
        name, up = parts[3], payload == b"1"
        if self.bridges.get(name) == up:
            return
        self.bridges[name] = up
        log.log(
            logging.INFO if up else logging.WARNING,
            "%s: the broker's bridge %s is %s",
            self.node_id,
            name,
            "up" if up else "down",
        )
        if self.on_bridge is not None:
            self.on_bridge(name, up)

    async def follow_bridges(self) -> None:
        """Hear the state of the broker's bridges to other sites (Mosquitto's retained
        ``$SYS/broker/connection/<name>/state``, ``1`` or ``0``) into :attr:`bridges`."""
        await self.mqtt.follow_system(BRIDGE_STATE_PREFIX + "+/state")

    @property
    def bridge_down(self) -> bool:
        """Whether a bridge of this node's broker to another site is down now."""
        return not all(self.bridges.values())

    async def probe(self, peer: str, timeout: float) -> bool | None:
        """Whether ``peer``'s direct lane accepts a TCP connection within ``timeout`` (the
        connection is closed at once, before any TLS handshake or request); None when the
        peer announces no direct address or this node has no direct lane."""
        address = direct.parse_address(self.peers.get(peer, {}).get("direct"))
        if address is None or self.direct is None:
            return None
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(*address), timeout)
        except (OSError, asyncio.TimeoutError):
            return False
        writer.close()
        return True

    @property
    def connected(self) -> bool:
        """Whether the broker connection is up now."""
        return self.mqtt.connected

    async def __aenter__(self) -> Transport:
        if self.direct is not None:
            self.presence_info["direct"] = await self.direct.start()
        self.mqtt.start()
        try:  # a broker that is slow or still starting is retried until then
            await self.mqtt.wait_connected(self.startup_timeout)
        except asyncio.TimeoutError:
            await self.close(graceful=False)
            raise TransportError(
                f"{self.node_id}: no MQTT broker reachable at {self.host}:{self.port} "
                f"within {self.startup_timeout:.0f} s"
            ) from None
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self, graceful: bool = True) -> None:
        """Announce ``offline`` (graceful) and disconnect; idempotent."""
        if graceful and self.mqtt.connected:
            self.status = "offline"
            with contextlib.suppress(Exception):
                await self.mqtt.publish_presence()
        if self.direct is not None:
            self.direct.close()
        self.inbound.close()
        await self.mqtt.close()

    def offline_seconds(self) -> float:
        """Seconds spent without a broker since the first connection (the current outage
        included)."""
        return self.mqtt.offline_seconds()

    async def watch_broker(self) -> None:
        """Return never; raise :class:`BrokerLostError` once the broker has been unreachable
        for ``broker_timeout`` seconds in one outage (never when it is None). Run it beside
        the work that needs the broker and stop that work when it raises."""
        await self.mqtt.watch_broker()

    @property
    def direct_address(self) -> str | None:
        """``host:port`` this node serves direct pulls on (announced in presence)."""
        served = self.direct is not None and self.direct.server is not None
        return self.presence_info.get("direct") if served else None

    # ------------------------------------------------------------------ versions
    @property
    def speaks(self) -> int:
        """The protocol version this node stamps on what it sends: the oldest run by a peer
        it hears online (:mod:`p2pfl.wire.versions`)."""
        return self.inbound.versions.speak

    @property
    def digest_name(self) -> str:
        """The digest of the states this node serves (:func:`transfer_digest`): BLAKE3 in a
        signed swarm, XXH3-128 in an unsigned one, BLAKE3 while it speaks protocol 2 (which
        knows no XXH3)."""
        return transfer_digest(self.security is not None or self.speaks < 3)

    def _speak_changed(self) -> None:
        """Publish presence again in the version now spoken: a peer that runs an older
        protocol dropped the presence sent before it was heard."""
        if self.mqtt.connected:
            self.inbound.spawn(self.mqtt.publish_presence())

    # ------------------------------------------------------------------ envelopes
    def _will(self) -> bytes:
        """The Last Will of a new connection: each connection is a new signing session, so
        its Will outranks the presence of older ones."""
        if self.security is not None:
            self.security.new_session()
        return self._presence_payload("offline", will=True)

    def _presence_payload(self, status: str, will: bool = False) -> bytes:
        info = {**self.presence_info, "status": status}
        if self.inbound.versions.oldest < PROTOCOL_VERSION:  # a peer it hears runs it
            info["oldest"] = self.inbound.versions.oldest
        body: dict[str, Any] = {"presence": info}
        if self.security is not None:  # peers learn our key from the certificate
            body["order"] = self.security.next_presence(will)
            body["cert"] = self.security.certificate_pem
        env = Envelope(
            self.swarm,
            self.node_id,
            0,
            "presence",
            uuid.uuid4().hex[:16],
            body,
            ts=time.time(),
            v=self.speaks,
        )
        return env.pack(self._signer(self.topic("presence", self.node_id)))

    def _signer(self, topic: str) -> Callable[[bytes], bytes] | None:
        sec = self.security
        return None if sec is None else (lambda header: sec.sign(topic, header))

    def _envelope(
        self, kind: str, round_no: int, body: Any, mid: str | None = None, attempt: int = 0
    ) -> Envelope:
        return Envelope(
            self.swarm,
            self.node_id,
            round_no,
            kind,
            mid or uuid.uuid4().hex[:16],
            body,
            attempt=attempt,
            ts=time.time(),
            v=self.speaks,
        )

    # ------------------------------------------------------------------ sending
    async def set_status(self, status: str, **info: Any) -> None:
        """Update this node's retained presence (e.g. ``online`` → ``done``)."""
        self.status = status
        self.presence_info.update(info)
        await self.mqtt.publish_presence()

    async def publish_status(self, round_no: int, body: dict[str, Any]) -> None:
        """Publish a telemetry ``status`` (:mod:`p2pfl.wire.status`) on this node's status
        topic: QoS 0, not retained, and only when connected (it never waits for the broker;
        disconnected, it is dropped). It is not counted in :attr:`stats`: records measure
        the protocol's cost, and observers are not part of it."""
        topic = self.topic("status", self.node_id)
        await self.mqtt.publish_if_connected(
            topic, lambda: self._envelope("status", round_no, body).pack(self._signer(topic))
        )

    async def gossip(
        self, round_no: int, body: dict[str, Any], *, kind: str = "gossip", attempt: int = 0
    ) -> None:
        """Publish a small per-round message (``gossip`` or ``announce``) on this node's
        gossip topic, which every member of the swarm hears."""
        if kind not in GOSSIP_KINDS:
            raise ValueError(f"{kind!r} is not a gossip kind")
        topic = self.topic("gossip", self.node_id)
        payload = self._envelope(kind, round_no, body, attempt=attempt).pack(self._signer(topic))
        if len(payload) > self.max_message_bytes:
            raise TransportError(f"{kind} of {len(payload)} bytes exceeds the message limit")
        await self.mqtt.publish(topic, payload)

    async def send(
        self,
        to: str,
        kind: str,
        round_no: int,
        body: Any,
        mid: str | None = None,
        *,
        attempt: int = 0,
    ) -> None:
        """Send one message to ``to``'s inbox (a ``pull_error`` answering a pull that came
        over the direct lane goes back on that connection)."""
        topic = self.topic("inbox", to)
        payload = self._envelope(kind, round_no, body, mid, attempt).pack(self._signer(topic))
        if len(payload) > self.max_message_bytes:
            raise TransportError(f"{kind} of {len(payload)} bytes exceeds the message limit")
        if kind == "pull_error" and isinstance(body, dict) and self.direct is not None:
            writer = self.direct.take_reply(str(body.get("xfer")))
            if writer is not None:
                await self.direct.write(writer, direct.frame(payload))
                return
        await self.mqtt.publish(topic, payload)

    async def _refuse_unanswered(self, env: Envelope) -> None:
        """A direct pull the node's handler returned from without answering."""
        await self.send(
            env.sender, "pull_error", env.round, {"xfer": env.id, "reason": "no answer"}
        )

    # ------------------------------------------------------------------ transfers
    async def pull(
        self,
        peer: str,
        round_no: int,
        part: str,
        timeout: float,
        *,
        attempt: int = 0,
        max_bytes: int | None = None,
    ) -> State:
        """Ask ``peer`` for ``part`` of its round-``round_no`` state (of that ``attempt``,
        for the rotating aggregator) and wait for it. A transfer larger than ``max_bytes``
        (at most, and by default, ``max_transfer_bytes``) is refused before any memory is
        allocated for it.

        With :attr:`streams` (top-k), the request's body names the base held of ``peer``'s
        stream of ``part`` (``base: [epoch, seq]``) and a top-k answer comes back decoded
        with it (:class:`~p2pfl.wire.streams.ReceivedStreams`).

        Raises :class:`TransportError` on refusal, timeout, a corrupt transfer (a top-k
        answer that does not decode included), or as soon as ``peer``'s presence is (or
        goes) ``offline``."""
        streams = self.streams
        if streams is None:
            return await self._pull(
                peer, round_no, part, {"part": part}, timeout, attempt, max_bytes
            )
        body: dict[str, Any] = {"part": part}
        base = streams.base(peer, part)
        if base is not None:
            body["base"] = list(base)
        state = await self._pull(peer, round_no, part, body, timeout, attempt, max_bytes)
        limit = self._limit(max_bytes)
        try:
            return await asyncio.to_thread(streams.decode, peer, part, state, max_bytes=limit)
        except CompressError as exc:
            self.drop("bad_transfer", f"state from {peer} rejected: {exc}")
            raise TransportError(f"{part!r} from {peer} does not decode: {exc}") from None

    def _limit(self, max_bytes: int | None) -> int:
        return (
            self.max_transfer_bytes
            if max_bytes is None
            else min(max_bytes, self.max_transfer_bytes)
        )

    async def _pull(
        self,
        peer: str,
        round_no: int,
        part: str,
        body: dict[str, Any],
        timeout: float,
        attempt: int,
        max_bytes: int | None,
    ) -> State:
        """:meth:`pull` with the request's ``body``: the transfer, on either lane."""
        if self.peers.get(peer, {}).get("status") == "offline":
            raise TransportError(f"pull of {part!r} from {peer}: {peer} is offline")
        xfer = uuid.uuid4().hex[:16]
        limit = self._limit(max_bytes)
        deadline = asyncio.get_running_loop().time() + timeout
        address = direct.parse_address(self.peers.get(peer, {}).get("direct"))
        # the future fails when the peer goes offline or the transport closes (both lanes)
        fut = self.transfers.expect(xfer, peer, limit)
        try:
            if address is not None and self.direct is not None:

                def request() -> bytes:  # made once connected, signed for peer's inbox
                    env = self._envelope("pull", round_no, body, xfer, attempt)
                    return env.pack(self._signer(self.topic("inbox", peer)))

                fetch = self.direct.pull(peer, address, request, xfer, limit)
                state = await self._race_direct(peer, fetch, fut, deadline)
                if state is not None:
                    self._pulled(peer, "direct")
                    return state
            await self.send(peer, "pull", round_no, body, mid=xfer, attempt=attempt)
            remaining = max(0.0, deadline - asyncio.get_running_loop().time())
            state = await asyncio.wait_for(fut, remaining)
            self._pulled(peer, "mqtt")
            return state
        except asyncio.TimeoutError:
            raise TransportError(
                f"pull of {part!r} from {peer} timed out after {timeout:.1f} s"
            ) from None
        except TransferError as exc:
            raise TransportError(str(exc)) from None
        finally:
            self.transfers.forget(xfer)

    def _pulled(self, peer: str, lane: str) -> None:
        self.pull_lanes.append((peer, lane))
        if lane == "direct":
            self.direct_answered.add(peer)
        self.pulls += 1

    async def _race_direct(
        self, peer: str, fetch: Awaitable[State], watch: asyncio.Future, deadline: float
    ) -> State | None:
        """Run a pull's direct attempt ``fetch`` from ``peer`` until the loop-time ``deadline``, against
        ``watch`` (the pull's future, which fails when the peer goes offline). Returns the
        state, or None when the peer cannot be reached directly (the caller falls back to
        MQTT); raises the peer's going offline, the direct pull's own failure, or
        :class:`asyncio.TimeoutError`."""
        task = asyncio.ensure_future(fetch)
        try:
            remaining = max(0.0, deadline - asyncio.get_running_loop().time())
            done, _ = await asyncio.wait(
                {task, watch}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            if not task.done():
                task.cancel()
        if task not in done:
            if watch in done:
                watch.result()  # raises: the peer went offline
            raise asyncio.TimeoutError
        try:
            return task.result()
        except direct.DirectUnreachable as exc:
            log.info("%s: %s not reachable directly (%s): over MQTT", self.node_id, peer, exc)
        if watch.done():
            watch.result()  # it went offline meanwhile: no pull over MQTT either
        return None

    async def send_state(self, to: str, xfer: str, round_no: int, prepared: PreparedState) -> None:
        """Answer a pull: metadata, then the bytes: over the pull's direct connection when
        it came that way, else numbered chunks on MQTT (QoS 1, a window in flight)."""
        meta = {
            "xfer": xfer,
            "total": len(prepared.buf),
            "chunk": self.chunk_bytes,
            "nchunks": prepared.nchunks(self.chunk_bytes),
            "digest": prepared.digest_name,
            "hexdigest": prepared.hexdigest,
            "index": prepared.index,
        }
        writer = self.direct.take_reply(xfer) if self.direct is not None else None
        if writer is not None:
            assert self.direct is not None
            topic = self.topic("inbox", to)
            env = self._envelope("xfer_meta", round_no, meta).pack(self._signer(topic))
            await self.direct.write(writer, direct.frame(env), memoryview(prepared.buf))
            return
        await self.send(to, "xfer_meta", round_no, meta)
        topic = self.topic("inbox", to)
        sign = self._signer(topic)  # chunk headers; their bytes are covered by the digest
        view = memoryview(prepared.buf)
        pending: set[asyncio.Task] = set()
        try:
            for seq in range(meta["nchunks"]):
                data = view[seq * self.chunk_bytes : (seq + 1) * self.chunk_bytes]
                payload = Envelope(
                    self.swarm,
                    self.node_id,
                    round_no,
                    "xfer_chunk",
                    uuid.uuid4().hex[:16],
                    {"xfer": xfer, "seq": seq},
                    data,
                    ts=time.time(),
                    v=self.speaks,
                ).pack(sign)
                pending.add(asyncio.create_task(self.mqtt.publish(topic, payload)))
                if len(pending) >= PUBLISH_WINDOW:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for t in done:
                        t.result()
            if pending:
                for t in await asyncio.gather(*pending, return_exceptions=True):
                    if isinstance(t, Exception):
                        raise t
        finally:
            for t in pending:
                t.cancel()

    # ------------------------------------------------------------------ drops
    def drop(self, reason: str, detail: Any = "") -> None:
        """Count a dropped message and log it (:meth:`ReceivePipeline.drop`)."""
        self.inbound.drop(reason, detail)
