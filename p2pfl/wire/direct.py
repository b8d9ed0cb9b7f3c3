"""The direct lane: a weight pull straight from the serving peer over TCP (docs/wire.md,
"Direct lane").

A node that serves the lane listens on one TCP port and announces ``host:port`` in its
presence (``direct``). One connection carries one pull:

- client → server: :data:`MAGIC`, then one frame holding the packed ``pull`` envelope
  (signed for the server's inbox topic when the swarm signs);
- server → client: one frame holding an ``xfer_meta`` envelope (the same metadata as the
  MQTT lane: size, digest, tensor index) followed by exactly ``total`` raw bytes, or one
  frame holding a ``pull_error`` envelope.

A frame is ``u32 big-endian length | bytes``, at most ``max_message_bytes``. The raw bytes
are received straight into one preallocated buffer (:class:`Receiver`, an asyncio buffered
protocol: no per-chunk copies) and each piece is hashed the moment the socket has written
it (:attr:`Receiver.sink`), while it is still in the CPU cache, so the digest is ready when
the last byte lands. Measured here (``scripts/bench_transport.py``), a raw TCP read hashed
that way with XXH3-128 keeps 0.95 of its speed, against 0.76 when 4 MiB slices were hashed
on a worker thread: the thread needs a core that the sender and the receiving loop are
already using, and it reads the bytes back from memory. With ``security.tls`` both ends
present certificates from the swarm CA (mutual TLS) and each checks that the other's
certificate CN is the node it expects. This module holds the framing and the receiving
machinery; the server and the client are :mod:`p2pfl.wire.direct_lane`, and the checks on
envelopes live with the rest of the wire's checks in :mod:`p2pfl.wire.receive`.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
from collections.abc import Callable
from dataclasses import dataclass

from p2pfl.errors import P2PFLError

MAGIC = b"P2PD\x01"
LENGTH = struct.Struct("!I")
SLICE_BYTES = 4 << 20  # one write of the sender (flow control without a queued copy)
SCRATCH_BYTES = 256 << 10
MAX_SPILL_BYTES = 1 << 20  # bytes received ahead of a read; more pauses the socket
CONNECT_TIMEOUT_S = 3.0
REQUEST_TIMEOUT_S = 10.0  # a client must send its request this soon after connecting


class DirectUnreachable(P2PFLError, ConnectionError):
    """The peer's direct address could not be reached (refused, timed out, TLS handshake
    failed): the pull falls back to the MQTT lane."""


@dataclass(frozen=True)
class DirectLane:
    """How a node serves and uses the direct lane: it listens on ``bind:port`` (port 0: a
    free one) and announces ``advertise:<port>``. ``server_tls`` / ``client_tls``: mutual
    TLS contexts from the swarm CA (:func:`p2pfl.security.signing.direct_tls_contexts`),
    both or neither."""

    bind: str = "127.0.0.1"
    advertise: str = "127.0.0.1"
    port: int = 0
    server_tls: ssl.SSLContext | None = None
    client_tls: ssl.SSLContext | None = None
    connect_timeout: float = CONNECT_TIMEOUT_S


def local_address(peer_host: str, peer_port: int = 9) -> str:
    """This host's address on the route to ``peer_host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer_host, peer_port))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def frame(payload: bytes) -> bytes:
    return LENGTH.pack(len(payload)) + payload


def parse_address(value: object) -> tuple[str, int] | None:
    """``host:port`` from an untrusted presence field, or None when it is not one."""
    if not isinstance(value, str) or len(value) > 300:
        return None
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    number = int(port)
    return (host, number) if 0 < number < 65536 else None


def peer_common_name(transport: asyncio.BaseTransport) -> str | None:
    """The CN of the certificate the other end presented (TLS), else None."""
    cert = transport.get_extra_info("peercert")
    if not cert:
        return None
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return value
    return None


class Receiver(asyncio.BufferedProtocol):
    """The client end of a direct connection: :meth:`read_into` fills a caller's buffer
    straight from the socket. Bytes that arrive before a read asks for them wait in a small
    spill buffer (the socket pauses beyond :data:`MAX_SPILL_BYTES`). ``sink``, when set, is
    called with every piece of a :meth:`read_into` buffer as it is filled, in order (e.g. a
    hasher's ``update``)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        # a memoryview: TLS reads into slices of it (a bytearray's slice would be a copy)
        self._scratch = memoryview(bytearray(SCRATCH_BYTES))
        self._spill = bytearray()
        self._target: memoryview | None = None  # what is left of the buffer being filled
        self._handed: memoryview | None = None  # the buffer get_buffer gave
        self._waiter: asyncio.Future | None = None
        self._closed: BaseException | None = None
        self._paused = False
        self.received = 0
        self.sink: Callable[[memoryview], object] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        # never an empty buffer: a TLS transport reads 0 bytes into one and takes it for EOF
        self._handed = self._target if self._target is not None else self._scratch
        return self._handed

    def buffer_updated(self, nbytes: int) -> None:
        self.received += nbytes
        if self._handed is self._target and self._target is not None:
            if self.sink is not None:  # the bytes are still in cache: hash them now
                self.sink(self._target[:nbytes])
            self._target = self._target[nbytes:]
            if not len(self._target):
                self._target = None  # filled: later bytes go to the spill buffer
                self._wake(None)
        else:
            self._spill += self._scratch[:nbytes]
            if len(self._spill) > MAX_SPILL_BYTES and self.transport is not None:
                self.transport.pause_reading()
                self._paused = True

    def eof_received(self) -> bool:
        self._close(ConnectionError("the peer closed the connection"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._close(exc or ConnectionError("connection closed"))

    def _close(self, exc: BaseException) -> None:
        if self._closed is None:
            self._closed = exc
        self._wake(exc)

    def _wake(self, exc: BaseException | None) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            if exc is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(exc)

    async def read_into(self, view: memoryview) -> None:
        """Fill ``view`` completely; raises ConnectionError if the connection ends first."""
        take = min(len(self._spill), len(view))
        if take:
            view[:take] = self._spill[:take]
            del self._spill[:take]
            if self.sink is not None:
                self.sink(view[:take])
        rest = view[take:]
        if not len(rest):
            return
        if self._closed is not None:
            raise ConnectionError(str(self._closed) or "connection closed")
        self._target = rest
        self._waiter = asyncio.get_running_loop().create_future()
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        try:
            await self._waiter
        finally:
            self._target = None
            self._waiter = None

    async def read_frame(self, max_bytes: int) -> bytes:
        """One length-prefixed frame of at most ``max_bytes``."""
        head = bytearray(LENGTH.size)
        await self.read_into(memoryview(head))
        (size,) = LENGTH.unpack(head)
        if size > max_bytes:
            raise ValueError(f"frame of {size} bytes exceeds the limit of {max_bytes}")
        body = bytearray(size)
        await self.read_into(memoryview(body))
        return bytes(body)


async def connect(
    host: str, port: int, tls: ssl.SSLContext | None, timeout: float
) -> tuple[asyncio.Transport, Receiver]:
    """Open a direct connection; :class:`DirectUnreachable` when it cannot be opened."""
    loop = asyncio.get_running_loop()
    try:
        transport, receiver = await asyncio.wait_for(
            loop.create_connection(
                Receiver, host, port, ssl=tls, server_hostname=host if tls else None
            ),
            timeout,
        )
    except (OSError, asyncio.TimeoutError, ssl.SSLError) as exc:
        raise DirectUnreachable(f"{host}:{port}: {exc or type(exc).__name__}") from None
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return transport, receiver  # type: ignore[return-value]


async def send_buffer(writer: asyncio.StreamWriter, buf: memoryview) -> None:
    """Write ``buf`` in slices, each after the previous one drained (flow control without
    copying the whole buffer into the transport's queue)."""
    for start in range(0, len(buf), SLICE_BYTES):
        writer.write(buf[start : start + SLICE_BYTES])
        await writer.drain()
