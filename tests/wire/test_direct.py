"""The direct lane (p2pfl.wire.direct): pulls straight from the serving peer over TCP, with
the MQTT lane as the fallback; hostile direct clients; mutual TLS."""

from __future__ import annotations

import asyncio
import socket
import ssl
import time

import pytest
import torch
from wire_helpers import serve_from

from p2pfl.security.certs import make_swarm_certs
from p2pfl.security.signing import MessageSecurity, direct_tls_contexts
from p2pfl.wire import direct
from p2pfl.wire.direct import DirectLane
from p2pfl.wire.envelope import Envelope
from p2pfl.wire.transfers import PreparedState
from p2pfl.wire.transport import Transport, TransportError

pytestmark = pytest.mark.integration

STATE = {
    "g.w": torch.randn(600, 300),  # 720 KB: several slices' worth of small reads
    "g.b": torch.arange(7, dtype=torch.int64),
    "h.w": torch.randn(3, 3).to(torch.bfloat16),
}


def serve(t: Transport, states: dict[int, dict], gate: asyncio.Event | None = None):
    handler = serve_from(states, gate)
    t.on_request = lambda env: handler(t, env)


PLAIN = DirectLane()


async def started(broker, node_id: str, lane: DirectLane | None = PLAIN, **kw) -> Transport:
    t = Transport("s", node_id, broker.host, broker.port, direct_lane=lane, **kw)
    await t.__aenter__()
    return t


async def until(pred, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def mqtt_sent(t: Transport) -> int:
    return t.stats.bytes_sent - t.stats.direct_bytes_sent


async def test_pull_goes_direct_and_the_broker_carries_control_only(broker):
    a, b = await started(broker, "a"), await started(broker, "b")
    try:
        serve(b, {2: STATE})
        await until(lambda: "direct" in a.peers.get("b", {}))
        sent_before = mqtt_sent(b)
        got = await a.pull("b", 2, "all", timeout=10)
        assert set(got) == set(STATE)
        assert all(got[k].dtype == STATE[k].dtype and torch.equal(got[k], STATE[k]) for k in STATE)
        assert list(await a.pull("b", 2, "h", timeout=10)) == ["h.w"]
        with pytest.raises(TransportError, match="refused the pull: none"):
            await a.pull("b", 5, "all", timeout=10)
        assert list(a.pull_lanes) == [("b", "direct")] * 2
        assert b.stats.direct_bytes_sent > 600 * 300 * 4
        assert a.stats.direct_bytes_recv > 600 * 300 * 4
        assert mqtt_sent(b) == sent_before  # not one byte of it through the broker
    finally:
        await a.close()
        await b.close()


async def test_unreachable_or_absent_direct_address_falls_back_to_mqtt(broker):
    a = await started(broker, "a")
    b = await started(broker, "b")
    c = await started(broker, "c", lane=None)  # serves over MQTT only
    try:
        for t in (a, b, c):
            serve(t, {1: STATE})
        await until(lambda: "direct" in a.peers.get("b", {}) and "c" in a.peers)
        assert "direct" not in a.peers["c"]
        b.direct.server.close()  # announced, but nothing listens any more
        await b.direct.server.wait_closed()
        got_b = await a.pull("b", 1, "all", timeout=10)
        got_c = await a.pull("c", 1, "all", timeout=10)
        assert torch.equal(got_b["g.w"], STATE["g.w"]) and torch.equal(got_c["g.w"], STATE["g.w"])
        assert list(a.pull_lanes) == [("b", "mqtt"), ("c", "mqtt")]
        # a node without the lane pulls over MQTT from one that has it
        assert torch.equal((await c.pull("a", 1, "all", timeout=10))["g.w"], STATE["g.w"])
        assert list(c.pull_lanes) == [("a", "mqtt")]
    finally:
        for t in (a, b, c):
            await t.close()


async def test_limits_and_digest_hold_on_the_direct_lane(broker):
    a, b = await started(broker, "a"), await started(broker, "b")
    try:
        serve(b, {1: STATE})
        await until(lambda: "direct" in a.peers.get("b", {}))
        with pytest.raises(TransportError, match="exceeds the limit of 1000"):
            await a.pull("b", 1, "all", timeout=10, max_bytes=1000)

        async def corrupt(env: Envelope) -> None:
            prepared = PreparedState.from_state(STATE)
            prepared.buf[100] ^= 0xFF  # the bytes no longer match the digest
            await b.send_state(env.sender, env.id, env.round, prepared)

        b.on_request = corrupt
        with pytest.raises(TransportError, match="digest mismatch"):
            await a.pull("b", 1, "all", timeout=10)
        assert a.dropped["bad_transfer"] == 2
    finally:
        await a.close()
        await b.close()


async def test_a_direct_pull_fails_when_the_peer_goes_offline(broker):
    a, b = await started(broker, "a"), await started(broker, "b")
    try:
        serve(b, {1: STATE}, gate=asyncio.Event())  # b never answers
        await until(lambda: "direct" in a.peers.get("b", {}))
        pulling = asyncio.ensure_future(a.pull("b", 1, "all", timeout=60))
        await until(lambda: b.direct.replies)  # the request reached b
        await b.close()  # offline presence, as the broker would publish b's Will
        with pytest.raises(TransportError, match="offline|closed|connection"):
            await asyncio.wait_for(pulling, 10)
    finally:
        await a.close()
        await b.close()


async def _raw(address: str, data: bytes) -> bytes:
    host, port = direct.parse_address(address)
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()


async def test_hostile_direct_clients_are_dropped_and_the_server_stays_up(broker):
    a, b = await started(broker, "a"), await started(broker, "b")
    try:
        serve(b, {1: STATE})
        addr = b.direct_address
        assert await _raw(addr, b"GET / HTTP/1.1\r\n\r\n") == b""
        assert await _raw(addr, direct.MAGIC + (1 << 30).to_bytes(4, "big")) == b""
        assert await _raw(addr, direct.MAGIC + direct.frame(b"\xc1garbage")) == b""
        other = Envelope("t", "a", 1, "pull", "x1", {"part": "all"}).pack()
        assert await _raw(addr, direct.MAGIC + direct.frame(other)) == b""
        gossip = Envelope("s", "a", 1, "gossip", "x2", {}).pack()
        assert await _raw(addr, direct.MAGIC + direct.frame(gossip)) == b""
        for reason in ("direct_bad_magic", "oversized", "malformed", "foreign_swarm"):
            assert b.dropped[reason] == 1, reason
        assert b.dropped["unexpected_kind"] == 1
        # a silent client is cut off; meanwhile a real pull goes through
        with socket.create_connection(direct.parse_address(addr)):
            await until(lambda: "direct" in a.peers.get("b", {}))
            got = await a.pull("b", 1, "g", timeout=10)
        assert set(got) == {"g.w", "g.b"} and list(a.pull_lanes) == [("b", "direct")]
    finally:
        await a.close()
        await b.close()


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_swarm_certs(tmp_path_factory.mktemp("certs"), "s", ["a", "b", "m"])


def secure_lane(certs, node_id: str) -> DirectLane:
    server, client = direct_tls_contexts(certs.root, node_id)
    return DirectLane(server_tls=server, client_tls=client)


async def test_mutual_tls_on_the_direct_lane(broker, certs):
    def signed(node_id: str) -> MessageSecurity:
        return MessageSecurity.from_certs(certs.root, node_id, ["a", "b", "m"], max_age_s=60)

    a = await started(broker, "a", secure_lane(certs, "a"), security=signed("a"))
    b = await started(broker, "b", secure_lane(certs, "b"), security=signed("b"))
    m = await started(broker, "m", secure_lane(certs, "m"), security=signed("m"))
    try:
        serve(b, {1: STATE})
        await until(lambda: "direct" in a.peers.get("b", {}) and "b" in m.peers)
        got = await a.pull("b", 1, "all", timeout=10)
        assert torch.equal(got["g.w"], STATE["g.w"]) and list(a.pull_lanes) == [("b", "direct")]
        # a client without a certificate of the swarm gets nothing: the handshake fails
        # (TLS 1.2), or the server closes the connection right after it (TLS 1.3)
        host, port = direct.parse_address(b.direct_address)
        anonymous = ssl.create_default_context(cafile=str(certs.ca_cert))
        anonymous.check_hostname = False
        with pytest.raises((direct.DirectUnreachable, ConnectionError)):
            conn, rx = await direct.connect(host, port, anonymous, 3)
            request = Envelope("s", "a", 1, "pull", "anon1", {"part": "all"}, ts=time.time())
            conn.write(direct.MAGIC + direct.frame(request.pack()))
            await rx.read_frame(1 << 20)
        # a member whose certificate is m's, sending a pull signed as m but claiming to be
        # a, is refused: the certificate's CN must be the sender
        conn, rx = await direct.connect(host, port, secure_lane(certs, "m").client_tls, 3)
        forged = Envelope("s", "a", 1, "pull", "forged1", {"part": "all"}, ts=1.0).pack()
        conn.write(direct.MAGIC + direct.frame(forged))
        with pytest.raises(ConnectionError):
            await rx.read_frame(1 << 20)
        conn.close()
        assert b.dropped["sender_mismatch"] == 1
    finally:
        for t in (a, b, m):
            await t.close()


async def test_the_receiver_feeds_its_sink_every_byte_in_order_spilled_ones_first():
    """Bytes that arrived before ``read_into`` (spilled) and bytes written straight into the
    buffer reach ``sink`` exactly once each, in order: the digest sees the whole payload."""
    payload = bytes(range(256)) * 12_000  # 3 MB: some spilled, the rest many socket reads
    head_sent = asyncio.Event()

    async def handle(reader, writer):
        writer.write(direct.frame(b"meta") + payload[:200_000])  # lands in the spill buffer
        await writer.drain()
        head_sent.set()
        await reader.readexactly(1)
        writer.write(payload[200_000:])
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    conn, rx = await direct.connect("127.0.0.1", port, None, 5)
    try:
        assert await rx.read_frame(1024) == b"meta"
        await head_sent.wait()
        await until(lambda: rx.received >= 4 + 4 + 200_000)
        pieces: list[bytes] = []
        rx.sink = lambda view: pieces.append(bytes(view))
        buf = memoryview(bytearray(len(payload)))
        conn.write(b"!")
        await rx.read_into(buf)
        assert bytes(buf) == payload and b"".join(pieces) == payload and len(pieces) > 2
    finally:
        conn.close()
        server.close()
