"""This node's end of the direct lane: the server that answers pulls over TCP and the
client that makes them (docs/wire.md, "Direct lane").

:class:`DirectEndpoint` is a :class:`~p2pfl.wire.lane.Lane`, the first a transport tries:
it pulls from a peer that announces a direct address in its presence, and answers, on
their own connection, the pulls that came that way. It moves frames and bytes
(:mod:`p2pfl.wire.direct`: framing, the zero-copy :class:`~p2pfl.wire.direct.Receiver`)
and leaves every check of an envelope to the receive pipeline (:mod:`p2pfl.wire.receive`):
a request is admitted as a ``pull`` in this node's inbox, an answer as an inbox message
from the peer asked. The envelopes it sends are made by the transport
(:mod:`p2pfl.wire.transport`, ``pack``).

A pull whose peer announces no address, or whose address cannot be connected to (refused,
timed out, TLS handshake failed), is not this lane's: :meth:`DirectEndpoint.pull` returns
None and the transport falls back to the next lane. A peer reached that then refuses,
sends a corrupt state or drops the connection fails the pull.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

import numpy as np

from p2pfl.wire import direct
from p2pfl.wire.codec import CodecError, buffer_to_state
from p2pfl.wire.digest import new_hasher
from p2pfl.wire.envelope import Envelope
from p2pfl.wire.errors import TransportError
from p2pfl.wire.lane import Answer, Pack, Pull
from p2pfl.wire.receive import ReceivePipeline
from p2pfl.wire.stats import TransportStats
from p2pfl.wire.transfers import State, TransferError, check_meta

# every line the transport writes goes to one logger, whichever of its modules writes it
log = logging.getLogger("p2pfl.wire.transport")


class DirectEndpoint:
    """Serves and makes direct pulls for one node. ``unanswered(env)``: called when the
    node's request handler returned without answering a direct pull (the transport then
    refuses it). ``pack`` (:data:`~p2pfl.wire.lane.Pack`) makes the envelopes it answers
    with."""

    name = "direct"

    def __init__(
        self,
        node_id: str,
        lane: direct.DirectLane,
        inbound: ReceivePipeline,
        stats: TransportStats,
        max_message_bytes: int,
        unanswered: Callable[[Envelope], Awaitable[None]],
        pack: Pack,
    ):
        self.node_id = node_id
        self.lane = lane
        self.inbound = inbound
        self.stats = stats
        self.max_message_bytes = max_message_bytes
        self._unanswered = unanswered
        self._pack = pack
        self.server: asyncio.Server | None = None
        self.replies: dict[str, asyncio.StreamWriter] = {}  # pulls being served, by xfer id

    # ------------------------------------------------------------------ serving
    async def start(self) -> str:
        """Listen; returns the ``host:port`` to announce. :class:`TransportError` when the
        port cannot be bound."""
        lane = self.lane
        try:
            self.server = await asyncio.start_server(
                self._serve, lane.bind, lane.port, ssl=lane.server_tls
            )
        except OSError as exc:
            raise TransportError(
                f"{self.node_id}: cannot listen for direct pulls on {lane.bind}:{lane.port}: {exc}"
            ) from None
        port = self.server.sockets[0].getsockname()[1]
        return f"{lane.advertise}:{port}"

    def close(self) -> None:
        """Stop listening and drop the connections of pulls being served."""
        if self.server is not None:
            self.server.close()
            self.server = None
        for writer in self.replies.values():
            writer.close()

    def take_reply(self, xfer: str) -> asyncio.StreamWriter | None:
        """The connection pull ``xfer`` came on, if it came over the direct lane and is not
        answered yet; the caller answers on it."""
        return self.replies.pop(xfer, None)

    async def write(
        self, writer: asyncio.StreamWriter, head: bytes, data: memoryview | None = None
    ) -> None:
        """Answer on a direct connection: one frame ``head``, then ``data``'s raw bytes."""
        try:
            writer.write(head)
            if data is not None:
                await direct.send_buffer(writer, data)
            await writer.drain()
        except (ConnectionError, OSError) as exc:
            raise TransportError(f"{self.node_id}: direct connection lost: {exc}") from None
        self.stats.sent_direct(len(head) + (0 if data is None else len(data)), messages=1)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        """One direct connection: read the pull, admit it as an inbox message, hand it to
        ``on_request``; the answer goes back on this connection (:meth:`take_reply`).
        Anything off closes the connection and is counted in ``dropped``."""
        peer = writer.get_extra_info("peername")
        env: Envelope | None = None
        inbound = self.inbound
        try:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            head = await asyncio.wait_for(
                reader.readexactly(len(direct.MAGIC) + direct.LENGTH.size),
                direct.REQUEST_TIMEOUT_S,
            )
            if head[: len(direct.MAGIC)] != direct.MAGIC:
                inbound.drop("direct_bad_magic", peer)
                return
            (size,) = direct.LENGTH.unpack(head[len(direct.MAGIC) :])
            if size > self.max_message_bytes:
                inbound.drop("oversized", f"direct request from {peer}: {size} bytes")
                return
            payload = await asyncio.wait_for(reader.readexactly(size), direct.REQUEST_TIMEOUT_S)
            self.stats.received_direct(len(head) + size, messages=1)
            tls = self.lane.server_tls is not None
            certificate = direct.peer_common_name(writer.transport) if tls else None
            nbytes = len(head) + size
            env = await inbound.direct_request(payload, nbytes, tls=tls, certificate=certificate)
            if env is None or inbound.on_request is None:
                return
            self.replies[env.id] = writer
            await inbound.on_request(env)
            if self.replies.pop(env.id, None) is not None:  # served nothing
                await self._unanswered(env)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError, OSError) as exc:
            log.debug("%s: direct connection from %s ended: %r", self.node_id, peer, exc)
        except TransportError as exc:
            log.info("%s: direct pull from %s: %s", self.node_id, peer, exc)
        except Exception as exc:  # a peer's bytes must never kill the node
            inbound.drop("handler_error", f"direct from {peer}: {exc!r}")
        finally:
            if env is not None:
                self.replies.pop(env.id, None)
            writer.close()

    # ------------------------------------------------------------------ the lane
    def address(self, peer: str) -> tuple[str, int] | None:
        """The direct address ``peer``'s latest presence announces, None when none (or not
        a ``host:port``: presence is untrusted)."""
        return direct.parse_address(self.inbound.peers.get(peer, {}).get("direct"))

    async def probe(self, peer: str, timeout: float) -> bool | None:
        """Whether ``peer``'s direct address accepts a TCP connection within ``timeout``
        (closed at once, before any TLS handshake or request); None when it announces none."""
        address = self.address(peer)
        if address is None:
            return None
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(*address), timeout)
        except (OSError, asyncio.TimeoutError):
            return False
        writer.close()
        return True

    async def pull(self, pull: Pull) -> State | None:
        """``pull`` from the address the peer announces, until its deadline and as long as
        ``pull.arrived`` has not failed (the peer went offline). None when the peer
        announces no address or cannot be connected to (the transport falls back to the
        next lane); raises the peer's going offline, this pull's own failure, or
        :class:`asyncio.TimeoutError`."""
        address = self.address(pull.peer)
        if address is None:
            return None
        watch = pull.arrived
        task = asyncio.ensure_future(
            self.fetch(pull.peer, address, pull.request, pull.xfer, pull.limit)
        )
        try:
            done, _ = await asyncio.wait(
                {task, watch}, timeout=pull.remaining(), return_when=asyncio.FIRST_COMPLETED
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
            log.info("%s: %s not reachable directly (%s): over MQTT", self.node_id, pull.peer, exc)
        if watch.done():
            watch.result()  # it went offline meanwhile: no pull over another lane either
        return None

    async def answer(self, answer: Answer) -> bool:
        """The metadata frame, then the state's raw bytes, on the connection ``answer``'s
        pull came on; False when it did not come over this lane (or is answered already)."""
        writer = self.take_reply(answer.xfer)
        if writer is None:
            return False
        head = self._pack(answer.to, "xfer_meta", answer.round_no, answer.meta())
        await self.write(writer, direct.frame(head), memoryview(answer.prepared.buf))
        return True

    async def refuse(self, to: str, xfer: str, payload: bytes) -> bool:
        """``payload`` (a ``pull_error``) as one frame on the connection pull ``xfer`` came
        on; False when it did not come over this lane."""
        writer = self.take_reply(xfer)
        if writer is None:
            return False
        await self.write(writer, direct.frame(payload))
        return True

    async def fetch(
        self,
        peer: str,
        address: tuple[str, int],
        request: Callable[[], bytes],
        xfer: str,
        limit: int,
    ) -> State:
        """One pull of transfer ``xfer`` from ``peer`` at ``address``, ``request()`` making
        the packed ``pull`` envelope once connected. Raises
        :class:`~p2pfl.wire.direct.DirectUnreachable` when the connection cannot be opened
        (:meth:`pull` then leaves it to the next lane); else returns the state, whose
        tensors share one buffer filled and verified against the digest, or raises
        :class:`TransportError`."""
        tls = self.lane.client_tls
        conn, rx = await direct.connect(*address, tls, self.lane.connect_timeout)
        inbound = self.inbound
        try:
            if tls is not None and direct.peer_common_name(conn) != peer:
                raise TransportError(
                    f"direct pull from {peer}: {address[0]}:{address[1]} presented a "
                    f"certificate for {direct.peer_common_name(conn)!r}"
                )
            payload = request()
            conn.write(direct.MAGIC + direct.frame(payload))
            self.stats.sent_direct(
                len(direct.MAGIC) + direct.LENGTH.size + len(payload), messages=0
            )
            frame = await rx.read_frame(self.max_message_bytes)
            arrived = asyncio.get_running_loop().time()  # the answer's first bytes are in
            reply = inbound.direct_reply(peer, frame)
            body = reply.body if isinstance(reply.body, dict) else {}
            if reply.kind == "pull_error":
                await inbound.crossed(peer, direct.LENGTH.size + len(frame), arrived)
                raise TransportError(f"{peer} refused the pull: {body.get('reason')}")
            if reply.kind != "xfer_meta" or body.get("xfer") != xfer:
                raise TransportError(f"direct pull from {peer}: unexpected {reply.kind}")
            signed = inbound.transfers.signed
            meta = check_meta(body, limit, self.max_message_bytes, signed=signed)
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
            # the answer, metadata and bytes, crosses the peer's emulated link as one message
            await inbound.crossed(peer, direct.LENGTH.size + len(frame) + meta.total, arrived)
            if hasher.hexdigest() != meta.hexdigest:
                inbound.drop(
                    "bad_transfer", f"direct transfer from {peer} rejected: digest mismatch"
                )
                raise TransportError(f"transfer from {peer}: digest mismatch")
            return state  # its tensors share ``buf``, now filled and verified
        except TransferError as exc:
            inbound.drop("bad_transfer", f"direct transfer from {peer} rejected: {exc}")
            raise TransportError(f"transfer from {peer}: {exc}") from None
        except (ConnectionError, ValueError) as exc:
            raise TransportError(f"direct pull from {peer}: {exc}") from None
        finally:
            conn.close()
