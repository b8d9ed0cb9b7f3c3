"""MQTT transport for one node: presence, gossip, inbox, and chunked weight transfers.

Topics live under ``p2pfl/<swarm>/`` (docs/wire.md, "Topics"):

- ``presence/<id>``: retained ``{status, ...}``; the MQTT Last Will sets ``offline``;
- ``gossip/<id>``: small per-round messages (representations) for the neighbours;
- ``inbox/<id>``: requests (``pull``) and replies (``xfer_meta``, ``xfer_chunk``,
  ``pull_error``) addressed to one node;
- ``status/<id>``: live telemetry for observers (:meth:`Transport.publish_status`), which
  no node subscribes to.

Every message is an :class:`~p2pfl.wire.envelope.Envelope` — swarm, sender, round, kind, id,
body — packed with :mod:`p2pfl.wire.codec`. Anything oversized, undecodable, from another swarm, of an unknown kind,
duplicated, or otherwise malformed is dropped with a log line and counted in
:attr:`Transport.dropped`; it never raises into the node.

Weights move on request only (:meth:`Transport.pull`): the owner answers with a metadata
message (transfer id, total size, digest, tensor index) followed by numbered ~1 MiB chunks,
reassembled into one preallocated buffer on the receiver and verified before use
(:mod:`p2pfl.wire.transfers`, which reports what it rejects through :meth:`Transport.drop`).
With a :class:`~p2pfl.wire.direct.DirectLane`, a pull first goes straight to the serving
peer over TCP (:mod:`p2pfl.wire.direct`: the same request, metadata, digest and limits,
mutual TLS when the swarm uses TLS); the MQTT lane is the fallback when the peer announces
no direct address or cannot be reached. :attr:`Transport.pull_lanes` says which lane each
pull used (the latest :data:`PULL_LANES_KEPT`; :attr:`Transport.pulls` counts them all).

A node subscribes to the presence and gossip of every node (``+`` wildcards) unless it is
given ``listen_to``, the peers it talks to: then it subscribes to their topics only, so in a
sparse graph the broker delivers each presence and gossip message to a node's neighbours
instead of to the whole swarm (``N·k`` deliveries a round instead of ``N²``).

The client lives in a reconnect loop (aiomqtt has none of its own) that resubscribes and
re-announces presence after every reconnect. Use as ``async with Transport(...) as t:``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import time
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiomqtt
import numpy as np

from p2pfl.errors import P2PFLError
from p2pfl.wire import direct
from p2pfl.wire.codec import CodecError, buffer_to_state
from p2pfl.wire.digest import new_hasher, transfer_digest
from p2pfl.wire.envelope import GOSSIP_KINDS, INBOX_KINDS, Envelope
from p2pfl.wire.transfers import (
    CHUNK_BYTES,
    IncomingTransfers,
    PreparedState,
    State,
    TransferError,
    check_meta,
)

if TYPE_CHECKING:
    from p2pfl.security.signing import MessageSecurity

log = logging.getLogger(__name__)

PUBLISH_WINDOW = 16  # QoS-1 publishes in flight per transfer
PULL_LANES_KEPT = 4096  # lanes of the latest pulls kept (a round's records read them)


class TransportError(P2PFLError, RuntimeError):
    """A send or pull that could not complete (disconnected, refused, timed out, corrupt)."""


class BrokerLostError(TransportError):
    """The broker has been unreachable for longer than the node is willing to wait."""


@dataclass
class TransportStats:
    bytes_sent: int = 0  # both lanes
    bytes_recv: int = 0
    messages_sent: int = 0
    messages_recv: int = 0
    direct_bytes_sent: int = 0  # the direct lane's share of bytes_sent / bytes_recv
    direct_bytes_recv: int = 0

    def sent_direct(self, nbytes: int, messages: int) -> None:
        """Count bytes (and messages) sent on the direct lane, in both totals."""
        self.bytes_sent += nbytes
        self.direct_bytes_sent += nbytes
        self.messages_sent += messages

    def received_direct(self, nbytes: int, messages: int) -> None:
        """Count bytes (and messages) received on the direct lane, in both totals."""
        self.bytes_recv += nbytes
        self.direct_bytes_recv += nbytes
        self.messages_recv += messages


class Transport:
    """One node's MQTT connection. Callbacks:

    - ``on_gossip(envelope)`` for gossip and announcements from other nodes,
    - ``on_request(envelope)`` (a coroutine) for ``pull`` requests addressed to this node,
    - ``on_inbox(envelope)`` for other small messages addressed to this node (``report``),
    - ``on_presence(node_id, status_dict)`` when a presence changes.
    """

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
        broker_timeout: float | None = None,
        client_factory: Callable[..., aiomqtt.Client] | None = None,
        security: MessageSecurity | None = None,
        tls_context: ssl.SSLContext | None = None,
        direct_lane: direct.DirectLane | None = None,
        listen_to: Sequence[str] | None = None,
    ):
        self.swarm = swarm
        self.node_id = node_id
        self.host, self.port = host, port
        self.prefix = f"p2pfl/{swarm}"
        self.presence_info = dict(presence or {})
        self.status = "online"
        self.max_message_bytes = max_message_bytes
        self.max_transfer_bytes = max_transfer_bytes
        self.chunk_bytes = chunk_bytes
        self.connect_timeout = connect_timeout
        self.broker_timeout = broker_timeout  # None: ride out any outage
        self._client_factory = client_factory or aiomqtt.Client
        self.security = security  # sign what we send, verify what we receive
        self.tls_context = tls_context  # TLS with a client certificate to the broker
        self.stats = TransportStats()
        self.dropped: Counter[str] = Counter()
        self.peers: dict[str, dict[str, Any]] = {}  # latest presence of every node seen
        self.on_gossip: Callable[[Envelope], None] | None = None
        self.on_request: Callable[[Envelope], Awaitable[None]] | None = None
        self.on_inbox: Callable[[Envelope], None] | None = None
        self.on_presence: Callable[[str, dict[str, Any]], None] | None = None
        self._client: aiomqtt.Client | None = None
        self._connected = asyncio.Event()
        self._lost = asyncio.Event()  # the connection dropped and is not back yet
        self._down_since: float | None = None  # monotonic time the current outage began
        self._offline_total = 0.0  # seconds without a broker in finished outages
        self._session_end: asyncio.Future | None = None  # done when this connection is lost
        self._closing = False
        self._task: asyncio.Task | None = None
        signed = security is not None
        self.transfers = IncomingTransfers(
            node_id, max_message_bytes, self.drop, self._spawn, signed=signed
        )
        self.digest_name = transfer_digest(signed)  # for the states this node serves
        self._seen_ids: OrderedDict[str, None] = OrderedDict()
        self._request_tasks: set[asyncio.Task] = set()
        self.direct_lane = direct_lane  # None: no direct lane (serve and pull over MQTT)
        self._direct_server: asyncio.Server | None = None
        self._direct_replies: dict[str, asyncio.StreamWriter] = {}  # pulls being served
        # (peer, "direct" | "mqtt") of the latest pulls, oldest first; ``pulls`` counts all
        self.pull_lanes: deque[tuple[str, str]] = deque(maxlen=PULL_LANES_KEPT)
        self.pulls = 0
        # whose presence and gossip to hear: None, every node (wildcards)
        self.listen_to = None if listen_to is None else sorted(set(listen_to) - {node_id})

    # ------------------------------------------------------------------ lifecycle
    def topic(self, kind: str, node: str) -> str:
        return f"{self.prefix}/{kind}/{node}"

    def subscriptions(self) -> list[str]:
        """The topic filters this node subscribes to: its inbox, and the presence and gossip
        of the peers it listens to (of every node, when ``listen_to`` is None)."""
        heard = ["+"] if self.listen_to is None else self.listen_to
        return [
            self.topic("inbox", self.node_id),
            *(self.topic(kind, peer) for peer in heard for kind in ("presence", "gossip")),
        ]

    async def __aenter__(self) -> Transport:
        if self.direct_lane is not None:
            await self._start_direct(self.direct_lane)
        self._task = asyncio.create_task(self._run(), name=f"mqtt-{self.node_id}")
        try:
            await asyncio.wait_for(self._connected.wait(), self.connect_timeout)
        except asyncio.TimeoutError:
            await self.close(graceful=False)
            raise TransportError(
                f"{self.node_id}: no MQTT broker reachable at {self.host}:{self.port} "
                f"within {self.connect_timeout:.0f} s"
            ) from None
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self, graceful: bool = True) -> None:
        """Announce ``offline`` (graceful) and disconnect; idempotent."""
        if graceful and self._connected.is_set():
            self.status = "offline"
            with contextlib.suppress(Exception):
                await self._publish_presence()
        self._closing = True
        self.transfers.close()
        if self._direct_server is not None:
            self._direct_server.close()
            self._direct_server = None
        for writer in self._direct_replies.values():
            writer.close()
        for t in list(self._request_tasks):
            t.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self._connected.clear()

    def _will(self) -> aiomqtt.Will:
        return aiomqtt.Will(
            topic=self.topic("presence", self.node_id),
            payload=self._presence_payload("offline", will=True),
            qos=1,
            retain=True,
        )

    def _presence_payload(self, status: str, will: bool = False) -> bytes:
        body: dict[str, Any] = {"presence": {**self.presence_info, "status": status}}
        if self.security is not None:  # peers learn our key from the certificate
            body["order"] = self.security.next_presence(will)
            body["cert"] = self.security.certificate_pem
        env = Envelope(
            self.swarm, self.node_id, 0, "presence", uuid.uuid4().hex[:16], body, ts=time.time()
        )
        return env.pack(self._signer(self.topic("presence", self.node_id)))

    def _signer(self, topic: str) -> Callable[[bytes], bytes] | None:
        sec = self.security
        return None if sec is None else (lambda header: sec.sign(topic, header))

    async def _run(self) -> None:
        backoff = 0.2
        while not self._closing:
            if self.security is not None:  # this connection's Will outranks older ones
                self.security.new_session()
            try:
                async with self._client_factory(
                    self.host,
                    self.port,
                    identifier=f"p2pfl-{self.swarm}-{self.node_id}-{uuid.uuid4().hex[:6]}",
                    will=self._will(),
                    keepalive=15,
                    timeout=30,
                    max_inflight_messages=PUBLISH_WINDOW * 2,
                    max_queued_outgoing_messages=0,
                    # small requests must not wait behind delayed ACKs (Nagle): 40 ms each
                    socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
                    tls_context=self.tls_context,
                ) as client:
                    client.pending_calls_threshold = PUBLISH_WINDOW * 4  # windowed on purpose
                    self._client = client
                    self._session_end = asyncio.get_running_loop().create_future()
                    await client.subscribe([(t, 1) for t in self.subscriptions()])
                    await self._publish_presence(client)
                    self._connected.set()
                    self._back_online()
                    backoff = 0.2
                    async for message in client.messages:
                        self._dispatch(str(message.topic), message.payload)
            except (aiomqtt.MqttError, TransportError) as exc:
                self._end_session()
                self._connected.clear()
                self._client = None
                if self._closing:
                    break
                if self._down_since is None:
                    self._down_since = time.monotonic()
                    self._lost.set()
                log.warning("%s: MQTT connection lost (%s); reconnecting", self.node_id, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
        self._end_session()
        self._client = None

    def _end_session(self) -> None:
        """The connection is gone: what is still being published on it fails now."""
        if self._session_end is not None and not self._session_end.done():
            self._session_end.set_result(None)

    # ------------------------------------------------------------------ broker outages
    def _back_online(self) -> None:
        if self._down_since is not None:
            outage = time.monotonic() - self._down_since
            self._offline_total += outage
            log.warning("%s: broker back after %.1f s", self.node_id, outage)
        self._down_since = None
        self._lost.clear()

    def offline_seconds(self) -> float:
        """Seconds spent without a broker since the first connection (the current outage
        included)."""
        current = 0.0 if self._down_since is None else time.monotonic() - self._down_since
        return self._offline_total + current

    async def watch_broker(self) -> None:
        """Return never; raise :class:`BrokerLostError` once the broker has been unreachable
        for ``broker_timeout`` seconds in one outage (never when it is None). Run it beside
        the work that needs the broker and stop that work when it raises."""
        while True:
            await self._lost.wait()
            if self.broker_timeout is None or self._down_since is None:
                await self._connected.wait()
                continue
            left = self._down_since + self.broker_timeout - time.monotonic()
            try:
                await asyncio.wait_for(self._connected.wait(), max(0.0, left))
            except asyncio.TimeoutError:
                raise BrokerLostError(
                    f"{self.node_id}: broker {self.host}:{self.port} unreachable for "
                    f"{self.broker_timeout:.0f} s (timing.broker_timeout_s); stopping"
                ) from None

    # ------------------------------------------------------------------ sending
    async def _publish(
        self, topic: str, payload: bytes, qos: int = 1, retain: bool = False
    ) -> None:
        if not self._connected.is_set():
            try:
                await asyncio.wait_for(self._connected.wait(), self.connect_timeout)
            except asyncio.TimeoutError:
                raise TransportError(f"{self.node_id}: not connected to the broker") from None
        client = self._client
        if client is None:
            raise TransportError(f"{self.node_id}: not connected to the broker")
        await self._publish_on(client, topic, payload, qos, retain)

    async def _publish_on(
        self, client: aiomqtt.Client, topic: str, payload: bytes, qos: int, retain: bool
    ) -> None:
        # a publish on a connection that drops would otherwise wait for its acknowledgement
        # until aiomqtt's 30 s timeout: it fails as soon as the connection is lost
        ended = self._session_end
        publish = asyncio.ensure_future(client.publish(topic, payload, qos=qos, retain=retain))
        try:
            if ended is not None:
                await asyncio.wait({publish, ended}, return_when=asyncio.FIRST_COMPLETED)
            else:
                await asyncio.wait({publish})
        finally:
            unfinished = not publish.done()
            if unfinished:
                publish.cancel()
        if unfinished:
            raise TransportError(f"{self.node_id}: connection lost while publishing to {topic}")
        try:
            publish.result()
        except aiomqtt.MqttError as exc:
            raise TransportError(f"{self.node_id}: publish to {topic} failed: {exc}") from exc
        self.stats.bytes_sent += len(payload)
        self.stats.messages_sent += 1

    async def _publish_presence(self, client: aiomqtt.Client | None = None) -> None:
        topic = self.topic("presence", self.node_id)
        payload = self._presence_payload(self.status)
        if client is not None:
            await self._publish_on(client, topic, payload, 1, True)
        else:
            await self._publish(topic, payload, qos=1, retain=True)

    async def set_status(self, status: str, **info: Any) -> None:
        """Update this node's retained presence (e.g. ``online`` → ``done``)."""
        self.status = status
        self.presence_info.update(info)
        await self._publish_presence()

    async def publish_status(self, round_no: int, body: dict[str, Any]) -> None:
        """Publish a telemetry ``status`` (:mod:`p2pfl.wire.status`) on this node's status
        topic: QoS 0, not retained, and only when connected (it never waits for the broker;
        disconnected, it is dropped). It is not counted in :attr:`stats`: records measure
        the protocol's cost, and observers are not part of it."""
        client = self._client
        if client is None or not self._connected.is_set():
            return
        topic = self.topic("status", self.node_id)
        payload = self._envelope("status", round_no, body).pack(self._signer(topic))
        try:
            await client.publish(topic, payload, qos=0)
        except aiomqtt.MqttError as exc:
            raise TransportError(f"{self.node_id}: status not published: {exc}") from exc

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
        await self._publish(topic, payload)

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
        if kind == "pull_error" and isinstance(body, dict):
            writer = self._direct_replies.pop(str(body.get("xfer")), None)
            if writer is not None:
                await self._direct_write(writer, direct.frame(payload))
                return
        await self._publish(topic, payload)

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

        Raises :class:`TransportError` on refusal, timeout, a corrupt transfer, or as soon
        as ``peer``'s presence is (or goes) ``offline``."""
        if self.peers.get(peer, {}).get("status") == "offline":
            raise TransportError(f"pull of {part!r} from {peer}: {peer} is offline")
        xfer = uuid.uuid4().hex[:16]
        limit = (
            self.max_transfer_bytes
            if max_bytes is None
            else min(max_bytes, self.max_transfer_bytes)
        )
        deadline = asyncio.get_running_loop().time() + timeout
        address = direct.parse_address(self.peers.get(peer, {}).get("direct"))
        # the future fails when the peer goes offline or the transport closes (both lanes)
        fut = self.transfers.expect(xfer, peer, limit)
        try:
            if address is not None and self.direct_lane is not None:
                fetch = self._pull_direct(peer, address, xfer, round_no, part, attempt, limit)
                state = await self._race_direct(peer, fetch, fut, deadline)
                if state is not None:
                    self._pulled(peer, "direct")
                    return state
            await self.send(peer, "pull", round_no, {"part": part}, mid=xfer, attempt=attempt)
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
        writer = self._direct_replies.pop(xfer, None)
        if writer is not None:
            topic = self.topic("inbox", to)
            env = self._envelope("xfer_meta", round_no, meta).pack(self._signer(topic))
            await self._direct_write(writer, direct.frame(env), memoryview(prepared.buf))
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
                ).pack(sign)
                pending.add(asyncio.create_task(self._publish(topic, payload)))
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

    # ------------------------------------------------------------------ direct lane
    async def _start_direct(self, lane: direct.DirectLane) -> None:
        try:
            self._direct_server = await asyncio.start_server(
                self._serve_direct, lane.bind, lane.port, ssl=lane.server_tls
            )
        except OSError as exc:
            raise TransportError(
                f"{self.node_id}: cannot listen for direct pulls on {lane.bind}:{lane.port}: {exc}"
            ) from None
        port = self._direct_server.sockets[0].getsockname()[1]
        self.presence_info["direct"] = f"{lane.advertise}:{port}"

    @property
    def direct_address(self) -> str | None:
        """``host:port`` this node serves direct pulls on (announced in presence)."""
        return self.presence_info.get("direct") if self._direct_server is not None else None

    async def _direct_write(
        self, writer: asyncio.StreamWriter, head: bytes, data: memoryview | None = None
    ) -> None:
        try:
            writer.write(head)
            if data is not None:
                await direct.send_buffer(writer, data)
            await writer.drain()
        except (ConnectionError, OSError) as exc:
            raise TransportError(f"{self.node_id}: direct connection lost: {exc}") from None
        self.stats.sent_direct(len(head) + (0 if data is None else len(data)), messages=1)

    async def _serve_direct(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        """One direct connection: read the pull, check it as an inbox message, hand it to
        ``on_request``; the answer goes back on this connection (``send_state`` or a
        ``pull_error``). Anything off closes the connection and is counted in ``dropped``."""
        peer = writer.get_extra_info("peername")
        env: Envelope | None = None
        try:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            head = await asyncio.wait_for(
                reader.readexactly(len(direct.MAGIC) + direct.LENGTH.size),
                direct.REQUEST_TIMEOUT_S,
            )
            if head[: len(direct.MAGIC)] != direct.MAGIC:
                self.drop("direct_bad_magic", peer)
                return
            (size,) = direct.LENGTH.unpack(head[len(direct.MAGIC) :])
            if size > self.max_message_bytes:
                self.drop("oversized", f"direct request from {peer}: {size} bytes")
                return
            payload = await asyncio.wait_for(reader.readexactly(size), direct.REQUEST_TIMEOUT_S)
            self.stats.received_direct(len(head) + size, messages=1)
            env = self._accept_direct(payload, writer)
            if env is None or self.on_request is None:
                return
            self._direct_replies[env.id] = writer
            await self.on_request(env)
            if self._direct_replies.pop(env.id, None) is not None:  # served nothing
                await self.send(
                    env.sender, "pull_error", env.round, {"xfer": env.id, "reason": "no answer"}
                )
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError, OSError) as exc:
            log.debug("%s: direct connection from %s ended: %r", self.node_id, peer, exc)
        except TransportError as exc:
            log.info("%s: direct pull from %s: %s", self.node_id, peer, exc)
        except Exception as exc:  # a peer's bytes must never kill the node
            self.drop("handler_error", f"direct from {peer}: {exc!r}")
        finally:
            if env is not None:
                self._direct_replies.pop(env.id, None)
            writer.close()

    def _accept_direct(self, payload: bytes, writer: asyncio.StreamWriter) -> Envelope | None:
        """A direct request passes the checks of a ``pull`` in this node's inbox: shape,
        swarm, kind, signature and freshness, duplicates; with TLS, the client
        certificate's CN must be the sender. None (and counted) when it does not."""
        topic = self.topic("inbox", self.node_id)
        try:
            env = Envelope.unpack(payload, self.max_message_bytes)
        except CodecError as exc:
            self.drop("malformed", f"direct: {exc}")
            return None
        if env.swarm != self.swarm:
            self.drop("foreign_swarm", f"direct: swarm {env.swarm!r}")
            return None
        if env.kind != "pull" or env.sender == self.node_id:
            self.drop("unexpected_kind", f"direct: {env.kind} from {env.sender!r}")
            return None
        if self.direct_lane is not None and self.direct_lane.server_tls is not None:
            cn = direct.peer_common_name(writer.transport)
            if cn != env.sender:
                self.drop(
                    "sender_mismatch", f"direct: certificate {cn!r}, pull from {env.sender!r}"
                )
                return None
        if self.security is not None:
            reason = self._authenticate(topic, env)
            if reason is not None:
                self.drop(reason, f"direct: pull claiming to be from {env.sender!r}")
                return None
        if env.id in self._seen_ids:
            self.drop("duplicate", f"direct: id {env.id}")
            return None
        self._remember(env.id)
        return env

    async def _pull_direct(
        self,
        peer: str,
        address: tuple[str, int],
        xfer: str,
        round_no: int,
        part: str,
        attempt: int,
        limit: int,
    ) -> State:
        """One pull over the direct lane; :class:`~p2pfl.wire.direct.DirectUnreachable`
        when the connection cannot be opened (the caller falls back to MQTT), else the state
        or :class:`TransportError`."""
        lane = self.direct_lane
        assert lane is not None
        tls = lane.client_tls
        conn, rx = await direct.connect(*address, tls, lane.connect_timeout)
        try:
            if tls is not None and direct.peer_common_name(conn) != peer:
                raise TransportError(
                    f"direct pull from {peer}: {address[0]}:{address[1]} presented a "
                    f"certificate for {direct.peer_common_name(conn)!r}"
                )
            request = self._envelope("pull", round_no, {"part": part}, xfer, attempt)
            payload = request.pack(self._signer(self.topic("inbox", peer)))
            conn.write(direct.MAGIC + direct.frame(payload))
            self.stats.sent_direct(
                len(direct.MAGIC) + direct.LENGTH.size + len(payload), messages=0
            )
            reply = self._check_direct_reply(peer, await rx.read_frame(self.max_message_bytes))
            body = reply.body if isinstance(reply.body, dict) else {}
            if reply.kind == "pull_error":
                raise TransportError(f"{peer} refused the pull: {body.get('reason')}")
            if reply.kind != "xfer_meta" or body.get("xfer") != xfer:
                raise TransportError(f"direct pull from {peer}: unexpected {reply.kind}")
            meta = check_meta(body, limit, self.max_message_bytes, signed=self.transfers.signed)
            # uninitialised (no memset): every byte is overwritten before use
            buf = memoryview(np.empty(meta.total, dtype=np.uint8)).cast("B")
            try:  # the index checked and the tensors laid over the buffer while bytes come
                state = buffer_to_state(meta.index, buf)
            except CodecError as exc:
                raise TransportError(f"transfer from {peer}: bad tensor index: {exc}") from None
            hasher = new_hasher(meta.digest_name)
            rx.sink = hasher.update  # each piece hashed as it lands (p2pfl.wire.direct)
            await rx.read_into(buf)
            rx.sink = None
            self.stats.received_direct(rx.received, messages=1)
            if hasher.hexdigest() != meta.hexdigest:
                self.drop("bad_transfer", f"direct transfer from {peer} rejected: digest mismatch")
                raise TransportError(f"transfer from {peer}: digest mismatch")
            return state  # its tensors share ``buf``, now filled and verified
        except TransferError as exc:
            self.drop("bad_transfer", f"direct transfer from {peer} rejected: {exc}")
            raise TransportError(f"transfer from {peer}: {exc}") from None
        except (ConnectionError, ValueError) as exc:
            raise TransportError(f"direct pull from {peer}: {exc}") from None
        finally:
            conn.close()

    def _pulled(self, peer: str, lane: str) -> None:
        self.pull_lanes.append((peer, lane))
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

    def _check_direct_reply(self, peer: str, payload: bytes) -> Envelope:
        """The server's answer frame, checked as an inbox message from ``peer``."""
        try:
            env = Envelope.unpack(payload, self.max_message_bytes)
        except CodecError as exc:
            self.drop("malformed", f"direct reply from {peer}: {exc}")
            raise TransportError(f"direct pull from {peer}: malformed reply") from None
        if env.swarm != self.swarm or env.sender != peer:
            self.drop("sender_mismatch", f"direct reply from {peer}: {env.sender!r}")
            raise TransportError(f"direct pull from {peer}: reply from {env.sender!r}")
        if self.security is not None:
            reason = self._authenticate(self.topic("inbox", self.node_id), env)
            if reason is not None:
                self.drop(reason, f"direct reply claiming to be from {peer!r}")
                raise TransportError(f"direct pull from {peer}: reply refused ({reason})")
        return env

    def _remember(self, mid: str) -> None:
        self._seen_ids[mid] = None
        while len(self._seen_ids) > 50_000:
            self._seen_ids.popitem(last=False)

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._request_tasks.add(task)
        task.add_done_callback(self._request_done)

    # ------------------------------------------------------------------ receiving
    def drop(self, reason: str, detail: Any = "") -> None:
        """Count a dropped message and log it: the first ten of each reason, then every
        thousandth, so a peer that floods a node with garbage cannot flood its log too."""
        self.dropped[reason] += 1
        n = self.dropped[reason]
        if n <= 10 or n % 1000 == 0:
            more = f" [{n} so far]" if n > 10 else ""
            log.warning(
                "%s: dropped message (%s) %s%s", self.node_id, reason, str(detail)[:200], more
            )

    def _dispatch(self, topic: str, payload: Any) -> None:
        """Route one incoming MQTT message; never raises."""
        try:
            self._dispatch_unsafe(topic, payload)
        except Exception as exc:  # a peer's bytes must never kill the node
            self.drop("handler_error", f"{topic}: {exc!r}")

    def _dispatch_unsafe(self, topic: str, payload: Any) -> None:
        if not isinstance(payload, (bytes, bytearray)):
            self.drop("not_bytes", topic)
            return
        size = len(payload)
        self.stats.bytes_recv += size
        self.stats.messages_recv += 1
        if size > self.max_message_bytes:
            self.drop("oversized", f"{topic}: {size} bytes")
            return
        parts = topic.split("/")
        if len(parts) != 4 or "/".join(parts[:2]) != self.prefix:
            self.drop("foreign_topic", topic)
            return
        channel, owner = parts[2], parts[3]
        try:
            env = Envelope.unpack(payload, self.max_message_bytes)
        except CodecError as exc:
            self.drop("malformed", f"{topic}: {exc}")
            return
        if env.swarm != self.swarm:
            self.drop("foreign_swarm", f"{topic}: swarm {env.swarm!r}")
            return
        if channel in ("presence", "gossip") and env.sender != owner:
            self.drop("sender_mismatch", f"{topic}: from {env.sender!r}")
            return
        if env.sender == self.node_id and channel != "inbox":
            return  # our own presence or gossip, echoed back by the broker
        if self.security is not None:
            reason = self._authenticate(topic, env)
            if reason == "same":
                return  # a retained presence we already hold, delivered again
            if reason is not None:
                detail = f"{topic}: {env.kind} claiming to be from {env.sender!r}"
                if reason == "stale":  # or the two clocks disagree: say by how much
                    detail += f", sent {time.time() - env.ts:+.0f} s ago"
                self.drop(reason, detail)
                return
        if channel == "presence":
            body = env.body
            info = body.get("presence") if isinstance(body, dict) else None
            if (
                env.kind != "presence"
                or not isinstance(info, dict)
                or not isinstance(info.get("status"), str)
            ):
                self.drop("malformed", f"{topic}: bad presence")
                return
            self.peers[owner] = info
            if info["status"] == "offline":  # its Last Will: what it was sending never comes
                self.transfers.fail_peer(owner, f"{owner} went offline")
            if self.on_presence is not None:
                self.on_presence(owner, info)
            return
        if env.id in self._seen_ids:
            self.drop("duplicate", f"{topic}: id {env.id}")
            return
        self._remember(env.id)
        if channel == "gossip":
            if env.kind not in GOSSIP_KINDS or not isinstance(env.body, dict):
                self.drop("malformed", f"{topic}: bad gossip")
                return
            if self.on_gossip is not None:
                self.on_gossip(env)
            return
        if channel != "inbox" or owner != self.node_id:
            self.drop("foreign_topic", topic)
            return
        if env.kind == "xfer_chunk":
            self.transfers.on_chunk(env)
        elif env.kind == "xfer_meta":
            self.transfers.on_meta(env)
        elif env.kind == "pull_error":
            self.transfers.on_refused(env)
        elif env.kind == "pull":
            if self.on_request is None:
                return
            self._spawn(self.on_request(env))
        elif env.kind in INBOX_KINDS:
            if self.on_inbox is not None:
                self.on_inbox(env)
        else:
            self.drop("unexpected_kind", f"{topic}: {env.kind}")

    def _authenticate(self, topic: str, env: Envelope) -> str | None:
        """Signature, then freshness, of a message in a signed swarm (p2pfl.security.signing).
        ``None``: accept; ``same``: a presence already held; otherwise the drop reason."""
        sec = self.security
        assert sec is not None
        if env.sig is None or env.header is None:
            return "unsigned"
        if env.kind == "presence":
            body = env.body if isinstance(env.body, dict) else {}
            reason = sec.verify_presence(env.sender, topic, env.header, env.sig, body.get("cert"))
            return reason or sec.presence_order(env.sender, body.get("order"))
        reason = sec.verify(env.sender, topic, env.header, env.sig)
        return reason or sec.replay.check(env.id, env.ts)

    def _request_done(self, task: asyncio.Task) -> None:
        self._request_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("%s: serving a request failed: %r", self.node_id, task.exception())
