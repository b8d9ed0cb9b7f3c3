"""A pull whose peer is found cut off while it runs is abandoned then, not after its
timeout (docs/wire.md, "Partitions"): ``Exchange.pull_many(abandon=)`` and the aggregator's
upload pulls, on the services' handlers with a real, unconnected transport whose transfers
stand for a live link (it answers) and a link that went silent (nothing ever comes back)."""

from __future__ import annotations

import asyncio
import time

import pytest
from services_helpers import offline_services

from p2pfl.check.load import load_topology
from p2pfl.rounds.rotation.centralized import CentralizedRounds
from p2pfl.rounds.rotation.partition import abandon_when_cut
from p2pfl.services.bundle import NodeServices
from p2pfl.services.exchange import unless_abandoned
from p2pfl.wire.errors import TransportError

TIMEOUT_S = 60.0  # what a silent link would cost: the tests never wait this long


def _links(svc: NodeServices) -> tuple[dict[str, asyncio.Event], list[str]]:
    """Make ``c``'s link live and every other peer's silent; returns when each pull
    started, and the pulls that were cancelled."""
    reference = svc.method.model_state()
    started = {p: asyncio.Event() for p in ("a", "b", "c", "d")}
    cancelled: list[str] = []

    async def pull(peer, round_no, part, timeout, *, attempt=0, max_bytes=None):
        started[peer].set()
        if peer == "c":
            return dict(reference)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(peer)
            raise

    svc.exchange.transport.pull = pull
    return started, cancelled


async def test_pull_many_abandons_a_pull_once_its_wait_ends():
    svc = offline_services(load_topology("topologies/synthetic.yaml"))
    started, cancelled = _links(svc)
    cut = asyncio.Event()

    async def abandon(peer: str) -> str:
        if peer != "b":
            await asyncio.Event().wait()  # never: c's pull runs its course
        await cut.wait()
        return "b is cut off (unreachable)"

    t0 = time.monotonic()
    pulls = asyncio.ensure_future(
        svc.exchange.pull_many({"b": "model", "c": "model"}, 1, TIMEOUT_S, abandon=abandon)
    )
    await asyncio.wait_for(started["b"].wait(), TIMEOUT_S / 2)
    cut.set()
    pulled, failed = await asyncio.wait_for(pulls, TIMEOUT_S / 2)
    assert sorted(pulled) == ["c"]
    assert failed == {"b": "pull from b abandoned: b is cut off (unreachable)"}
    assert cancelled == ["b"]  # the transfer itself was stopped, not left running
    assert time.monotonic() - t0 < TIMEOUT_S / 2


async def test_a_pull_not_abandoned_gives_what_its_transfer_gives():
    never = asyncio.Event()

    async def arrives() -> dict:
        return {"w": 1}

    async def fails() -> dict:
        raise TransportError("pull of 'model' from b timed out after 0.1 s")

    async def stop() -> str:
        await never.wait()
        return "never"

    assert await unless_abandoned("c", arrives(), stop()) == {"w": 1}
    assert await unless_abandoned("c", arrives(), None) == {"w": 1}
    with pytest.raises(TransportError, match="timed out"):
        await unless_abandoned("b", fails(), stop())


def _driver(node_id: str = "b") -> CentralizedRounds:
    cfg = load_topology(
        "topologies/synthetic.yaml", ["algorithm.name=fedavg", "algorithm.params={}"]
    )
    cfg = cfg.model_copy(
        update={
            "nodes": [n for n in cfg.nodes if n.id in ("a", "b", "c", "d")],
            "broker": cfg.broker.model_copy(update={"host": "127.0.0.1", "port": 1}),
        }
    )
    return CentralizedRounds(offline_services(cfg, node_id))


async def test_an_aggregator_abandons_the_upload_of_a_member_that_goes_offline():
    """The aggregator's wait (``abandon_when_cut``) follows its view of who can be
    reached: a member whose presence turns offline mid-pull is given up at the next notify;
    a member still reachable is waited on, and each leaves ``running`` once settled."""
    d = _driver("b")
    svc = d.services
    started, cancelled = _links(svc)
    peers = svc.exchange.transport.peers
    for p in ("a", "c"):
        peers[p] = {"status": "online"}
    running = {"a", "c"}
    pulls = asyncio.ensure_future(
        svc.exchange.pull_many(
            {"a": "upload", "c": "upload"},
            1,
            TIMEOUT_S,
            abandon=abandon_when_cut(svc, d.reach, running),
        )
    )
    await asyncio.wait_for(started["a"].wait(), TIMEOUT_S / 2)
    await asyncio.sleep(0.05)  # a notify with nothing changed keeps a's pull going
    svc.peers.notify()
    await asyncio.sleep(0.05)
    assert not pulls.done() and running == {"a"}
    peers["a"] = {"status": "offline"}  # its Last Will
    svc.peers.notify()
    pulled, failed = await asyncio.wait_for(pulls, TIMEOUT_S / 2)
    assert sorted(pulled) == ["c"]
    assert failed == {"a": "pull from a abandoned: a is cut off (offline)"}
    assert cancelled == ["a"] and running == set()
