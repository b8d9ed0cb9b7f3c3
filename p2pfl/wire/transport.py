"""MQTT transport for one node: presence, gossip, inbox, and chunked weight transfers.

Topics live under ``p2pfl/<swarm>/`` (docs/wire.md, "Topics"):

- ``presence/<id>``: retained ``{status, ...}``; the MQTT Last Will sets ``offline``;
- ``gossip/<id>``: small per-round messages (representations) for the neighbours;
- ``inbox/<id>``: requests (``pull``) and replies (``xfer_meta``, ``xfer_chunk``,
  ``pull_error``) addressed to one node.

Every message is an :class:`Envelope` — swarm, sender, round, kind, id, body — packed with
:mod:`p2pfl.wire.codec`. Anything oversized, undecodable, from another swarm, of an unknown kind,
duplicated, or otherwise malformed is dropped with a log line and counted in
:attr:`Transport.dropped`; it never raises into the node.

Weights move on request only (:meth:`Transport.pull`): the owner answers with a metadata
message (transfer id, total size, digest, tensor index) followed by numbered ~1 MiB chunks,
reassembled into one preallocated buffer on the receiver and verified before use. This MQTT
lane is the seam a direct TCP lane can later sit beside without touching algorithms.

The client lives in a reconnect loop (aiomqtt has none of its own) that resubscribes and
re-announces presence after every reconnect. Use as ``async with Transport(...) as t:``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import socket
import ssl
import struct
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiomqtt
import numpy as np

from p2pfl import PROTOCOL_VERSION
from p2pfl.errors import P2PFLError
from p2pfl.wire.codec import CodecError, buffer_to_state, decode, encode, state_to_buffer
from p2pfl.wire.digest import DEFAULT_DIGEST, hexdigest, new_hasher

if TYPE_CHECKING:
    from p2pfl.security.signing import MessageSecurity

log = logging.getLogger(__name__)

State = dict[str, Any]
KINDS = frozenset(
    {"presence", "gossip", "announce", "pull", "report", "xfer_meta", "xfer_chunk", "pull_error"}
)
GOSSIP_KINDS = frozenset({"gossip", "announce"})  # broadcast on a node's gossip topic
INBOX_KINDS = frozenset({"report"})  # small messages handed to ``on_inbox``
MAX_ATTEMPT = 1 << 16
CHUNK_BYTES = 1 << 20
FRAME_MAGIC = b"P2F\x01"  # a msgpack message never starts with these bytes (0x50 is a fixint)
SIGNED_MAGIC = b"P2S\x01"
SIGNATURE_BYTES = 64
HASH_BATCH = 8  # chunks per hashing job: fewer GIL hand-offs to the hashing thread
PUBLISH_WINDOW = 16  # QoS-1 publishes in flight per transfer


class TransportError(P2PFLError, RuntimeError):
    """A send or pull that could not complete (disconnected, refused, timed out, corrupt)."""


@dataclass(frozen=True)
class Envelope:
    """One message. ``attempt`` numbers the tries at a round (the rotating aggregator's
    failover; 0 otherwise). ``ts`` is the sender's clock when it was made (replay window).
    ``data`` is an optional raw binary tail (transfer chunks).

    Frames: a plain message is the msgpack header alone; a message with a data tail is
    ``FRAME_MAGIC | u32 header length | header | data`` so a 1 MiB chunk is neither
    msgpack-encoded nor copied on decode; a signed message (:mod:`p2pfl.security.signing`) is
    ``SIGNED_MAGIC | u32 header length | header | 64-byte signature | data``. ``header``
    keeps the exact signed bytes of a received message."""

    swarm: str
    sender: str
    round: int
    kind: str
    id: str
    body: Any
    data: memoryview | None = field(default=None, compare=False, repr=False)
    attempt: int = 0
    ts: float = 0.0
    sig: bytes | None = field(default=None, compare=False, repr=False)
    header: memoryview | bytes | None = field(default=None, compare=False, repr=False)

    def _header(self) -> bytes:
        return encode(
            {
                "v": PROTOCOL_VERSION,
                "swarm": self.swarm,
                "from": self.sender,
                "round": self.round,
                "attempt": self.attempt,
                "kind": self.kind,
                "id": self.id,
                "ts": self.ts,
                "body": self.body,
            }
        )

    def pack(self, sign: Callable[[bytes], bytes] | None = None) -> bytes:
        """The wire bytes; ``sign(header) -> 64-byte signature`` makes a signed frame."""
        header = self._header()
        if sign is not None:
            sig = sign(header)
            if len(sig) != SIGNATURE_BYTES:
                raise ValueError("signature must be 64 bytes")
            parts = [SIGNED_MAGIC, struct.pack("<I", len(header)), header, sig]
            if self.data is not None:
                parts.append(self.data)
            return b"".join(parts)
        if self.data is None:
            return header
        return b"".join((FRAME_MAGIC, struct.pack("<I", len(header)), header, self.data))

    @classmethod
    def unpack(cls, payload: bytes, max_bytes: int) -> Envelope:
        """Decode and check the envelope's shape; raise :class:`CodecError` if it is off.
        A signature is returned in ``sig`` unchecked: verifying it is the caller's job."""
        data = sig = None
        magic = payload[:4]
        if magic in (FRAME_MAGIC, SIGNED_MAGIC):
            if len(payload) < 8:
                raise CodecError("truncated binary frame")
            (hlen,) = struct.unpack_from("<I", payload, 4)
            tail = 8 + hlen + (SIGNATURE_BYTES if magic == SIGNED_MAGIC else 0)
            if tail > len(payload):
                raise CodecError("binary frame header runs past the payload")
            view = memoryview(payload)
            if magic == SIGNED_MAGIC:
                sig = bytes(view[8 + hlen : tail])
                data = view[tail:] if tail < len(payload) else None
            else:
                data = view[tail:]
            payload = view[8 : 8 + hlen]
        obj = decode(payload, max_bytes)
        if not isinstance(obj, dict):
            raise CodecError("envelope is not a map")
        if obj.get("v") != PROTOCOL_VERSION:
            raise CodecError(f"protocol version {obj.get('v')!r} != {PROTOCOL_VERSION}")
        swarm, sender, rnd, kind, mid = (
            obj.get(k) for k in ("swarm", "from", "round", "kind", "id")
        )
        if not (isinstance(swarm, str) and isinstance(sender, str) and isinstance(mid, str)):
            raise CodecError("envelope swarm/from/id must be strings")
        if not isinstance(rnd, int) or isinstance(rnd, bool) or rnd < 0:
            raise CodecError(f"envelope round must be a non-negative int, got {rnd!r}")
        attempt = obj.get("attempt", 0)
        if not isinstance(attempt, int) or isinstance(attempt, bool):
            raise CodecError(f"envelope attempt must be an int, got {attempt!r}")
        if not 0 <= attempt <= MAX_ATTEMPT:
            raise CodecError(f"envelope attempt {attempt} out of range")
        ts = obj.get("ts", 0.0)
        if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not math.isfinite(ts):
            raise CodecError(f"envelope ts must be a number, got {ts!r}")
        if kind not in KINDS:
            raise CodecError(f"unknown message kind {kind!r}")
        if not 0 < len(mid) <= 64 or not 0 < len(sender) <= 64:
            raise CodecError("envelope id/from length out of range")
        return cls(
            swarm, sender, rnd, kind, mid, obj.get("body"), data, attempt, float(ts), sig, payload
        )


@dataclass
class _Incoming:
    """A transfer being received: filled chunk by chunk into ``buf``."""

    peer: str
    future: asyncio.Future
    max_bytes: int
    buf: memoryview | None = None
    index: list[dict] | None = None
    digest: str = ""  # expected hex digest
    chunk: int = CHUNK_BYTES
    nchunks: int = 0
    seen: set[int] = field(default_factory=set)
    hasher: Any = None
    hashed: int = 0  # chunks [0, hashed) are submitted to the hashing thread, in order
    last_hash: concurrent.futures.Future | None = None


@dataclass
class TransportStats:
    bytes_sent: int = 0
    bytes_recv: int = 0
    messages_sent: int = 0
    messages_recv: int = 0


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
        client_factory: Callable[..., aiomqtt.Client] | None = None,
        security: MessageSecurity | None = None,
        tls_context: ssl.SSLContext | None = None,
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
        self._closing = False
        self._task: asyncio.Task | None = None
        self._incoming: dict[str, _Incoming] = {}
        self._seen_ids: OrderedDict[str, None] = OrderedDict()
        self._request_tasks: set[asyncio.Task] = set()
        self._hasher_pool: concurrent.futures.ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ lifecycle
    def topic(self, kind: str, node: str) -> str:
        return f"{self.prefix}/{kind}/{node}"

    async def __aenter__(self) -> Transport:
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
        for inc in self._incoming.values():
            if not inc.future.done():
                inc.future.set_exception(TransportError("transport closed"))
        for t in list(self._request_tasks):
            t.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self._connected.clear()
        if self._hasher_pool is not None:
            self._hasher_pool.shutdown(wait=False, cancel_futures=True)
            self._hasher_pool = None

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
                    await client.subscribe(f"{self.prefix}/presence/+", qos=1)
                    await client.subscribe(f"{self.prefix}/gossip/+", qos=1)
                    await client.subscribe(self.topic("inbox", self.node_id), qos=1)
                    await self._publish_presence(client)
                    self._connected.set()
                    backoff = 0.2
                    async for message in client.messages:
                        self._dispatch(str(message.topic), message.payload)
            except (aiomqtt.MqttError, TransportError) as exc:
                self._connected.clear()
                self._client = None
                if self._closing:
                    break
                log.warning("%s: MQTT connection lost (%s); reconnecting", self.node_id, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
        self._client = None

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
        try:
            await client.publish(topic, payload, qos=qos, retain=retain)
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
        """Send one message to ``to``'s inbox."""
        topic = self.topic("inbox", to)
        payload = self._envelope(kind, round_no, body, mid, attempt).pack(self._signer(topic))
        if len(payload) > self.max_message_bytes:
            raise TransportError(f"{kind} of {len(payload)} bytes exceeds the message limit")
        await self._publish(topic, payload)

    # ------------------------------------------------------------------ transfers
    async def pull(
        self, peer: str, round_no: int, part: str, timeout: float, *, attempt: int = 0
    ) -> State:
        """Ask ``peer`` for ``part`` of its round-``round_no`` state (of that ``attempt``,
        for the rotating aggregator) and wait for it.

        Raises :class:`TransportError` on refusal, timeout or a corrupt transfer."""
        xfer = uuid.uuid4().hex[:16]
        fut = asyncio.get_running_loop().create_future()
        self._incoming[xfer] = _Incoming(peer=peer, future=fut, max_bytes=self.max_transfer_bytes)
        try:
            await self.send(peer, "pull", round_no, {"part": part}, mid=xfer, attempt=attempt)
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise TransportError(
                f"pull of {part!r} from {peer} timed out after {timeout:.1f} s"
            ) from None
        finally:
            self._incoming.pop(xfer, None)

    async def send_state(self, to: str, xfer: str, round_no: int, prepared: PreparedState) -> None:
        """Answer a pull: metadata, then numbered chunks (QoS 1, a window in flight)."""
        meta = {
            "xfer": xfer,
            "total": len(prepared.buf),
            "chunk": self.chunk_bytes,
            "nchunks": prepared.nchunks(self.chunk_bytes),
            "digest": prepared.digest_name,
            "hexdigest": prepared.hexdigest,
            "index": prepared.index,
        }
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

    def _on_meta(self, env: Envelope) -> None:
        body = env.body
        inc = self._incoming.get(body.get("xfer")) if isinstance(body, dict) else None
        if inc is None or inc.peer != env.sender or inc.buf is not None:
            self._drop("unexpected_xfer_meta", env)
            return
        total, chunk, nchunks = body.get("total"), body.get("chunk"), body.get("nchunks")
        index, digest, expected = body.get("index"), body.get("digest"), body.get("hexdigest")
        ints_ok = all(
            isinstance(v, int) and not isinstance(v, bool) for v in (total, chunk, nchunks)
        )
        if not ints_ok or not isinstance(index, list) or not isinstance(expected, str):
            self._fail(inc, "malformed transfer metadata")
            return
        try:
            inc.hasher = new_hasher(digest) if isinstance(digest, str) else new_hasher("?")
        except ValueError as exc:
            self._fail(inc, str(exc))
            return
        if total < 0 or total > inc.max_bytes:
            self._fail(inc, f"transfer of {total} bytes exceeds the limit of {inc.max_bytes}")
            return
        if not 0 < chunk <= self.max_message_bytes or nchunks != -(-total // chunk):
            self._fail(inc, "inconsistent chunking in transfer metadata")
            return
        # uninitialised (no 47 MB memset): every byte is overwritten by a chunk before use
        inc.buf = memoryview(np.empty(total, dtype=np.uint8)).cast("B")
        inc.index, inc.digest, inc.chunk, inc.nchunks = index, expected, chunk, nchunks
        if nchunks == 0:
            self._spawn(self._finish(inc))

    def _on_chunk(self, env: Envelope) -> None:
        body = env.body
        inc = self._incoming.get(body.get("xfer")) if isinstance(body, dict) else None
        if inc is None or inc.peer != env.sender or inc.buf is None or inc.future.done():
            self._drop("unexpected_xfer_chunk", env)
            return
        seq, data = body.get("seq"), env.data
        if not isinstance(seq, int) or data is None or not 0 <= seq < inc.nchunks:
            self._fail(inc, "malformed chunk")
            return
        start = seq * inc.chunk
        expected = min(inc.chunk, len(inc.buf) - start)
        if len(data) != expected:
            self._fail(inc, f"chunk {seq} has {len(data)} bytes, expected {expected}")
            return
        if seq in inc.seen:
            return
        inc.buf[start : start + expected] = data
        inc.seen.add(seq)
        # hash the contiguous prefix in a worker thread (hashers release the GIL), so the
        # digest is ready almost as soon as the last chunk lands
        ready = inc.hashed
        while ready in inc.seen:
            ready += 1
        complete = len(inc.seen) == inc.nchunks
        if ready - inc.hashed >= HASH_BATCH or (complete and ready > inc.hashed):
            span = inc.buf[inc.hashed * inc.chunk : ready * inc.chunk]
            inc.last_hash = self._hash_pool().submit(inc.hasher.update, span)
            inc.hashed = ready
        if complete:
            self._spawn(self._finish(inc))

    def _hash_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._hasher_pool is None:  # one worker: updates run in submission order
            self._hasher_pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"digest-{self.node_id}"
            )
        return self._hasher_pool

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._request_tasks.add(task)
        task.add_done_callback(self._request_done)

    async def _finish(self, inc: _Incoming) -> None:
        assert inc.buf is not None and inc.index is not None
        if inc.last_hash is not None:
            await asyncio.wrap_future(inc.last_hash)
        if inc.hasher.hexdigest() != inc.digest:
            self._fail(inc, "digest mismatch")
            return
        try:
            state = buffer_to_state(inc.index, inc.buf)
        except CodecError as exc:
            self._fail(inc, f"bad tensor index: {exc}")
            return
        if not inc.future.done():
            inc.future.set_result(state)

    def _fail(self, inc: _Incoming, reason: str) -> None:
        self.dropped["bad_transfer"] += 1
        log.warning("%s: transfer from %s rejected: %s", self.node_id, inc.peer, reason)
        if not inc.future.done():
            inc.future.set_exception(TransportError(f"transfer from {inc.peer}: {reason}"))

    # ------------------------------------------------------------------ receiving
    def _drop(self, reason: str, detail: Any = "") -> None:
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
            self._drop("handler_error", f"{topic}: {exc!r}")

    def _dispatch_unsafe(self, topic: str, payload: Any) -> None:
        if not isinstance(payload, (bytes, bytearray)):
            self._drop("not_bytes", topic)
            return
        size = len(payload)
        self.stats.bytes_recv += size
        self.stats.messages_recv += 1
        if size > self.max_message_bytes:
            self._drop("oversized", f"{topic}: {size} bytes")
            return
        parts = topic.split("/")
        if len(parts) != 4 or "/".join(parts[:2]) != self.prefix:
            self._drop("foreign_topic", topic)
            return
        channel, owner = parts[2], parts[3]
        try:
            env = Envelope.unpack(payload, self.max_message_bytes)
        except CodecError as exc:
            self._drop("malformed", f"{topic}: {exc}")
            return
        if env.swarm != self.swarm:
            self._drop("foreign_swarm", f"{topic}: swarm {env.swarm!r}")
            return
        if channel in ("presence", "gossip") and env.sender != owner:
            self._drop("sender_mismatch", f"{topic}: from {env.sender!r}")
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
                self._drop(reason, detail)
                return
        if channel == "presence":
            body = env.body
            info = body.get("presence") if isinstance(body, dict) else None
            if (
                env.kind != "presence"
                or not isinstance(info, dict)
                or not isinstance(info.get("status"), str)
            ):
                self._drop("malformed", f"{topic}: bad presence")
                return
            self.peers[owner] = info
            if self.on_presence is not None:
                self.on_presence(owner, info)
            return
        if env.id in self._seen_ids:
            self._drop("duplicate", f"{topic}: id {env.id}")
            return
        self._seen_ids[env.id] = None
        while len(self._seen_ids) > 50_000:
            self._seen_ids.popitem(last=False)
        if channel == "gossip":
            if env.kind not in GOSSIP_KINDS or not isinstance(env.body, dict):
                self._drop("malformed", f"{topic}: bad gossip")
                return
            if self.on_gossip is not None:
                self.on_gossip(env)
            return
        if channel != "inbox" or owner != self.node_id:
            self._drop("foreign_topic", topic)
            return
        if env.kind == "xfer_chunk":
            self._on_chunk(env)
        elif env.kind == "xfer_meta":
            self._on_meta(env)
        elif env.kind == "pull_error":
            body = env.body if isinstance(env.body, dict) else {}
            inc = self._incoming.get(body.get("xfer"))
            if inc is not None and inc.peer == env.sender and not inc.future.done():
                inc.future.set_exception(
                    TransportError(f"{env.sender} refused the pull: {body.get('reason')}")
                )
        elif env.kind == "pull":
            if self.on_request is None:
                return
            self._spawn(self.on_request(env))
        elif env.kind in INBOX_KINDS:
            if self.on_inbox is not None:
                self.on_inbox(env)
        else:
            self._drop("unexpected_kind", f"{topic}: {env.kind}")

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


@dataclass
class PreparedState:
    """A state packed once for sending: one buffer, its tensor index and its digest."""

    index: list[dict]
    buf: bytearray
    digest_name: str
    hexdigest: str

    @classmethod
    def from_state(cls, state: State, digest: str = DEFAULT_DIGEST) -> PreparedState:
        index, buf = state_to_buffer(state)
        return cls(index=index, buf=buf, digest_name=digest, hexdigest=hexdigest(buf, digest))

    def nchunks(self, chunk: int) -> int:
        return -(-len(self.buf) // chunk)
