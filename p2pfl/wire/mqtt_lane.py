"""The MQTT lane: one node's connection to the broker (docs/wire.md, "Topics",
"Connection" and "Weight transfers").

:class:`MqttLane` keeps an aiomqtt client in a reconnect loop (aiomqtt has none of its
own): on every (re)connect it registers the Last Will, subscribes
(:meth:`MqttLane.subscriptions`, one SUBSCRIBE) and announces presence; it publishes, and
hands every message it receives, raw, to ``on_message`` (the receive pipeline,
:mod:`p2pfl.wire.receive`). It checks no envelope and makes none of its own: the transport
(:mod:`p2pfl.wire.transport`) gives it the presence and Will payloads, ready to send, and
``pack``, which makes this node's envelopes for a peer's inbox.

It is also a :class:`~p2pfl.wire.lane.Lane`, the one that reaches every peer: a pull is a
``pull`` message to the peer's inbox, whose answer (``xfer_meta``, then numbered
``xfer_chunk`` messages) the receive pipeline reassembles
(:class:`~p2pfl.wire.transfers.IncomingTransfers`); an answer is that metadata and the
state's buffer cut into chunks of the size it announces, each one QoS-1 message,
:data:`PUBLISH_WINDOW` of them in flight (a single message would be copied over and over
by the client, and capped by the broker).

Until the first connection succeeds, a failed attempt (refused, timed out, handshake cut
short: a broker still starting, or slow) is logged once, as one line, and retried after an
exponential backoff with full jitter (:func:`first_connection_waits`, seeded with the node
id); the caller bounds the whole wait (:meth:`MqttLane.wait_connected`). After that, a lost
connection is an outage: retried every 0.2 s doubling to 5 s, timed
(:meth:`MqttLane.offline_seconds`), and one longer than ``broker_timeout`` ends
:meth:`MqttLane.watch_broker` with :class:`~p2pfl.wire.errors.BrokerLostError`. A publish on
a connection that drops fails at once (:class:`~p2pfl.wire.errors.TransportError`); a
publish while disconnected waits for the connection up to ``connect_timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import socket
import ssl
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import aiomqtt

from p2pfl.background import cancel_and_wait
from p2pfl.wire.errors import BrokerLostError, TransportError
from p2pfl.wire.lane import Answer, Pack, Pull, within_limit
from p2pfl.wire.loop import CLIENT_LOG
from p2pfl.wire.stats import TransportStats
from p2pfl.wire.transfers import State

# every line the transport writes goes to one logger, whichever of its modules writes it
log = logging.getLogger("p2pfl.wire.transport")

PUBLISH_WINDOW = 16  # QoS-1 publishes in flight per transfer
KEEPALIVE_S = 15
FIRST_WAIT_S = 0.25  # the first retry of the first connection waits up to this long
MAX_WAIT_S = 5.0  # and no retry waits longer


def first_connection_waits(node_id: str) -> Iterator[float]:
    """The waits before each retry of a node's first connection: exponential backoff with
    full jitter, the ``n``-th drawn uniformly from ``[0, min(MAX_WAIT_S, FIRST_WAIT_S ·
    2^n)]``, so nodes started together do not retry together. Seeded with ``node_id``: the
    same node waits the same on every run."""
    rng = random.Random(f"p2pfl-first-connection:{node_id}")
    for n in itertools.count():
        yield rng.uniform(0.0, min(MAX_WAIT_S, FIRST_WAIT_S * 2 ** min(n, 16)))


@dataclass(frozen=True)
class Topics:
    """The topics of one swarm: ``p2pfl/<swarm>/<channel>/<node>`` (docs/wire.md,
    "Topics"). A signature covers the topic, so the direct lane names its messages by the
    topic they would have on MQTT."""

    swarm: str

    @property
    def prefix(self) -> str:
        return f"p2pfl/{self.swarm}"

    def of(self, channel: str, node: str) -> str:
        return f"{self.prefix}/{channel}/{node}"

    def parse(self, topic: str) -> tuple[str, str] | None:
        """``(channel, node)`` of a topic of this swarm, or None for any other shape."""
        parts = topic.split("/")
        if len(parts) != 4 or "/".join(parts[:2]) != self.prefix:
            return None
        return parts[2], parts[3]


class MqttLane:
    """One node's broker connection. ``presence()`` and ``will()`` make the payloads of
    this node's retained presence and of its Last Will when a connection needs them (the
    Will once per connection, before it opens); ``on_message(topic, payload)`` receives
    every message and must not raise. ``listen_to``: the peers whose presence and gossip
    this node hears (None: every node); :meth:`hear_presence` changes whose presence it
    hears while it runs. ``pack`` (:data:`~p2pfl.wire.lane.Pack`) makes the envelopes of
    its transfers, each at most ``max_message_bytes`` but chunks (whose data the transfer's
    metadata bounds)."""

    name = "mqtt"

    def __init__(
        self,
        node_id: str,
        topics: Topics,
        host: str,
        port: int,
        *,
        stats: TransportStats,
        presence: Callable[[], bytes],
        will: Callable[[], bytes],
        on_message: Callable[[str, Any], None],
        pack: Pack,
        max_message_bytes: int,
        listen_to: Sequence[str] | None = None,
        connect_timeout: float = 30.0,
        broker_timeout: float | None = None,
        client_factory: Callable[..., aiomqtt.Client] | None = None,
        tls_context: ssl.SSLContext | None = None,
    ):
        self.node_id = node_id
        self.topics = topics
        self.host, self.port = host, port
        self.stats = stats
        self.connect_timeout = connect_timeout
        self.broker_timeout = broker_timeout  # None: ride out any outage
        self.tls_context = tls_context  # TLS with a client certificate to the broker
        # whose presence and whose gossip to hear: None, every node (wildcards)
        heard = None if listen_to is None else sorted(set(listen_to) - {node_id})
        self.presence_from: list[str] | None = heard
        self.gossip_from: list[str] | None = heard
        self._listening = asyncio.Lock()  # one change of subscriptions at a time
        self._awaited: set[str] = set()  # newly heard peers whose presence has not come yet
        self._presence_came = asyncio.Event()
        self._presence = presence
        self._will = will
        self._on_message = on_message
        self._pack = pack
        self.max_message_bytes = max_message_bytes
        self._client_factory = client_factory or aiomqtt.Client
        self._client: aiomqtt.Client | None = None
        self._connected = asyncio.Event()
        self._lost = asyncio.Event()  # the connection dropped and is not back yet
        self._down_since: float | None = None  # monotonic time the current outage began
        self._offline_total = 0.0  # seconds without a broker in finished outages
        self._session_end: asyncio.Future | None = None  # done when this connection is lost
        self._ever_connected = False  # before: retrying the first connection, not an outage
        self._closing = False
        self._task: asyncio.Task | None = None
        self.system_filters: list[str] = []  # the broker's own topics heard ($SYS/...)

    # ------------------------------------------------------------------ subscriptions
    def _filters(self, kind: str, heard: list[str] | None) -> list[str]:
        return [self.topics.of(kind, peer) for peer in (["+"] if heard is None else heard)]

    def subscriptions(self) -> list[str]:
        """The topic filters this node subscribes to: its inbox, and the presence and gossip
        of the peers it listens to (of every node, for a kind heard from all)."""
        return [
            self.topics.of("inbox", self.node_id),
            *self._filters("presence", self.presence_from),
            *self._filters("gossip", self.gossip_from),
        ]

    def hears_presence(self, peer: str) -> bool:
        """Whether this node subscribes to ``peer``'s presence now."""
        return self.presence_from is None or peer in self.presence_from

    async def hear_presence(
        self,
        peers: Sequence[str] | None,
        fresh_within: float = 0.0,
        members: Sequence[str] = (),
    ) -> None:
        """Hear the presence of ``peers`` from now on (None: of every node), and no other's.

        The change applies to the live connection at once (new filters subscribed before
        old ones are dropped, so a peer heard in both sets is never missed) and to every
        reconnection after; the broker hands the retained presence of each newly heard peer
        over on subscription. A connection lost meanwhile is not an error: the next
        connection subscribes to the new set.

        With ``fresh_within`` > 0, returns once the presence of every newly heard peer (of
        ``members``, when ``peers`` is None) has arrived (:meth:`presence_arrived`), or
        after ``fresh_within`` seconds (a peer that never connected has no retained
        presence)."""
        candidates = set(members if peers is None else peers) - {self.node_id}
        added = {p for p in candidates if not self.hears_presence(p)}
        if fresh_within > 0:  # before subscribing: a retained copy may come before SUBACK
            self._awaited |= added
        await self._listen_presence(peers)
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

    def presence_arrived(self, peer: str) -> None:
        """The receive pipeline admitted a presence of ``peer``: a wait in
        :meth:`hear_presence` for it is over."""
        if peer in self._awaited:
            self._awaited.discard(peer)
            self._presence_came.set()

    async def _listen_presence(self, peers: Sequence[str] | None) -> None:
        """The subscription change of :meth:`hear_presence`."""
        wanted = None if peers is None else sorted(set(peers) - {self.node_id})
        async with self._listening:
            before = self.presence_from
            if wanted == before:
                return
            self.presence_from = wanted
            old, new = self._filters("presence", before), self._filters("presence", wanted)
            added = [t for t in new if t not in old]
            removed = [t for t in old if t not in new]
            client = self._client
            if client is not None and self._connected.is_set():
                try:
                    if added:
                        await client.subscribe([(t, 1) for t in added])
                    if removed:
                        await client.unsubscribe(removed)
                except aiomqtt.MqttError as exc:  # the reconnection subscribes to the new set
                    log.debug("%s: subscription change on a lost connection: %s", self.node_id, exc)

    async def _subscribe(self, client: aiomqtt.Client) -> None:
        """Subscribe a fresh connection to :meth:`subscriptions`, QoS 1, in one SUBSCRIBE,
        then to the broker's own topics asked for (:meth:`follow_system`)."""
        await client.subscribe([(t, 1) for t in self.subscriptions()])
        for topic in self.system_filters:
            await self._subscribe_system(client, topic)

    async def _subscribe_system(self, client: aiomqtt.Client, topic: str) -> None:
        try:
            await client.subscribe(topic, qos=1)
        except aiomqtt.MqttCodeError as exc:  # the broker's ACL may keep $SYS from nodes
            log.info("%s: %s not readable here: %s", self.node_id, topic, exc)

    async def follow_system(self, topic: str) -> None:
        """Hear the broker's own ``topic`` (a ``$SYS/...`` filter; e.g. its bridges' state)
        from now on, on this connection and every reconnection; a broker that refuses it
        is not an error (its messages never come)."""
        if topic in self.system_filters:
            return
        self.system_filters.append(topic)
        client = self._client
        if client is not None and self._connected.is_set():
            with contextlib.suppress(aiomqtt.MqttError):
                await self._subscribe_system(client, topic)

    # ------------------------------------------------------------------ lifecycle
    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def start(self) -> None:
        """Start the connection loop (once)."""
        self._task = asyncio.create_task(self._run(), name=f"mqtt-{self.node_id}")

    async def wait_connected(self, timeout: float) -> None:
        """Return once connected; :class:`asyncio.TimeoutError` after ``timeout`` s."""
        await asyncio.wait_for(self._connected.wait(), timeout)

    async def close(self) -> None:
        """Stop the connection loop and disconnect (no goodbye: the caller publishes its
        ``offline`` presence first); idempotent."""
        self._closing = True
        if self._task is not None:
            with contextlib.suppress(Exception):
                await cancel_and_wait(self._task)
        self._connected.clear()

    async def _run(self) -> None:
        backoff = 0.2
        first_waits = first_connection_waits(self.node_id)
        started, tries = time.monotonic(), 0
        while not self._closing:
            tries += 1
            try:
                async with self._client_factory(
                    self.host,
                    self.port,
                    identifier=f"p2pfl-{self.topics.swarm}-{self.node_id}-{uuid.uuid4().hex[:6]}",
                    will=aiomqtt.Will(
                        topic=self.topics.of("presence", self.node_id),
                        payload=self._will(),
                        qos=1,
                        retain=True,
                    ),
                    keepalive=KEEPALIVE_S,
                    timeout=30,
                    max_inflight_messages=PUBLISH_WINDOW * 2,
                    max_queued_outgoing_messages=0,
                    # small requests must not wait behind delayed ACKs (Nagle): 40 ms each
                    socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
                    tls_context=self.tls_context,
                    logger=CLIENT_LOG,  # its late acknowledgements are not errors
                ) as client:
                    client.pending_calls_threshold = PUBLISH_WINDOW * 4  # windowed on purpose
                    self._client = client
                    self._session_end = asyncio.get_running_loop().create_future()
                    await self._subscribe(client)
                    await self._publish_on(
                        client, self.topics.of("presence", self.node_id), self._presence(), 1, True
                    )
                    self._connected.set()
                    if not self._ever_connected and tries > 1:
                        log.info(
                            "%s: connected to the broker at %s:%d after %d tries (%.1f s)",
                            self.node_id,
                            self.host,
                            self.port,
                            tries,
                            time.monotonic() - started,
                        )
                    self._ever_connected = True
                    self._back_online()
                    backoff = 0.2
                    try:
                        async for message in client.messages:
                            self._on_message(str(message.topic), message.payload)
                    except BaseException:
                        # the outage starts now: leaving the client's context may first
                        # wait (up to its 30 s timeout) for a graceful disconnect
                        self._lose_session()
                        raise
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - whatever ends a session, the loop goes on
                self._lose_session()
                if self._closing:
                    break
                expected = isinstance(exc, (aiomqtt.MqttError, TransportError))
                if not self._ever_connected:
                    if not expected:
                        raise
                    await self._retry_first(exc, next(first_waits), tries)
                    continue
                if not expected:  # never leave a node with a dead lane
                    log.error("%s: MQTT session ended by %r; reconnecting", self.node_id, exc)
                    log.debug("%s: the session's end", self.node_id, exc_info=exc)
                else:
                    log.warning("%s: MQTT connection lost (%s); reconnecting", self.node_id, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
        self._end_session()
        self._client = None

    async def _retry_first(self, exc: Exception, wait: float, tries: int) -> None:
        """The first connection failed: say so (once at warning level; later tries at
        debug level) and wait ``wait`` seconds before the next try."""
        why = (
            "refused the connection" if isinstance(exc, aiomqtt.MqttCodeError) else "did not answer"
        )
        log.log(
            logging.WARNING if tries == 1 else logging.DEBUG,
            "%s: broker at %s:%d %s (%s); retrying in %.1f s",
            self.node_id,
            self.host,
            self.port,
            why,
            exc,
            wait,
        )
        await asyncio.sleep(wait)

    def _end_session(self) -> None:
        """The connection is gone: what is still being published on it fails now."""
        if self._session_end is not None and not self._session_end.done():
            self._session_end.set_result(None)

    # ------------------------------------------------------------------ broker outages
    def _lose_session(self) -> None:
        """The current connection is gone (idempotent): what is being published on it
        fails, publishes wait for the next one, and, once connected before, an outage
        starts."""
        self._end_session()
        self._connected.clear()
        self._client = None
        if self._ever_connected and not self._closing and self._down_since is None:
            self._down_since = time.monotonic()
            self._lost.set()

    def _back_online(self) -> None:
        if self._down_since is not None:
            outage = time.monotonic() - self._down_since
            self._offline_total += outage
            log.warning("%s: broker back after %.1f s", self.node_id, outage)
        self._down_since = None
        self._lost.clear()

    def offline_seconds(self) -> float:
        """Seconds spent without a broker since the first connection (the current outage
        included; the wait for the first connection is not an outage)."""
        current = 0.0 if self._down_since is None else time.monotonic() - self._down_since
        return self._offline_total + current

    async def watch_broker(self) -> None:
        """Return never; raise :class:`BrokerLostError` once the broker has been unreachable
        for ``broker_timeout`` seconds in one outage (never when it is None)."""
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

    # ------------------------------------------------------------------ publishing
    async def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False) -> None:
        """Publish on the current connection, waiting for one up to ``connect_timeout``;
        :class:`TransportError` when there is none, or it drops before the broker
        acknowledges (QoS 1)."""
        if not self._connected.is_set():
            try:
                await asyncio.wait_for(self._connected.wait(), self.connect_timeout)
            except asyncio.TimeoutError:
                raise TransportError(f"{self.node_id}: not connected to the broker") from None
        client = self._client
        if client is None:
            raise TransportError(f"{self.node_id}: not connected to the broker")
        await self._publish_on(client, topic, payload, qos, retain)

    async def publish_presence(self) -> None:
        """Publish this node's current presence (retained, QoS 1)."""
        await self.publish(self.topics.of("presence", self.node_id), self._presence(), 1, True)

    async def publish_if_connected(self, topic: str, make: Callable[[], bytes]) -> None:
        """Publish ``make()`` at QoS 0 when connected, else nothing (never waits for the
        broker); not counted in :attr:`stats`. :class:`TransportError` when it fails."""
        client = self._client
        if client is None or not self._connected.is_set():
            return
        try:
            await client.publish(topic, make(), qos=0)
        except aiomqtt.MqttError as exc:
            raise TransportError(f"{self.node_id}: status not published: {exc}") from exc

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

    # ------------------------------------------------------------------ the lane
    async def pull(self, pull: Pull) -> State:
        """Send ``pull``'s request to the peer's inbox and wait for the state (reassembled
        by the receive pipeline on ``pull.arrived``) until its deadline. Never None: the
        broker reaches every peer."""
        topic = self.topics.of("inbox", pull.peer)
        await self.publish(topic, within_limit("pull", pull.request(), self.max_message_bytes))
        return await asyncio.wait_for(pull.arrived, pull.remaining())

    async def answer(self, answer: Answer) -> bool:
        """The metadata, then numbered chunks (QoS 1, :data:`PUBLISH_WINDOW` in flight), to
        the puller's inbox. Always True: any pull can be answered through the broker."""
        meta = answer.meta()
        to, round_no, chunk = answer.to, answer.round_no, answer.chunk
        topic = self.topics.of("inbox", to)
        payload = self._pack(to, "xfer_meta", round_no, meta)
        await self.publish(topic, within_limit("xfer_meta", payload, self.max_message_bytes))
        view = memoryview(answer.prepared.buf)
        pending: set[asyncio.Task] = set()
        try:
            for seq in range(meta["nchunks"]):
                data = view[seq * chunk : (seq + 1) * chunk]
                # a chunk's header is signed; its bytes are covered by the metadata's digest
                body = {"xfer": answer.xfer, "seq": seq}
                payload = self._pack(to, "xfer_chunk", round_no, body, data=data)
                pending.add(asyncio.create_task(self.publish(topic, payload)))
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
        return True

    async def refuse(self, to: str, xfer: str, payload: bytes) -> bool:
        """``payload`` to ``to``'s inbox. Always True."""
        await self.publish(self.topics.of("inbox", to), payload)
        return True
