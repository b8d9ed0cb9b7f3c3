"""mDNS discovery on loopback: brokers and nodes announced and browsed with python-zeroconf,
and untrusted announcements validated."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from p2pfl import PROTOCOL_VERSION
from p2pfl.wire.discovery import Announcer, Browser, discover, parse_service

LO = ["127.0.0.1"]


def _props(**kw):
    base = {
        b"role": b"node",
        b"node": b"n1",
        b"swarm": b"s",
        b"algorithm": b"uapdfl",
        b"proto": b"1",
    }
    base.update({k.encode(): v for k, v in kw.items()})
    return {k: v for k, v in base.items() if v is not None}


def test_parse_service_accepts_a_node_and_a_broker():
    s = parse_service("x", _props(), ["127.0.0.1"], 0)
    assert (s.role, s.node, s.swarm, s.algorithm, s.host, s.protocol) == (
        "node",
        "n1",
        "s",
        "uapdfl",
        "127.0.0.1",
        1,
    )
    b = parse_service("b", {b"role": b"broker", b"swarm": b"*", b"proto": b"1"}, ["10.0.0.2"], 1883)
    assert b.serves("anything") and not s.serves("s")


@pytest.mark.parametrize(
    "props, addresses, port",
    [
        (_props(role=b"server"), ["127.0.0.1"], 0),  # unknown role
        (_props(node=None), ["127.0.0.1"], 0),  # a node without an id
        (_props(node=b"a" * 65), ["127.0.0.1"], 0),  # too long
        (_props(swarm=b"s/../x"), ["127.0.0.1"], 0),  # odd characters
        (_props(swarm=b"\xff"), ["127.0.0.1"], 0),  # not ASCII
        (_props(proto=b"one"), ["127.0.0.1"], 0),  # not a version
        (_props(), ["fe80::1"], 0),  # no IPv4 address
        ({b"role": b"broker", b"swarm": b"s", b"proto": b"1"}, ["127.0.0.1"], 0),  # no port
    ],
)
def test_parse_service_rejects_malformed_announcements(props, addresses, port):
    with pytest.raises(ValueError):
        parse_service("x", props, addresses, port)


@pytest.mark.integration
async def test_broker_and_nodes_are_found_and_departures_seen():
    swarm = f"t{uuid.uuid4().hex[:8]}"
    events = []
    async with Browser(interfaces=LO, on_change=lambda s, up: events.append((s.node, up))) as br:
        async with Announcer.broker(swarm, "127.0.0.1", 18830, interfaces=LO):
            found = await br.wait_for_broker(swarm, timeout=15, probe=False)
            assert (found.host, found.port, found.protocol) == (
                "127.0.0.1",
                18830,
                PROTOCOL_VERSION,
            )
            async with Announcer.node("n1", swarm, "uapdfl", "127.0.0.1", interfaces=LO):
                for _ in range(150):
                    nodes = [
                        s for s in br.services.values() if s.swarm == swarm and s.role == "node"
                    ]
                    if nodes:
                        break
                    await asyncio.sleep(0.1)
                assert [(n.node, n.algorithm) for n in nodes] == [("n1", "uapdfl")]
            for _ in range(150):  # the goodbye packet removes it
                if ("n1", False) in events:
                    break
                await asyncio.sleep(0.1)
            assert ("n1", True) in events and ("n1", False) in events
        with pytest.raises(TimeoutError):
            await br.wait_for_broker(f"other{swarm}", timeout=0.5)


@pytest.mark.integration
async def test_a_broker_that_died_without_goodbye_is_passed_over(broker):
    """Two brokers announced for the swarm, the newer one dead (nothing listens on its
    port): the node gets the live one; with only the dead one it times out saying so."""
    from p2pfl.launch.broker import free_port

    swarm = f"t{uuid.uuid4().hex[:8]}"
    async with Browser(interfaces=LO) as br:
        async with Announcer.broker(swarm, "127.0.0.1", broker.port, interfaces=LO):
            async with Announcer.broker(swarm, "127.0.0.1", free_port(), interfaces=LO):
                for _ in range(150):
                    if sum(s.serves(swarm) for s in br.services.values()) == 2:
                        break
                    await asyncio.sleep(0.1)
                found = await br.wait_for_broker(swarm, timeout=10)
                assert found.port == broker.port
        for _ in range(150):  # both goodbyes seen
            if not any(s.serves(swarm) for s in br.services.values()):
                break
            await asyncio.sleep(0.1)
        dead = free_port()
        async with Announcer.broker(swarm, "127.0.0.1", dead, interfaces=LO):
            with pytest.raises(TimeoutError, match="unreachable"):
                await br.wait_for_broker(swarm, timeout=4)


@pytest.mark.integration
async def test_discover_lists_what_is_announced():
    swarm = f"t{uuid.uuid4().hex[:8]}"
    async with (
        Announcer.broker(swarm, "127.0.0.1", 18831, interfaces=LO),
        Announcer.node("a", swarm, "dispfl", "127.0.0.1", interfaces=LO),
    ):
        seen = await discover(3.0, interfaces=LO)
    mine = [s for s in seen if s.swarm == swarm]
    assert [(s.role, s.node) for s in mine] == [("broker", None), ("node", "a")]


@pytest.mark.integration
def test_cli_discover_prints_the_swarm(capsys, monkeypatch):
    from p2pfl.cli import main

    monkeypatch.setenv("COLUMNS", "200")
    swarm = f"t{uuid.uuid4().hex[:8]}"

    async def announce_while_listing():
        async with (
            Announcer.broker(swarm, "127.0.0.1", 18832, interfaces=LO),
            Announcer.node("solo", swarm, "local", "127.0.0.1", interfaces=LO),
        ):
            return await asyncio.to_thread(
                main, ["discover", "--seconds", "3", "--interface", "127.0.0.1"]
            )

    assert asyncio.run(announce_while_listing()) == 0
    out = capsys.readouterr().out
    assert swarm in out and "solo" in out and "127.0.0.1:18832" in out


@pytest.mark.integration
async def test_nodes_with_broker_mdns_find_the_announced_broker(broker, tmp_path, monkeypatch):
    from p2pfl.check.load import load_topology
    from p2pfl.node.daemon import NodeOptions, run_nodes

    monkeypatch.setenv("P2PFL_MDNS_INTERFACES", "127.0.0.1")
    swarm = f"t{uuid.uuid4().hex[:8]}"
    cfg = load_topology(
        "topologies/synthetic.yaml",
        [f"name={swarm}", "broker=mdns", "rounds=1", "timing.linger_s=2", "nodes=[a, b]"],
    )
    async with Announcer.broker(swarm, "127.0.0.1", broker.port):
        failed = await run_nodes(cfg, ["a", "b"], NodeOptions(out_dir=tmp_path / "run"))
    assert failed == 0
    config = (tmp_path / "run" / "config.yaml").read_text()
    assert f"127.0.0.1:{broker.port}" in config  # the run records the broker it found
    for nid in ("a", "b"):
        assert (tmp_path / "run" / "nodes" / f"{nid}.jsonl").read_text().count("\n") == 1


@pytest.mark.integration
async def test_cli_broker_runs_mosquitto_and_announces_it(tmp_path, monkeypatch):
    import os
    import signal
    import socket
    import subprocess
    import sys

    from p2pfl.wire.discovery import find_broker

    monkeypatch.setenv("P2PFL_MDNS_INTERFACES", "127.0.0.1")
    swarm = f"t{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PATH": os.environ.get("PATH", "") + ":/usr/sbin"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "p2pfl.cli", "broker", "--swarm", swarm, "--workdir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        found = await find_broker(swarm, timeout=30)
        with socket.create_connection((found.host, found.port), timeout=2):
            pass  # Mosquitto accepts connections where it was announced
        assert (tmp_path / "mosquitto.conf").exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, out
    assert f"announced for swarm {swarm}" in out and "broker stopped" in out
