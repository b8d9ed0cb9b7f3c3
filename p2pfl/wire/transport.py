"""The transport: the one object a node sends and receives through (docs/wire.md).

Topics live under ``p2pfl/<swarm>/`` (docs/wire.md, "Topics"): ``presence/<id>`` (retained;
the MQTT Last Will sets ``offline``), ``gossip/<id>`` (small per-round messages for the
neighbours), ``inbox/<id>`` (requests and replies addressed to one node) and
``status/<id>`` (telemetry for observers, :meth:`Transport.publish_status`; no node
subscribes). Every message is an :class:`~p2pfl.wire.envelope.Envelope`, packed with
:mod:`p2pfl.wire.codec`. :class:`Transport` is a facade over one module per job:

- :mod:`p2pfl.wire.mqtt_lane`: the broker connection (reconnect loop, subscriptions,
  presence and Last Will, publishing, outages), and the lane that reaches every peer;
- :mod:`p2pfl.wire.direct_lane`: pulls straight between peers over TCP (mutual TLS when
  the swarm uses TLS), with :mod:`p2pfl.wire.direct` for framing;
- :mod:`p2pfl.wire.receive`: the one receive pipeline both lanes feed. Anything
  oversized, undecodable, from another swarm, of an unknown kind, duplicated, or otherwise
  malformed is dropped with a log line and counted in :attr:`Transport.dropped`; it never
  raises into the node.

The transport itself makes this node's envelopes (signed for their topic when the swarm
signs) and holds the lanes, in order (:mod:`p2pfl.wire.lane`): a pull
(:meth:`Transport.pull`) goes straight to the serving peer over the direct lane when both
have one and it can be reached, else through the broker; an answer
(:meth:`Transport.send_state`) goes back the way its pull came. The owner answers with a
metadata message (transfer id, size, digest, tensor index) and the bytes, verified before
use (:mod:`p2pfl.wire.transfers`). :attr:`Transport.pull_lanes` says which lane each pull
used (the latest :data:`PULL_LANES_KEPT`; :attr:`Transport.pulls` counts them all).

It also owns ``transfer.compress`` (``compress``, parsed once; docs/wire.md,
"Compression"), both ways: what it prepares for serving is in that wire form
(:meth:`Transport.prepare`; top-k streams: :attr:`Transport.served`), and what it pulls
is decoded (:meth:`Transport.decoded`; a top-k answer by :meth:`Transport.pull`, with
the stream it belongs to), whatever codec the peer used.

``listen_to`` (the peers a node talks to) narrows the presence and gossip it subscribes to
(``N·k`` deliveries a round instead of ``N²``); :meth:`Transport.hear_presence` changes
whose presence it hears while it runs. Given ``links`` (a
:class:`~p2pfl.wire.emulation.LinkEmulator`), what it receives from a peer, on either
lane, is held back by the emulated path from that peer first.

Use as ``async with Transport(...) as t:``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import ssl
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import aiomqtt

from p2pfl import PROTOCOL_VERSION
from p2pfl.wire import bridges, direct
from p2pfl.wire.compress import CompressError, Spec, decode_state, is_compressed, parse_spec
from p2pfl.wire.digest import transfer_digest
from p2pfl.wire.direct_lane import DirectEndpoint
from p2pfl.wire.emulation import LinkEmulator
from p2pfl.wire.envelope import GOSSIP_KINDS, Envelope
from p2pfl.wire.errors import BrokerLostError, TransportError
from p2pfl.wire.lane import Answer, Lane, Pull, within_limit
from p2pfl.wire.mqtt_lane import PUBLISH_WINDOW, MqttLane, Topics
from p2pfl.wire.receive import ReceivePipeline
from p2pfl.wire.stats import TransportStats
from p2pfl.wire.streams import ReceivedStreams, ServedStreams
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

PULL_LANES_KEPT = 4096  # lanes of the latest pulls kept (a round's records read them)


def _handler(name: str, owner: str = "inbound", attr: str | None = None) -> property:
    """A callback of one of the transport's parts (by default, a handler of the receive
    pipeline), read and set through the transport."""
    attr = attr or name
    return property(
        lambda self: getattr(getattr(self, owner), attr),
        lambda self, value: setattr(getattr(self, owner), attr, value),
        doc=f"``{name}``: ``{owner}.{attr}``.",
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
    on_bridge = _handler("on_bridge", "bridge_states", "on_change")

    def __init__(
        self,
        swarm: str,
        node_id: str,
        host: str,
        port: int,
        *,
        presence: dict[str, Any] | None = None,
        presence_v3: dict[str, Any] | None = None,
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
        compress: str | Spec = "none",
        pack_pool: concurrent.futures.Executor | None = None,
    ):
        self.swarm = swarm
        self.node_id = node_id
        self.host, self.port = host, port
        self.topics = Topics(swarm)
        self.prefix = self.topics.prefix
        self.presence_info = dict(presence or {})
        # the protocol this node runs, whatever version it speaks (p2pfl.wire.versions)
        self.presence_info.setdefault("protocol", PROTOCOL_VERSION)
        # the fields a presence carries otherwise while this node speaks protocol 3
        self.presence_v3 = dict(presence_v3 or {})
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
            pack=self._inbox_payload,
            max_message_bytes=max_message_bytes,
            listen_to=listen_to,
            connect_timeout=connect_timeout,
            broker_timeout=broker_timeout,
            client_factory=client_factory,
            tls_context=tls_context,
        )
        self.inbound.presence_heard = self.mqtt.presence_arrived
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
                self._inbox_payload,
            )
        )
        # the lanes a pull tries, in order, and an answer goes back on (p2pfl.wire.lane):
        # straight to the peer when both ends have the direct lane, else through the broker
        self.lanes: list[Lane] = [self.mqtt] if self.direct is None else [self.direct, self.mqtt]
        # (peer, "direct" | "mqtt") of the latest pulls, oldest first; ``pulls`` counts all
        self.pull_lanes: deque[tuple[str, str]] = deque(maxlen=PULL_LANES_KEPT)
        self.pulls = 0
        self.direct_answered: set[str] = set()  # peers a pull ever reached on the direct lane
        # ``transfer.compress``, parsed once: the form of the states it prepares for
        # serving (:meth:`prepare`) and of the top-k streams it serves and pulls
        self.compress: Spec = parse_spec(compress)
        rho = self.compress.rho if self.compress.mode == "topk" else None
        # top-k streams served (None: no top-k), published and packed on ``pack_pool``,
        # digested with the digest this node serves with when it starts
        self.served: ServedStreams | None = (
            None if rho is None else ServedStreams(rho, self.digest_name, pool=pack_pool)
        )
        # top-k streams pulled (None: no top-k): each pull names the base held of the
        # peer's stream, and a top-k answer is decoded with it
        self.streams: ReceivedStreams | None = None if rho is None else ReceivedStreams()
        # the state of the bridges of this node's broker to other sites' brokers, by
        # connection name (:meth:`follow_bridges`): True up, False down; ``on_bridge``
        # (name, up) is called on each change
        self.bridge_states = bridges.Bridges(node_id, self.drop)
        self.bridges: dict[str, bool] = self.bridge_states.states

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
        await self.mqtt.hear_presence(peers, fresh_within, members)

    # ------------------------------------------------------------------ reachability
    def _mqtt_message(self, topic: str, payload: Any) -> None:
        """The broker's bridge state (:meth:`follow_bridges`), else the receive pipeline."""
        if topic.startswith(bridges.PREFIX):
            self.bridge_states.heard(topic, payload)
        else:
            self.inbound.mqtt_message(topic, payload)

    async def follow_bridges(self) -> None:
        """Hear the state of the broker's bridges to other sites (Mosquitto's retained
        ``$SYS/broker/connection/<name>/state``, ``1`` or ``0``) into :attr:`bridges`."""
        await self.mqtt.follow_system(bridges.FILTER)

    @property
    def bridge_down(self) -> bool:
        """Whether a bridge of this node's broker to another site is down now."""
        return self.bridge_states.down

    async def probe(self, peer: str, timeout: float) -> bool | None:
        """Whether ``peer``'s direct lane accepts a TCP connection within ``timeout`` (the
        connection is closed at once, before any TLS handshake or request); None when the
        peer announces no direct address or this node has no direct lane."""
        return None if self.direct is None else await self.direct.probe(peer, timeout)

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

    def runs(self, peer: str) -> int | None:
        """The protocol ``peer`` runs, from its latest presence heard (None: none heard)."""
        return self.inbound.versions.runs.get(peer)

    @property
    def digest_name(self) -> str:
        """The digest of the states this node serves (:func:`transfer_digest`): BLAKE3 in a
        signed swarm, XXH3-128 in an unsigned one."""
        return transfer_digest(self.security is not None)

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
        if self.speaks < 4:
            info.update(self.presence_v3)
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
        self,
        kind: str,
        round_no: int,
        body: Any,
        mid: str | None = None,
        attempt: int = 0,
        data: memoryview | None = None,
    ) -> Envelope:
        return Envelope(
            self.swarm,
            self.node_id,
            round_no,
            kind,
            mid or uuid.uuid4().hex[:16],
            body,
            data,
            attempt=attempt,
            ts=time.time(),
            v=self.speaks,
        )

    def _inbox_payload(
        self,
        to: str,
        kind: str,
        round_no: int,
        body: Any,
        *,
        mid: str | None = None,
        attempt: int = 0,
        data: memoryview | None = None,
    ) -> bytes:
        """One envelope for ``to``'s inbox, packed and signed for that topic (the lanes'
        :data:`~p2pfl.wire.lane.Pack`)."""
        env = self._envelope(kind, round_no, body, mid, attempt, data)
        return env.pack(self._signer(self.topic("inbox", to)))

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
        await self.mqtt.publish(topic, within_limit(kind, payload, self.max_message_bytes))

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
        payload = self._inbox_payload(to, kind, round_no, body, mid=mid, attempt=attempt)
        within_limit(kind, payload, self.max_message_bytes)
        if kind == "pull_error" and isinstance(body, dict):  # on the lane the pull came by
            xfer = str(body.get("xfer"))
            for lane in self.lanes:
                if await lane.refuse(to, xfer, payload):
                    return
        await self.mqtt.publish(self.topic("inbox", to), payload)

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
        with it (:class:`~p2pfl.wire.streams.ReceivedStreams`); any other state comes back
        as it travelled (:meth:`decoded` decodes it).

        Raises :class:`TransportError` on refusal, timeout, a corrupt transfer (a state
        that does not decode included), or as soon as ``peer``'s presence is (or goes)
        ``offline``."""
        streams = self.streams
        body: dict[str, Any] = {"part": part}
        base = None if streams is None else streams.base(peer, part)
        if base is not None:
            body["base"] = list(base)
        state = await self._pull(peer, round_no, part, body, timeout, attempt, max_bytes)
        if streams is not None:
            limit = self._limit(max_bytes)
            try:
                state = await asyncio.to_thread(streams.decode, peer, part, state, max_bytes=limit)
            except CompressError as exc:
                self.drop("bad_transfer", f"state from {peer} rejected: {exc}")
                raise TransportError(f"{part!r} from {peer} does not decode: {exc}") from None
        return state

    async def decoded(self, peer: str, state: State, *, max_bytes: int) -> State:
        """``state`` as pulled from ``peer``, decoded when it travelled compressed (any
        codec, whatever this node's own ``transfer.compress``; a top-k delta only with its
        stream, in :meth:`pull`), at most ``max_bytes`` decoded, checked before anything is
        allocated. One that does not decode is counted (``bad_transfer``) and raises
        :class:`TransportError`, as a corrupt transfer does."""
        if not is_compressed(state):
            return state
        try:
            return await asyncio.to_thread(decode_state, state, max_bytes=max_bytes)
        except CompressError as exc:
            self.drop("bad_transfer", f"state from {peer} rejected: {exc}")
            raise TransportError(f"state from {peer} does not decode: {exc}") from None

    def prepare(self, state: State, digest: str | None = None) -> PreparedState:
        """``state`` packed for serving in this node's wire form (``transfer.compress``:
        ``fp16`` and ``int8`` encoded; a state outside a top-k stream, as it is: a top-k
        stream's publishes are :attr:`served`'s) and digested with ``digest`` (None:
        :attr:`digest_name` now). CPU work: call it in a worker thread."""
        form = Spec("none") if self.compress.mode == "topk" else self.compress
        return PreparedState.from_state(state, self.digest_name if digest is None else digest, form)

    def _limit(self, max_bytes: int | None) -> int:
        cap = self.max_transfer_bytes
        return cap if max_bytes is None else min(max_bytes, cap)

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
        """:meth:`pull` with the request's ``body``: the transfer, on the first of
        :attr:`lanes` that reaches ``peer`` (:mod:`p2pfl.wire.lane`)."""
        if self.peers.get(peer, {}).get("status") == "offline":
            raise TransportError(f"pull of {part!r} from {peer}: {peer} is offline")
        xfer = uuid.uuid4().hex[:16]
        limit = self._limit(max_bytes)
        deadline = asyncio.get_running_loop().time() + timeout

        def request() -> bytes:  # made when a lane sends it, signed for peer's inbox
            return self._inbox_payload(peer, "pull", round_no, body, mid=xfer, attempt=attempt)

        # the future fails when the peer goes offline or the transport closes (every lane)
        fut = self.transfers.expect(xfer, peer, limit)
        try:
            for lane in self.lanes:
                state = await lane.pull(Pull(peer, xfer, request, limit, deadline, fut))
                if state is not None:
                    self._pulled(peer, lane.name)
                    return state
            raise TransportError(f"pull of {part!r} from {peer}: no lane reaches it")
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

    async def send_state(self, to: str, xfer: str, round_no: int, prepared: PreparedState) -> None:
        """Answer a pull, metadata then the bytes, on the lane it came by (the first of
        :attr:`lanes` that takes it: the pull's direct connection, else numbered chunks
        through the broker)."""
        answer = Answer(to, xfer, round_no, prepared, self.chunk_bytes)
        for lane in self.lanes:
            if await lane.answer(answer):
                return

    # ------------------------------------------------------------------ drops
    def drop(self, reason: str, detail: Any = "") -> None:
        """Count a dropped message and log it (:meth:`ReceivePipeline.drop`)."""
        self.inbound.drop(reason, detail)
