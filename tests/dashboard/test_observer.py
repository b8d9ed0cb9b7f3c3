"""The dashboard's broker observer (p2pfl/dashboard/observer.py) against a real Mosquitto:
a node's presence and status telemetry as they change, garbage dropped, an unreachable
broker, and the phases and pulls of a real (small, synthetic) swarm."""

from __future__ import annotations

import aiomqtt
import pytest
from waiting import wait_until

from p2pfl.background import background
from p2pfl.check.load import load_topology
from p2pfl.config.schema import dump_topology
from p2pfl.dashboard.live import LiveState
from p2pfl.dashboard.observer import observe
from p2pfl.dashboard.runstate import RunState
from p2pfl.dashboard.snapshot import build_snapshot
from p2pfl.launch.swarm import spawn_worker, stop_workers
from p2pfl.wire.envelope import Envelope
from p2pfl.wire.status import PHASES, phase_body, pull_body
from p2pfl.wire.transport import Transport

pytestmark = pytest.mark.integration


def observing(live: LiveState, host: str, port: int):
    """The observer of ``live`` on ``host:port`` for the span of an ``async with``."""
    return background(observe(live, host, port))


async def test_observer_follows_presence_and_status_and_drops_garbage(broker):
    live = LiveState("s", ["a", "b"])
    async with observing(live, broker.host, broker.port):
        await wait_until(lambda: live.connected, 10, "the observer to connect")
        async with Transport("s", "a", broker.host, broker.port, presence={"node": "a"}) as t:
            await wait_until(lambda: "a" in live.presence, 10, "a's presence")
            assert live.presence["a"].status == "online"
            sent = t.stats.bytes_sent
            for phase in ("training", "waiting"):
                await t.publish_status(1, phase_body(phase))
                await wait_until(
                    lambda p=phase: live.phases.get("a") and live.phases["a"].phase == p,
                    10,
                    f"phase {phase}",
                )
            await t.publish_status(1, pull_body("b", "g", 4096))
            await wait_until(lambda: live.pulls, 10, "the pull event")
            assert (live.pulls[0].src, live.pulls[0].dst, live.pulls[0].nbytes) == ("b", "a", 4096)
            assert t.stats.bytes_sent == sent  # telemetry is not counted in the records
            async with aiomqtt.Client(broker.host, broker.port) as raw:
                await raw.publish("p2pfl/s/status/a", b"\x93junk")
                await raw.publish(
                    "p2pfl/s/status/b", Envelope("s", "a", 1, "status", "x", {}).pack()
                )
                await raw.publish("p2pfl/s/status/zz", b"whatever")
            await wait_until(lambda: sum(live.dropped.values()) == 3, 10, "three drops")
            assert live.dropped == {"malformed": 1, "sender_mismatch": 1, "unknown_node": 1}
            await t.set_status("done", round=3)
            await wait_until(lambda: live.presence["a"].status == "done", 10, "done")
        await wait_until(lambda: live.presence["a"].status == "offline", 10, "offline")


async def test_an_unreachable_broker_is_reported_and_retried(tmp_path):
    live = LiveState("s", ["a"])
    async with observing(live, "127.0.0.1", 1):
        await wait_until(lambda: "unreachable" in live.note, 10, "the note")
        assert not live.connected


async def test_observer_sees_a_real_swarm_through_its_phases(tmp_path, broker):
    """Four UA-PDFL nodes (one process, synthetic data, two rounds): the observer sees
    every node train, wait, aggregate and evaluate, the pulls between neighbours, and the
    snapshot ends with every node done."""
    cfg = load_topology(
        "topologies/synthetic.yaml", ["rounds=2", "timing.linger_s=2", f"broker={broker.address}"]
    )
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(dump_topology(cfg))
    live = LiveState(cfg.name, cfg.node_ids)
    seen: dict[str, set[str]] = {nid: set() for nid in cfg.node_ids}
    handle = live.handle

    def record(topic, payload):  # every phase each node went through, however brief
        reason = handle(topic, payload)
        for nid, phase in live.phases.items():
            seen[nid].add(phase.phase)
        return reason

    live.handle = record
    async with observing(live, broker.host, broker.port):
        await wait_until(lambda: live.connected, 10, "the observer to connect")
        worker = spawn_worker(run / "config.yaml", cfg.node_ids, broker.address, run, False)
        try:
            await wait_until(lambda: worker.proc.poll() is not None, 50, "the nodes to finish")
            await wait_until(
                lambda: (
                    len(live.presence) == 4
                    and all(p.status != "online" for p in live.presence.values())
                ),
                10,
                "every node's last presence",
            )
        finally:
            stop_workers([worker])
        assert worker.proc.returncode == 0, worker.log_path.read_text()[-2000:]
    for nid in cfg.node_ids:
        assert seen[nid] == set(PHASES), nid
    edges = {frozenset(e) for e in [("a", "b"), ("b", "c"), ("c", "d"), ("a", "d")]}
    assert live.pulls and all(frozenset((p.src, p.dst)) in edges for p in live.pulls)
    assert {p.dst for p in live.pulls} == set(cfg.node_ids)
    assert not live.dropped
    state = RunState(run)
    state.refresh()
    snap = build_snapshot(state, live, broker=broker.address)
    assert [n["state"] for n in snap["nodes"]] == ["done"] * 4
    assert [len(snap["series"]["acc"]["nodes"][n]) for n in cfg.node_ids] == [2] * 4
