"""Transport against a real Mosquitto: chunked pulls, refusals, and hostile input."""

from __future__ import annotations

import asyncio

import aiomqtt
import msgpack
import pytest
import torch
from wire_helpers import serve_from

from p2pfl import PROTOCOL_VERSION
from p2pfl.wire.envelope import Envelope
from p2pfl.wire.transfers import PreparedState
from p2pfl.wire.transport import Transport, TransportError

pytestmark = pytest.mark.integration


async def pair(broker, **kw):
    a = Transport("s", "a", broker.host, broker.port, chunk_bytes=64 * 1024, **kw)
    b = Transport("s", "b", broker.host, broker.port, chunk_bytes=64 * 1024, **kw)
    await a.__aenter__()
    await b.__aenter__()
    return a, b


async def test_pull_chunked_state_round_trip(broker):
    state = {
        "g.w": torch.randn(300, 257),  # ~300 KB: several 64 KiB chunks
        "g.b": torch.arange(7, dtype=torch.int64),
        "h.w": torch.randn(3, 3).to(torch.bfloat16),
    }
    a, b = await pair(broker)
    try:
        b.on_request = lambda env: serve_from({2: state})(b, env)
        got = await a.pull("b", 2, "all", timeout=10)
        assert set(got) == set(state)
        for k in state:
            assert got[k].dtype == state[k].dtype and torch.equal(got[k], state[k])
        only_h = await a.pull("b", 2, "h", timeout=10)
        assert list(only_h) == ["h.w"]
        with pytest.raises(TransportError, match="refused"):
            await a.pull("b", 5, "all", timeout=10)
        assert a.stats.bytes_recv > 300 * 257 * 4
        assert b.stats.bytes_sent > 300 * 257 * 4
    finally:
        await a.close()
        await b.close()


async def test_pull_with_sha256_and_unknown_digest(broker):
    state = {"g.w": torch.randn(64, 64)}
    a, b = await pair(broker)
    try:
        for name in ("sha256", "md5"):

            async def serve(env, name=name):
                prepared = PreparedState.from_state(state, digest="sha256")
                prepared.digest_name = name  # md5: a name the receiver does not accept
                await b.send_state(env.sender, env.id, env.round, prepared)

            b.on_request = serve
            if name == "sha256":
                got = await a.pull("b", 1, "all", timeout=10)
                assert torch.equal(got["g.w"], state["g.w"])
            else:
                with pytest.raises(TransportError, match="unsupported digest"):
                    await a.pull("b", 1, "all", timeout=10)
    finally:
        await a.close()
        await b.close()


async def test_pull_from_absent_peer_times_out(broker):
    a, b = await pair(broker)
    try:
        with pytest.raises(TransportError, match="timed out"):
            await a.pull("nobody", 1, "all", timeout=0.5)
    finally:
        await a.close()
        await b.close()


async def test_presence_and_gossip(broker):
    a, b = await pair(broker)
    seen = []
    try:
        b.on_gossip = seen.append
        await a.gossip(3, {"n": 5, "I": torch.ones(4) / 4})
        for _ in range(50):
            if seen:
                break
            await asyncio.sleep(0.05)
        assert seen and seen[0].sender == "a" and seen[0].round == 3
        assert torch.equal(seen[0].body["I"], torch.ones(4) / 4)
        assert b.peers["a"]["status"] == "online"
        await a.set_status("done")
        for _ in range(50):
            if b.peers["a"]["status"] == "done":
                break
            await asyncio.sleep(0.05)
        assert b.peers["a"]["status"] == "done"
    finally:
        await a.close()
        await b.close()
    # a graceful close leaves "offline" retained for late joiners
    c = Transport("s", "c", broker.host, broker.port)
    async with c:
        for _ in range(50):
            if c.peers.get("a", {}).get("status") == "offline":
                break
            await asyncio.sleep(0.05)
        assert c.peers["a"]["status"] == "offline"


async def test_listen_to_hears_only_the_named_peers(broker):
    """A node given ``listen_to`` subscribes to those peers' presence and gossip only: the
    broker never delivers it the others' (the fan-out of a sparse graph stays N·k)."""
    a, b = await pair(broker)
    c = Transport("s", "c", broker.host, broker.port, listen_to=["a", "c"])
    assert c.subscriptions() == ["p2pfl/s/inbox/c", "p2pfl/s/presence/a", "p2pfl/s/gossip/a"]
    heard_by_a, heard_by_c, inbox_b = [], [], []
    a.on_gossip, c.on_gossip, b.on_inbox = heard_by_a.append, heard_by_c.append, inbox_b.append
    try:
        await c.__aenter__()
        await b.gossip(1, {"n": 1})
        await wait_until(lambda: heard_by_a)  # routed by the broker to every subscriber
        await a.gossip(1, {"n": 2})
        await wait_until(lambda: heard_by_c)
        assert [(e.sender, e.body["n"]) for e in heard_by_c] == [("a", 2)]
        assert set(c.peers) == {"a"} and c.peers["a"]["status"] == "online"
        await c.send("b", "report", 1, {"x": 1})  # anyone's inbox is still reachable
        await wait_until(lambda: inbox_b)
        assert inbox_b[0].sender == "c"
    finally:
        await c.close()
        await a.close()
        await b.close()


async def test_hear_presence_narrows_and_widens_on_the_live_connection(broker):
    """A node that narrows whose presence it hears stops receiving the others' presence
    (the broker no longer delivers it); widening again returns only once the retained
    presence of every newly heard peer has arrived, so its view of them is live."""
    a, b = await pair(broker)
    c = Transport("s", "c", broker.host, broker.port)
    try:
        await c.__aenter__()
        await wait_until(lambda: {"a", "b"} <= set(c.peers))
        await c.hear_presence(["a"], fresh_within=5.0, members=["a", "b", "c"])
        assert c.subscriptions()[1:2] == ["p2pfl/s/presence/a"]
        assert c.hears_presence("a") and not c.hears_presence("b")
        received = c.stats.messages_recv
        await b.set_status("done", round=7)  # not delivered to c any more
        await a.set_status("done", round=3)
        await wait_until(lambda: c.peers["a"].get("round") == 3)
        assert c.peers["b"]["status"] == "online" and "round" not in c.peers["b"]
        assert c.stats.messages_recv == received + 1  # a's presence only
        await c.hear_presence(None, fresh_within=5.0, members=["a", "b", "c"])
        # returned after b's retained presence: c's view of b is live without any wait
        assert c.peers["b"]["status"] == "done" and c.peers["b"]["round"] == 7
        assert c.hears_presence("b") and "p2pfl/s/presence/+" in c.subscriptions()
    finally:
        await c.close()
        await a.close()
        await b.close()


async def test_hear_presence_sets_what_a_new_connection_subscribes_to(broker):
    """The presence a node hears is what every later connection subscribes to (the lane
    subscribes each new connection from :meth:`MqttLane.subscriptions`)."""
    a, b = await pair(broker)
    try:
        await a.hear_presence(["b"], fresh_within=5.0)
        assert a.mqtt.subscriptions() == [
            "p2pfl/s/inbox/a",
            "p2pfl/s/presence/b",
            "p2pfl/s/gossip/+",
        ]
        fresh = aiomqtt.Client(broker.host, broker.port)
        async with fresh:  # the lane subscribes a new connection from the same sets
            await a.mqtt._subscribe(fresh)
    finally:
        await a.close()
        await b.close()


async def wait_until(cond, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.02)


async def test_hostile_messages_are_dropped_and_counted(broker):
    a, b = await pair(broker, max_message_bytes=256 * 1024)
    state = {"g.w": torch.randn(100, 100)}
    b.on_request = lambda env: serve_from({1: state})(b, env)
    good = Envelope("s", "mallory", 1, "gossip", "id1", {}).pack()
    cases = {
        "garbage": b"\x00\xff not msgpack at all",
        "truncated": good[:-3],
        "oversized": b"\x00" * (300 * 1024),
        "foreign swarm": Envelope("other", "mallory", 1, "pull", "id2", {"part": "all"}).pack(),
        "unknown kind": msgpack.packb(
            {
                "v": PROTOCOL_VERSION,
                "swarm": "s",
                "from": "m",
                "round": 1,
                "kind": "exec",
                "id": "x",
                "body": None,
            }
        ),
        "negative round": msgpack.packb(
            {
                "v": PROTOCOL_VERSION,
                "swarm": "s",
                "from": "m",
                "round": -4,
                "kind": "pull",
                "id": "y",
                "body": None,
            }
        ),
        "bad tensor": msgpack.packb(
            {
                "v": PROTOCOL_VERSION,
                "swarm": "s",
                "from": "m",
                "round": 1,
                "kind": "gossip",
                "id": "z",
                "body": {
                    "I": {"__tensor__": 1, "dtype": "float32", "shape": [1000], "data": b"abc"}
                },
            }
        ),
        "frame: header past end": b"P2F\x01" + b"\xff\xff\xff\x7f" + b"tail",
        "frame: truncated": b"P2F\x01\x00",
        "frame: garbage header": b"P2F\x01" + (3).to_bytes(4, "little") + b"\xc1\xc1\xc1data",
        "stray chunk": Envelope(
            "s", "m", 1, "xfer_chunk", "c1", {"xfer": "nope", "seq": 0, "data": b"x"}
        ).pack(),
    }
    try:
        async with aiomqtt.Client(broker.host, broker.port) as rogue:
            for payload in cases.values():
                await rogue.publish("p2pfl/s/inbox/a", payload, qos=1)
            await rogue.publish("p2pfl/s/gossip/b", good, qos=1)  # sender != topic owner
        for _ in range(100):
            if sum(a.dropped.values()) >= len(cases):
                break
            await asyncio.sleep(0.05)
        assert sum(a.dropped.values()) >= len(cases), a.dropped
        assert a.dropped["oversized"] == 1 and a.dropped["foreign_swarm"] == 1
        assert a.dropped["malformed"] >= 7
        # the node is still fine: a real pull works afterwards
        got = await a.pull("b", 1, "all", timeout=10)
        assert torch.equal(got["g.w"], state["g.w"])
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize(
    "digest, match",
    [("blake3", "digest mismatch"), ("sha256", "digest mismatch")],
)
async def test_corrupt_transfer_is_rejected(broker, digest, match):
    """A peer whose chunks do not match the announced digest is refused."""
    a, b = await pair(broker)
    try:

        async def liar(env):
            prepared = PreparedState.from_state({"g.w": torch.ones(10)}, digest=digest)
            prepared.hexdigest = "0" * 64
            await b.send_state(env.sender, env.id, env.round, prepared)

        b.on_request = liar
        with pytest.raises(TransportError, match=match):
            await a.pull("b", 1, "all", timeout=10)
        assert a.dropped["bad_transfer"] == 1
    finally:
        await a.close()
        await b.close()


async def test_reconnects_and_resubscribes_after_broker_restart(tmp_path, broker_kind):
    """The broker goes away and comes back on the same port: both nodes reconnect,
    re-announce presence, resubscribe, and a pull works again."""
    from p2pfl.launch.broker import make_broker

    broker = make_broker(broker_kind, workdir=tmp_path / "b1").start()
    port = broker.port
    a, b = await pair(broker)
    state = {"g.w": torch.randn(50, 50)}
    b.on_request = lambda env: serve_from({1: state})(b, env)
    try:
        broker.stop()
        for _ in range(100):
            if not a.connected and not b.connected:
                break
            await asyncio.sleep(0.05)
        broker = make_broker(broker_kind, port=port, workdir=tmp_path / "b2").start()
        # b's entry may read offline (its Last Will, seen as the old broker went): wait for
        # its presence to come back online through the new broker, not for an entry to exist
        for _ in range(400):
            online = a.peers.get("b", {}).get("status") == "online"
            if a.connected and b.connected and online:
                break
            await asyncio.sleep(0.05)
        assert a.connected and b.connected
        assert a.peers["b"]["status"] == "online"  # presence re-announced to the new broker
        got = await a.pull("b", 1, "all", timeout=10)
        assert torch.equal(got["g.w"], state["g.w"])
    finally:
        await a.close()
        await b.close()
        broker.stop()


async def test_pull_fails_as_soon_as_the_peer_goes_offline(broker):
    """A pull from a peer that dies mid-transfer fails on its Last Will, not its deadline;
    a pull from a peer already offline fails before it is sent."""
    a, b = await pair(broker)
    b.on_request = None  # b never answers: only its presence can end the wait
    try:
        pulling = asyncio.ensure_future(a.pull("b", 1, "all", timeout=60))
        await asyncio.sleep(0.3)
        assert not pulling.done()
        t0 = asyncio.get_running_loop().time()
        await b.close(graceful=True)  # publishes offline, as the broker would b's Last Will
        with pytest.raises(TransportError, match="went offline"):
            await pulling
        assert asyncio.get_running_loop().time() - t0 < 5
        with pytest.raises(TransportError, match="is offline"):
            await a.pull("b", 1, "all", timeout=60)
    finally:
        await a.close()
        await b.close()


async def test_pull_refuses_a_transfer_over_its_limit(broker):
    state = {"g.w": torch.randn(100, 100)}  # 40 KB
    a, b = await pair(broker)
    b.on_request = lambda env: serve_from({1: state})(b, env)
    try:
        with pytest.raises(TransportError, match="exceeds the limit of 1000"):
            await a.pull("b", 1, "all", timeout=10, max_bytes=1000)
        got = await a.pull("b", 1, "all", timeout=10, max_bytes=100_000)
        assert torch.equal(got["g.w"], state["g.w"])
    finally:
        await a.close()
        await b.close()


async def test_broker_lost_for_good_raises_after_the_timeout(broker):
    """``watch_broker`` rides out nothing longer than ``broker_timeout``; the outage is
    counted in ``offline_seconds``."""
    from p2pfl.wire.transport import BrokerLostError

    t = Transport("s", "a", broker.host, broker.port, broker_timeout=1.5)
    await t.__aenter__()
    watch = asyncio.ensure_future(t.watch_broker())
    try:
        await asyncio.sleep(0.2)
        assert not watch.done() and t.offline_seconds() == 0
        broker.proc.kill()
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(BrokerLostError, match="unreachable for 2 s"):
            await asyncio.wait_for(watch, 20)
        took = asyncio.get_running_loop().time() - t0
        assert 1.5 <= took < 10, took
        assert t.offline_seconds() >= 1.0
    finally:
        watch.cancel()
        await t.close()
        broker.stop()


async def test_a_session_ended_by_an_unexpected_error_reconnects(broker):
    """Whatever ends a session (here a handler raising on the first message), the lane
    reconnects at once and counts the gap as an outage: a node is never left with a dead
    connection loop that reports no outage."""
    t = Transport("s", "a", broker.host, broker.port)
    real, seen = t.mqtt._on_message, []

    def fails_once(topic, payload):
        seen.append(topic)
        if len(seen) == 1:
            raise RuntimeError("a handler's bug")
        real(topic, payload)

    t.mqtt._on_message = fails_once
    await t.__aenter__()
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while not (len(seen) >= 2 and t.mqtt.connected) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        assert len(seen) >= 2 and t.mqtt.connected, seen  # the presence, echoed again
        assert t.offline_seconds() > 0
        await t.set_status("online", round=1)  # the new session publishes
    finally:
        await t.close()


async def test_publish_in_flight_fails_when_the_connection_drops(broker):
    """A QoS-1 publish waiting for its acknowledgement fails as soon as the connection is
    lost, not after aiomqtt's 30 s timeout (a round would otherwise stall that long)."""
    import os
    import signal

    t = Transport("s", "a", broker.host, broker.port)
    await t.__aenter__()
    try:
        os.kill(broker.proc.pid, signal.SIGSTOP)  # no PUBACK will come
        publishing = asyncio.ensure_future(t.gossip(1, {"x": 1}))
        await asyncio.sleep(0.5)
        assert not publishing.done()
        broker.proc.kill()  # the connection drops under the waiting publish
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(TransportError):
            await asyncio.wait_for(publishing, 20)
        assert asyncio.get_running_loop().time() - t0 < 5
    finally:
        await t.close(graceful=False)
        broker.stop()


def test_first_connection_waits_are_seeded_backoff_with_full_jitter():
    from p2pfl.wire.mqtt_lane import FIRST_WAIT_S, MAX_WAIT_S, first_connection_waits

    def waits(node: str) -> list[float]:
        it = first_connection_waits(node)
        return [next(it) for _ in range(40)]

    a = waits("a")
    assert a == waits("a") and a != waits("b")  # the same node waits the same every run
    for n, w in enumerate(a):
        assert 0 <= w <= min(MAX_WAIT_S, FIRST_WAIT_S * 2**n)
    assert max(a) > FIRST_WAIT_S * 4  # it does back off


@pytest.mark.one_broker
async def test_a_broker_that_starts_late_is_retried_until_it_answers(tmp_path, broker_kind, caplog):
    """The transport starts before its broker: it says so once, retries, and connects when
    the broker comes up, within ``startup_timeout``."""
    import logging

    from p2pfl.launch.broker import free_port, make_broker

    port = free_port()
    t = Transport("s", "a", "127.0.0.1", port, startup_timeout=60)
    caplog.set_level(logging.DEBUG, logger="p2pfl.wire.transport")
    entering = asyncio.ensure_future(t.__aenter__())
    broker = None
    try:
        await wait_until(lambda: sum("did not answer" in r.message for r in caplog.records) >= 2)
        assert not entering.done()
        broker = await asyncio.to_thread(
            make_broker(broker_kind, port=port, workdir=tmp_path).start
        )
        await asyncio.wait_for(entering, 30)
        assert t.connected
        said = [r for r in caplog.records if "did not answer" in r.message]
        assert [r.levelname for r in said][:2] == ["WARNING", "DEBUG"]  # one warning line
        assert f"broker at 127.0.0.1:{port} did not answer" in said[0].message
        assert any("connected to the broker" in r.message for r in caplog.records)
        assert t.offline_seconds() == 0  # waiting for the first connection is no outage
    finally:
        entering.cancel()
        await t.close()
        if broker is not None:
            broker.stop()
