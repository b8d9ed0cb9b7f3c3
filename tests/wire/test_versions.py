"""Rolling upgrades (README.md, "Rolling upgrades"; docs/wire.md, "Protocol versions"):
envelopes of the previous protocol are read, others refused with a line naming both versions;
a node speaks the oldest version a peer online runs; on a real broker, a node of this release
and a node of the protocol 3 release (its own code, from this repository's history) hear each
other and pull each other's states, and a peer of an unknown newer protocol is refused."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path

import aiomqtt
import pytest
import torch
from waiting import wait_until
from wire_helpers import protocol_3_release

from p2pfl import MIN_PROTOCOL_VERSION, PROTOCOL_VERSION
from p2pfl.wire.codec import CodecError, decode
from p2pfl.wire.discovery import parse_service, protocol_note
from p2pfl.wire.envelope import KINDS, SIGNED_MAGIC, Envelope, VersionError
from p2pfl.wire.transfers import PreparedState
from p2pfl.wire.transport import Transport
from p2pfl.wire.versions import NEW_IN_4, PeerVersions, refusal, speaking, speaks, speaks_4

LIMIT = 1 << 20


def _envelope(v: int, sender: str = "b", kind: str = "gossip", body=None) -> Envelope:
    return Envelope("s", sender, 1, kind, uuid.uuid4().hex[:16], body or {"k": 1}, ts=1.0, v=v)


# ----------------------------------------------------------------------------- envelopes


def test_the_previous_version_decodes_and_keeps_its_version():
    assert MIN_PROTOCOL_VERSION == PROTOCOL_VERSION - 1
    older = Envelope.unpack(_envelope(PROTOCOL_VERSION - 1).pack(), LIMIT)
    assert older.v == PROTOCOL_VERSION - 1 and older.body == {"k": 1}
    # what this node sends stamps the version it speaks, signed frames included
    signed = _envelope(PROTOCOL_VERSION - 1).pack(lambda header: b"\x00" * 64)
    assert signed[:4] == SIGNED_MAGIC
    assert Envelope.unpack(signed, LIMIT).v == PROTOCOL_VERSION - 1
    assert decode(_envelope(PROTOCOL_VERSION).pack(), LIMIT)["v"] == PROTOCOL_VERSION


@pytest.mark.parametrize("v", [PROTOCOL_VERSION + 1, MIN_PROTOCOL_VERSION - 1, 0, 99])
def test_a_version_not_spoken_is_refused_naming_it_and_the_sender(v):
    with pytest.raises(VersionError) as err:
        Envelope.unpack(_envelope(v, sender="n7").pack(), LIMIT)
    assert err.value.version == v and err.value.sender == "n7"
    assert f"protocol version {v}" in str(err.value)
    assert f"{MIN_PROTOCOL_VERSION}–{PROTOCOL_VERSION}" in str(err.value)
    assert isinstance(err.value, CodecError)  # everything that catches CodecError drops it


@pytest.mark.parametrize("v", [None, "3", 3.0, True])
def test_a_version_that_is_not_an_int_is_refused(v):
    from p2pfl.wire.codec import encode

    header = {"v": v, "swarm": "s", "from": "b", "round": 0, "kind": "gossip", "id": "x"}
    with pytest.raises(VersionError):
        Envelope.unpack(encode(header), LIMIT)


# ----------------------------------------------------------------------------- the rule


def test_speaking_the_oldest_version_a_peer_online_runs():
    assert (MIN_PROTOCOL_VERSION, PROTOCOL_VERSION) == (3, 4)
    assert speaking([]) == PROTOCOL_VERSION
    assert speaking([4, 4]) == 4
    assert speaking([4, 3, 4]) == 3
    assert speaking([4, 2]) == 4  # a version it cannot speak is refused, not followed
    assert speaking([5, 4]) == 4  # a newer peer speaks this one
    assert speaks(3) and speaks(4) and not speaks(2) and not speaks(5)
    assert not speaks(True) and not speaks("4")
    # what protocol 4 added is sent unasked only while no protocol 3 peer is heard
    assert speaks_4(4) and not speaks_4(3)
    assert NEW_IN_4 == {"probe_req", "probe_ack", "roster_req", "roster"} <= KINDS


def test_refusal_names_both_versions_and_who_to_upgrade():
    newer = refusal("n0", "n5", PROTOCOL_VERSION + 1)
    assert "sends protocol 5" in newer and "runs protocol 4 (speaks 3–4)" in newer
    assert "upgrade n0" in newer and "Rolling upgrades" in newer
    older = refusal("n0", "n5", 2)
    assert "sends protocol 2" in older and "runs protocol 4 (speaks 3–4)" in older
    assert "upgrade 'n5'" in older and "speaks protocol 4" in older


def test_peer_versions_follow_presence_not_envelopes(caplog):
    pv = PeerVersions("n0")
    with caplog.at_level(logging.WARNING, "p2pfl.wire.transport"):
        assert not pv.presence("a", 4, {"status": "online", "protocol": 4})
        assert pv.presence("b", 3, {"status": "online", "protocol": 3}) and pv.speak == 3
        assert not pv.presence("b", 3, {"status": "online", "protocol": 3, "round": 4})
        # an upgraded node speaking 3 for b's sake still runs 4: it holds nobody back
        assert not pv.presence("c", 3, {"status": "online", "protocol": 4})
        assert pv.presence("b", 3, {"status": "offline", "protocol": 3}) and pv.speak == 4
        assert pv.presence("b", 3, {"status": "online"}) and pv.speak == 3  # v when unnamed
        assert pv.presence("b", 4, {"status": "online", "protocol": 4}) and pv.speak == 4
        pv.refused("z", 9)
        pv.refused("z", 9)
    told = [r.getMessage() for r in caplog.records]
    assert sum("peer 'b' runs protocol 3" in m for m in told) == 1  # once per peer
    assert sum("peer 'z' sends protocol 9" in m for m in told) == 1
    assert any("now speaks protocol 3" in m for m in told)
    assert any("whole announcements, no indirect probes" in m for m in told)


def test_a_peer_that_hears_an_older_one_makes_this_node_speak_it_one_hop_only():
    a = PeerVersions("a")  # hears old directly
    b = PeerVersions("b")  # hears only a
    assert a.presence("old", 3, {"status": "online", "protocol": 3})
    assert (a.speak, a.oldest) == (3, 3)
    assert b.presence("a", 3, {"status": "online", "protocol": 4, "oldest": a.oldest})
    assert (b.speak, b.oldest) == (3, PROTOCOL_VERSION)  # b announces no "oldest": no echo
    assert not a.presence("b", 3, {"status": "online", "protocol": 4})
    # old goes: a returns to 4 and says so (no "oldest"), and so does b
    assert a.presence("old", 3, {"status": "offline", "protocol": 3})
    assert (a.speak, a.oldest) == (PROTOCOL_VERSION, PROTOCOL_VERSION)
    assert b.presence("a", 3, {"status": "online", "protocol": 4})
    assert b.speak == PROTOCOL_VERSION
    # an "oldest" this build cannot speak is not followed
    assert not b.presence("c", 4, {"status": "online", "protocol": 4, "oldest": 2})


# ----------------------------------------------------------------------------- on a broker


WAIT_S = 20.0  # how long a condition may take to hold


@pytest.mark.integration
async def test_a_peer_of_the_previous_protocol_is_spoken_to_and_others_refused(broker, caplog):
    """``old``, ``ancient`` and ``future`` are raw MQTT clients that send envelopes of
    protocol 3 (the previous one), 2 (no longer spoken) and 5 (after this one)."""
    gossip: list[Envelope] = []
    heard_old: list[int] = []  # versions of new's presence as old would read them
    new = Transport("s", "new", broker.host, broker.port, connect_timeout=10)
    caplog.set_level(logging.WARNING, "p2pfl.wire.transport")
    async with new, aiomqtt.Client(broker.host, broker.port, identifier="old") as old:
        new.on_gossip = gossip.append
        assert new.speaks == PROTOCOL_VERSION and new.digest_name == "xxh3_128"
        await old.subscribe("p2pfl/s/presence/new", qos=1)
        presence = {"presence": {"status": "online", "protocol": 3}}
        await old.publish(
            "p2pfl/s/presence/old", _envelope(3, "old", "presence", presence).pack(), 1, retain=True
        )
        await wait_until(lambda: new.speaks == 3, WAIT_S)
        assert new.digest_name == "xxh3_128"  # protocol 3 knows XXH3: no digest to change

        async def read_presence() -> None:
            async for message in old.messages:
                env = decode(bytes(message.payload), LIMIT)
                heard_old.append(env["v"])
                if env["v"] == 3:
                    return

        await asyncio.wait_for(read_presence(), 20)  # new published it again, in protocol 3
        await old.publish("p2pfl/s/gossip/old", _envelope(3, "old", body={"x": 3}).pack(), 1)
        await wait_until(lambda: len(gossip) == 1, WAIT_S)
        assert gossip[0].v == 3 and gossip[0].body == {"x": 3}
        # a peer of a newer protocol and one of a protocol no longer spoken: refused,
        # counted, each said once
        for _ in range(3):
            future = _envelope(PROTOCOL_VERSION + 1, "future", body={"x": 5}).pack()
            await old.publish("p2pfl/s/gossip/future", future, 1)
            ancient = _envelope(2, "ancient", body={"x": 2}).pack()
            await old.publish("p2pfl/s/gossip/ancient", ancient, 1)
        await wait_until(lambda: new.dropped["protocol_version"] == 6, WAIT_S)
        assert len(gossip) == 1
        offline = {"presence": {"status": "offline", "protocol": 3}}
        await old.publish(
            "p2pfl/s/presence/old", _envelope(3, "old", "presence", offline).pack(), 1, retain=True
        )
        await wait_until(lambda: new.speaks == PROTOCOL_VERSION, WAIT_S)
    told = [r.getMessage() for r in caplog.records]
    refused = [m for m in told if "peer 'future' sends protocol" in m]
    assert len(refused) == 1 and "upgrade new" in refused[0], told
    assert "sends protocol 5" in refused[0] and "runs protocol 4 (speaks 3–4)" in refused[0]
    gone = [m for m in told if "peer 'ancient' sends protocol" in m]
    assert len(gone) == 1 and "upgrade 'ancient'" in gone[0], told
    assert "sends protocol 2" in gone[0] and "runs protocol 4 (speaks 3–4)" in gone[0]
    assert sum("peer 'old' runs protocol 3" in m for m in told) == 1
    assert new.inbound.versions.messages[3] >= 2


@pytest.mark.integration
@pytest.mark.one_broker
async def test_a_node_of_the_protocol_3_release_and_one_of_this_release_work_together(
    broker, tmp_path, caplog
):
    release = protocol_3_release(tmp_path / "release3")
    torch.manual_seed(3)
    ours = {"g.w": torch.randn(32, 32)}
    torch.manual_seed(2)
    theirs = {"g.w": torch.randn(32, 32)}
    caplog.set_level(logging.WARNING, "p2pfl.wire.transport")
    async with Transport("s", "new", broker.host, broker.port, connect_timeout=10) as new:

        async def serve(env: Envelope) -> None:  # as a node serves: the transport's digest
            prepared = PreparedState.from_state(ours, new.digest_name)
            await new.send_state(env.sender, env.id, env.round, prepared)

        new.on_request = serve
        gossip: list[Envelope] = []
        new.on_gossip = gossip.append
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(Path(__file__).with_name("protocol3_node.py")),
            broker.host, str(broker.port),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=release,
            env={**os.environ, "PYTHONPATH": str(release)},
        )  # fmt: skip
        assert proc.stdin is not None and proc.stdout is not None

        async def line() -> str:
            return (await asyncio.wait_for(proc.stdout.readline(), 60)).decode().strip()

        try:
            assert await line() == "runs 3"
            assert await line() == "heard new"  # new's presence, in protocol 3
            assert new.speaks == 3 and new.peers["old"]["protocol"] == 3
            await new.gossip(1, {"hello": PROTOCOL_VERSION})
            assert await line() == f'gossip {{"hello": {PROTOCOL_VERSION}}}'
            await wait_until(lambda: len(gossip) == 1, WAIT_S)
            assert gossip[0].body == {"hello": 3} and gossip[0].v == 3
            # old pulls new's state (XXH3-128, which protocol 3 knows); new pulls old's
            assert await line() == f"pulled {float(ours['g.w'].sum())}"
            got = await new.pull("old", 1, "all", timeout=20)
            assert torch.equal(got["g.w"], theirs["g.w"])
            dropped = json.loads((await line()).removeprefix("dropped "))
            # new's first presence, in protocol 4, was all that old dropped
            assert dropped.get("protocol_version", 0) <= 1 and set(dropped) <= {"protocol_version"}
            proc.stdin.write(b"\n")
            await proc.stdin.drain()
            await asyncio.wait_for(proc.wait(), 30)
            assert proc.returncode == 0
            await wait_until(lambda: new.speaks == PROTOCOL_VERSION, WAIT_S)  # old left: back to 4
            assert sum(new.dropped.values()) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    told = [r.getMessage() for r in caplog.records]
    assert sum("peer 'old' runs protocol 3" in m for m in told) == 1, told


# ----------------------------------------------------------------------------- discovery


def test_discovery_says_when_an_announced_node_runs_another_protocol():
    def node(proto: int):
        props = {b"role": b"node", b"node": b"n3", b"swarm": b"s", b"algorithm": b"fedavg",
                 b"proto": str(proto).encode()}  # fmt: skip
        return parse_service("n3", props, ["10.0.0.3"], 0)

    assert protocol_note(node(PROTOCOL_VERSION)) is None
    older = protocol_note(node(PROTOCOL_VERSION - 1))
    assert older is not None and f"runs protocol {PROTOCOL_VERSION - 1}" in older
    assert "spoken to" in older and "upgrade it" in older
    newer = protocol_note(node(PROTOCOL_VERSION + 1))
    assert newer is not None and "upgrade this device" in newer
    gone = protocol_note(node(MIN_PROTOCOL_VERSION - 1))
    assert gone is not None and "refused" in gone
    broker = {b"role": b"broker", b"swarm": b"*", b"proto": b"1"}
    assert protocol_note(parse_service("b", broker, ["10.0.0.2"], 1883)) is None
