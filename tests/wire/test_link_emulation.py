"""Emulated links (p2pfl.wire.emulation): the delay model on a virtual clock, the emulator on
the event loop, and a WAN link between transports on a real Mosquitto."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from p2pfl.config.emulation import PRESETS, LinkParams
from p2pfl.config.schema import TopologyConfig
from p2pfl.wire.emulation import MIN_RTO_S, PACKET_BYTES, EmulatedLink, LinkEmulator, link_rng


def _link(seed: int = 0, **params) -> EmulatedLink:
    return EmulatedLink(LinkParams(**params), np.random.default_rng(seed))


def _cfg(**network) -> TopologyConfig:
    return TopologyConfig(name="s", seed=7, nodes=["a", "b", "c"], network=network)


def test_the_same_seed_gives_the_same_delays_and_each_link_its_own():
    cfg = _cfg(default="lte")
    runs = []
    for _ in range(2):
        em = LinkEmulator.from_topology(cfg, "a")
        runs.append([em.links[p].schedule(t * 0.01, 50_000) for t in range(50) for p in "bc"])
    assert runs[0] == runs[1]
    b = LinkEmulator.from_topology(cfg, "a").links["b"]
    c = LinkEmulator.from_topology(cfg, "a").links["c"]
    assert [b.schedule(0, 10) for _ in range(5)] != [c.schedule(0, 10) for _ in range(5)]
    r1, r2 = link_rng(7, "a", "b"), link_rng(7, "b", "a")
    assert r1.random() != r2.random()  # each direction draws on its own


def test_latency_plus_a_jitter_draw_cut_at_zero():
    link = _link(latency_ms=50, jitter_ms=10)
    now, delays = 0.0, []
    for _ in range(2000):
        now += 1.0  # apart: no queueing, no FIFO hold-back
        delays.append(link.schedule(now, 100) - now)
    assert min(delays) >= 0.05 - 1e-9  # never before the latency
    assert sum(d == pytest.approx(0.05) for d in delays) > 800  # half the draws cut to 0
    # the mean of a normal draw cut at 0: sigma / sqrt(2 pi)
    assert np.mean(delays) == pytest.approx(0.05 + 0.01 / np.sqrt(2 * np.pi), rel=0.02)


def test_a_link_serialises_its_transfers():
    link = _link(latency_ms=10, bandwidth_mbps=8)  # 1 MB/s
    assert link.schedule(0.0, 1_000_000) == pytest.approx(1.01)
    assert link.schedule(0.0, 1_000_000) == pytest.approx(2.01)  # after the first one's bytes
    assert link.schedule(0.5, 500_000) == pytest.approx(2.51)
    assert link.schedule(9.0, 1_000_000) == pytest.approx(10.01)  # idle again


def test_each_lost_packet_costs_one_retransmission_timeout():
    nbytes = 100 * PACKET_BYTES
    for latency, rto in ((20, MIN_RTO_S), (150, 0.3)):
        link = _link(latency_ms=latency, loss=0.1)
        costs = []
        for i in range(500):
            now = i * 1000.0  # apart: each message on an idle link
            costs.append(link.schedule(now, nbytes) - now - latency / 1000)
        lost = np.array(costs) / rto
        assert np.allclose(lost, np.round(lost))  # whole timeouts
        assert np.mean(lost) == pytest.approx(100 * 0.1, rel=0.1)
    assert _link(loss=0.0).schedule(0.0, nbytes) == 0.0


def test_delivery_keeps_each_links_order():
    link = _link(latency_ms=1, jitter_ms=1000)  # draws far apart
    dues = [link.schedule(i * 0.001, 10) for i in range(500)]
    assert dues == sorted(dues)


def test_who_is_delayed_follows_the_topology():
    assert LinkEmulator.from_topology(_cfg(), "a") is None  # no network: no emulator
    em = LinkEmulator.from_topology(_cfg(links=[{"nodes": ["b"], "preset": "wan"}]), "a")
    assert em.delays("b") and not em.delays("c") and not em.delays("a")
    assert not em.delays("mallory")  # not a node of the topology
    wan, got = PRESETS["wan"], em.links["b"].params  # b's access link, in series with none
    assert (got.latency_ms, got.bandwidth_mbps) == (wan.latency_ms, wan.bandwidth_mbps)
    assert (got.jitter_ms, got.loss) == pytest.approx((wan.jitter_ms, wan.loss))
    kernel = _cfg(links=[{"nodes": ["b"], "preset": "wan"}], kernel=True)
    shaped = LinkEmulator.from_topology(kernel, "a").links["b"].params
    assert shaped.bandwidth_mbps is None and shaped.latency_ms == PRESETS["wan"].latency_ms


async def test_callbacks_run_in_order_once_due_and_close_drops_the_rest():
    em = LinkEmulator("a", {"b": LinkParams(latency_ms=40, jitter_ms=30)}, seed=1)
    loop = asyncio.get_running_loop()
    got: list[tuple[int, float]] = []
    t0 = loop.time()
    for i in range(20):
        em.deliver("b", 100, lambda i=i: got.append((i, loop.time())))
    waiter = asyncio.ensure_future(em.crossed("b", 100))
    await asyncio.wait_for(waiter, 5)
    assert [i for i, _ in got] == list(range(20))
    assert all(t - t0 >= 0.04 - 1e-3 for _, t in got)
    em.deliver("b", 100, lambda: got.append((99, 0.0)))
    pending = asyncio.ensure_future(em.crossed("b", 100))
    await asyncio.sleep(0)
    em.close()
    with pytest.raises(asyncio.CancelledError):
        await pending
    assert len(got) == 20
    await em.crossed("c", 100)  # not delayed: returns at once


# ----------------------------------------------------------------------------- on a broker

WAN = PRESETS["wan"]  # 100 ms, 20 Mbit/s


async def _until(pred, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@pytest.mark.integration
@pytest.mark.one_broker
async def test_a_wan_link_delays_gossip_and_pulls_on_both_lanes(broker):
    """b sits behind a WAN link: what a and c receive from b, and what b receives from
    them, crosses it (both lanes); a and c talk to each other without emulation."""
    from wire_helpers import serve_from

    from p2pfl.wire.direct import DirectLane
    from p2pfl.wire.transport import Transport

    cfg = _cfg(links=[{"nodes": ["b"], "preset": "wan"}])
    lanes = {"a": DirectLane(), "b": DirectLane(), "c": None}  # c pulls over MQTT
    t = {
        n: Transport(
            "s",
            n,
            broker.host,
            broker.port,
            direct_lane=lanes[n],
            links=LinkEmulator.from_topology(cfg, n),
        )
        for n in "abc"
    }
    state = {"g.w": torch.randn(300, 250)}  # 300 KB: 0.12 s at 20 Mbit/s
    nbytes = state["g.w"].numel() * 4
    handler = serve_from({1: state})
    t["b"].on_request = lambda env: handler(t["b"], env)
    heard: dict[str, float] = {}
    both = asyncio.Event()

    def on_gossip(env):
        heard[env.sender] = asyncio.get_running_loop().time()
        if len(heard) == 2:
            both.set()

    t["a"].on_gossip = on_gossip
    loop = asyncio.get_running_loop()
    try:
        for n in "abc":
            await t[n].__aenter__()
        await _until(lambda: "direct" in t["a"].peers.get("b", {}) and "b" in t["c"].peers)
        sent = loop.time()
        await t["b"].gossip(1, {"n": 1})
        await t["c"].gossip(1, {"n": 1})  # after b's, over no emulated link
        await asyncio.wait_for(both.wait(), 10)
        assert heard["b"] - sent >= WAN.latency_ms / 1000 - 1e-3
        assert heard["c"] < heard["b"]  # c's overtook b's: only b's crossed the WAN
        assert heard["b"] - sent < 5

        # a pull crosses the link twice (the request to b, the state back), plus the bytes
        floor = 2 * WAN.latency_ms / 1000 + nbytes * 8 / (WAN.bandwidth_mbps * 1e6)
        for puller, lane in (("a", "direct"), ("c", "mqtt")):
            start = loop.time()
            got = await t[puller].pull("b", 1, "all", timeout=30)
            took = loop.time() - start
            assert torch.equal(got["g.w"], state["g.w"])
            assert list(t[puller].pull_lanes)[-1] == ("b", lane)
            assert floor - 1e-3 <= took < floor + 10, (lane, took)
    finally:
        for n in "abc":
            await t[n].close()
