"""The pure rules of partitions (docs/wire.md, "Partitions"): who a member can reach
(:mod:`p2pfl.rounds.rotation.reach`) and which model lineage a result follows
(:mod:`p2pfl.rounds.rotation.lineage`); and the transport's part: a direct-lane probe against a real
listener and the broker's bridge state."""

from __future__ import annotations

import asyncio
import random
import socket
import time

import pytest

from p2pfl.rounds.rotation.lineage import (
    ROOT,
    Lineage,
    check_lineage,
    fork_name,
    result_lineage,
    winner,
)
from p2pfl.rounds.rotation.plans import check_announcement
from p2pfl.rounds.rotation.reach import (
    MAX_HEALTH,
    OFFLINE,
    PROBE_TIMEOUT_S,
    SUSPECT_S,
    TARGET_RATE,
    UNREACHABLE,
    Reachability,
    check_probe_message,
    confirmed,
    suspicion_delay,
    verdict,
)
from p2pfl.wire import direct
from p2pfl.wire.transport import Transport

# ----------------------------------------------------------------------------- reachability


@pytest.mark.parametrize(
    "online, probe, answered, bridge_down, expected",
    [
        (False, True, True, False, OFFLINE),  # a Will fired: offline whatever the lane says
        (True, True, True, True, None),  # the lane answers: reachable, bridge or not
        (True, False, True, False, UNREACHABLE),  # answered before, silent now: cut off
        (True, False, False, False, None),  # never answered (NAT): served over MQTT
        (True, False, False, True, UNREACHABLE),  # never answered, and a bridge is down
        (True, None, False, True, None),  # no lane to probe: presence is all we know
        (True, None, True, False, None),
    ],
)
def test_verdict(online, probe, answered, bridge_down, expected):
    assert verdict(online, probe, answered, bridge_down) == expected


class _Peers:
    """Presence, probe answers and bridge state a test controls."""

    def __init__(self):
        self.online = {"a": True, "b": True}
        self.lane = {"a": True, "b": True}
        self.bridge = False
        self.changes = 0
        self.probed: list[str] = []
        self.timeouts: list[float] = []

    async def probe(self, peer: str, timeout: float) -> bool | None:
        self.probed.append(peer)
        self.timeouts.append(timeout)
        return self.lane[peer]

    def reach(self, node: str = "me", **kw) -> Reachability:
        return Reachability(
            node,
            online=lambda p: self.online.get(p, True),
            probe=self.probe,
            bridge_down=lambda: self.bridge,
            changed=self._changed,
            **kw,
        )

    def _changed(self) -> None:
        self.changes += 1


async def test_reachability_follows_probes_and_wakes_waits(monkeypatch):
    peers = _Peers()
    reach = peers.reach()
    assert reach.cut_off("me") is None
    await reach.refresh(["a"])
    assert reach.cut_off("a") is None and "a" in reach.answered
    peers.lane["a"] = False
    await reach.refresh(["a"])  # the probe is fresh: not repeated
    assert reach.cut_off("a") is None and peers.probed == ["a"]
    monkeypatch.setattr("p2pfl.rounds.rotation.reach.PROBE_TTL_S", 0.0)
    await reach.refresh(["a"])  # no helper to ask: its own failed probe confirms
    assert reach.cut_off("a") == UNREACHABLE
    assert peers.changes == 1 and reach.cut_lately("a") and reach.partition()
    peers.lane["a"] = True  # healed; in a partition, check probes at once
    assert await reach.check("a") is None and peers.changes == 2
    assert reach.cut_lately("a")  # cut off during this round: it may have missed something
    reach.begin_round()
    assert not reach.cut_lately("a")
    peers.online["b"] = False  # a Will: no probe needed
    n = len(peers.probed)
    assert await reach.check("b") == OFFLINE and len(peers.probed) == n


async def test_check_probes_only_in_a_partition():
    """Outside a partition the start of a wait costs the awaited peer nothing: no herd of
    connects lands on an aggregator as every member starts waiting on it."""
    peers = _Peers()
    peers.lane["a"] = False
    reach = peers.reach()
    assert await reach.check("a") is None and peers.probed == []
    peers.bridge = True  # a bridge is down: a partition, probe at once
    assert await reach.check("a") == UNREACHABLE and peers.probed == ["a"]


async def test_reachability_never_answered_counts_only_with_a_bridge_down(monkeypatch):
    monkeypatch.setattr("p2pfl.rounds.rotation.reach.PROBE_TTL_S", 0.0)
    peers = _Peers()
    peers.lane["b"] = False
    reach = peers.reach()
    await reach.refresh(["b"])
    assert reach.cut_off("b") is None  # behind NAT, say: MQTT still serves it
    peers.bridge = True
    assert await reach.check("b") == UNREACHABLE


async def test_a_sign_of_life_stands_for_a_probe(monkeypatch):
    monkeypatch.setattr("p2pfl.rounds.rotation.reach.PROBE_TTL_S", 0.0)
    peers = _Peers()
    reach = peers.reach()
    reach.alive("a")  # it sent this node a message, or pulled from it
    await reach.refresh(["a", "b"])
    assert peers.probed == ["b"]


async def test_watching_waits_for_suspicion_then_reprobes_until_left(monkeypatch):
    monkeypatch.setattr("p2pfl.rounds.rotation.reach.TICK_S", 0.01)
    monkeypatch.setattr("p2pfl.rounds.rotation.reach.PROBE_EVERY_S", 0.0)
    monkeypatch.setattr("p2pfl.rounds.rotation.reach.SUSPECT_S", 3600.0)
    peers = _Peers()
    reach = peers.reach()
    async with reach.watching(lambda: ["a"]):
        await asyncio.sleep(0.1)
    assert peers.probed == []  # not suspected yet: no probe
    monkeypatch.setattr("p2pfl.rounds.rotation.reach.SUSPECT_S", 0.0)
    async with reach.watching(lambda: ["a"]):
        while len(peers.probed) < 2:
            await asyncio.sleep(0.01)
    await reach.aclose()
    n = len(peers.probed)
    await asyncio.sleep(0.05)
    assert len(peers.probed) == n  # stopped


def test_suspicion_grows_with_the_swarm_and_spreads_its_probes():
    rng = random.Random(0)
    small = [suspicion_delay(4, 1.0, False, rng) for _ in range(200)]
    large = [suspicion_delay(1000, 1.0, False, rng) for _ in range(2000)]
    assert all(SUSPECT_S <= d <= SUSPECT_S + 0.1 for d in small)
    assert min(large) >= 3 * SUSPECT_S  # log10(1000)
    # 1,000 waiting members reach the awaited peer at about TARGET_RATE probes a second
    spread = max(large) - min(large)
    assert 0.9 * 1000 / TARGET_RATE <= spread <= 1000 / TARGET_RATE
    assert suspicion_delay(4, 1.0, True, rng) <= 0.1  # a partition: at once
    assert suspicion_delay(4, 4.0, False, rng) >= 4 * SUSPECT_S  # a slow prober waits longer


async def test_a_slow_prober_widens_its_timeouts(monkeypatch):
    monkeypatch.setattr("p2pfl.rounds.rotation.reach.PROBE_TTL_S", 0.0)
    peers = _Peers()
    reach = peers.reach()
    await reach.refresh(["a"])
    reach._note_lag(4.25, 0.25)  # its loop woke 4 s late
    assert reach.health() == MAX_HEALTH
    await reach.refresh(["a"])
    assert peers.timeouts == [PROBE_TIMEOUT_S, PROBE_TIMEOUT_S * MAX_HEALTH]


def _swarm(peers: _Peers, names: list[str]) -> dict[str, Reachability]:
    """Reachabilities that ask each other to probe (their inboxes, in process)."""
    nodes: dict[str, Reachability] = {}
    drops: list[str] = []

    async def ask_from(sender: str, to: str, kind: str, body: dict) -> None:
        if to in nodes:
            why = nodes[to].on_message(sender, kind, body)
            if why:
                drops.append(why)

    for name in names:
        nodes[name] = peers.reach(
            name,
            members=lambda: names,
            ask=lambda to, kind, body, me=name: ask_from(me, to, kind, body),
        )
    return nodes


async def test_a_suspicion_is_confirmed_through_other_members(monkeypatch):
    monkeypatch.setattr("p2pfl.rounds.rotation.reach.PROBE_TTL_S", 0.0)
    peers = _Peers()
    nodes = _swarm(peers, ["me", "a", "h1", "h2"])
    peers.lane.update({"h1": True, "h2": True})
    me = nodes["me"]
    me.answered.add("a")  # its lane answered this node before
    peers.lane["a"] = False  # nobody reaches it: confirmed
    await me.refresh(["a"])
    assert me.cut_off("a") == UNREACHABLE and me.suspected == 1 and me.refuted == 0
    assert peers.probed.count("a") == 3  # its own probe and the two helpers'
    for node in nodes.values():
        await node.aclose()


async def test_a_helper_that_reaches_the_suspect_refutes_it(monkeypatch):
    monkeypatch.setattr("p2pfl.rounds.rotation.reach.PROBE_TTL_S", 0.0)
    peers = _Peers()
    nodes = _swarm(peers, ["me", "a", "h1"])
    me = nodes["me"]
    me.answered.add("a")
    own = iter([False])  # this node's own connect times out (a busy peer); the helper's does not

    async def probe(peer: str, timeout: float) -> bool | None:
        peers.probed.append(peer)
        return next(own, True)

    me._probe = probe
    nodes["h1"]._probe = probe
    await me.refresh(["a"])
    assert me.cut_off("a") is None and me.suspected == 1 and me.refuted == 1
    for node in nodes.values():
        await node.aclose()


async def test_a_hostile_peer_cannot_force_a_failover_alone(monkeypatch):
    monkeypatch.setattr("p2pfl.rounds.rotation.reach.PROBE_TTL_S", 0.0)
    peers = _Peers()
    nodes = _swarm(peers, ["me", "a", "evil"])
    me = nodes["me"]
    me.answered.add("a")
    # unasked acks are dropped, whatever they claim
    assert me.on_message("evil", "probe_ack", {"peer": "a", "ok": False}) == "unasked"
    await me.refresh(["a"])  # its own probe answers: no helper is even asked
    assert me.cut_off("a") is None and me.suspected == 0
    # a helper that lies "not reached" is outweighed by one that reached it
    assert confirmed(UNREACHABLE, {"evil": False, "honest": True}) is False
    assert confirmed(None, {"evil": False}) is False  # its own probe is needed first
    assert confirmed(UNREACHABLE, {"h": False, "g": None}) is True
    for node in nodes.values():
        await node.aclose()


async def test_no_helper_is_asked_that_knows_no_probe_req(monkeypatch):
    """``may_ask`` (p2pfl.rounds.rotation.partition: protocol 4, docs/wire.md "Protocol
    versions"): a helper it refuses is never asked; refusing every one (a peer of protocol 3
    is heard), a failed own probe confirms the suspicion at once, as protocol 3 did."""
    monkeypatch.setattr("p2pfl.rounds.rotation.reach.PROBE_TTL_S", 0.0)
    peers = _Peers()
    peers.lane.update({"old": True, "h1": True, "a": False})
    asked: list[tuple[str, str]] = []

    async def ask(to: str, kind: str, body: dict) -> None:
        asked.append((to, kind))

    me = peers.reach(
        members=lambda: ["me", "a", "old", "h1"], ask=ask, may_ask=lambda p: p != "old"
    )
    me.answered.add("a")
    await me.refresh(["a"])  # h1 is asked and does not answer: confirmed all the same
    assert asked == [("h1", "probe_req")] and me.cut_off("a") == UNREACHABLE
    await me.aclose()
    asked.clear()
    me = peers.reach(members=lambda: ["me", "a", "old", "h1"], ask=ask, may_ask=lambda p: False)
    me.answered.add("a")
    await asyncio.wait_for(me.refresh(["a"]), 1.0)  # no wait for helpers
    assert asked == [] and me.cut_off("a") == UNREACHABLE and me.suspected == 1
    await me.aclose()


@pytest.mark.parametrize(
    "kind, body, error",
    [
        ("probe_req", {"peer": "a"}, None),
        ("probe_ack", {"peer": "a", "ok": True}, None),
        ("probe_ack", {"peer": "a", "ok": None}, None),
        ("probe_req", {"peer": "zz"}, "no member"),
        ("probe_req", {"peer": "a", "x": 1}, "map of"),
        ("probe_req", ["a"], "map of"),
        ("probe_ack", {"peer": "a"}, "map of"),
        ("probe_ack", {"peer": "a", "ok": "yes"}, "bool"),
        ("probe_req", {"peer": "a" * 65}, "no member"),
    ],
)
def test_probe_messages_are_checked(kind, body, error):
    if error is None:
        assert check_probe_message(kind, body, ["a", "b"])[0] == "a"
    else:
        with pytest.raises(ValueError, match=error):
            check_probe_message(kind, body, ["a", "b"])


async def test_requests_to_help_are_bounded(monkeypatch):
    peers = _Peers()
    nodes = _swarm(peers, ["me", "a", "b"])
    helper = nodes["b"]
    assert helper.on_message("me", "probe_req", {"peer": "a"}) is None
    assert helper.on_message("me", "probe_req", {"peer": "a"}) == "too soon"
    monkeypatch.setattr("p2pfl.rounds.rotation.reach.HELP_IN_FLIGHT", 0)
    assert helper.on_message("a", "probe_req", {"peer": "me"}) == "busy"
    assert helper.on_message("a", "probe_req", {"peer": "b"}) is None  # about itself: no probe
    await helper.aclose()


async def test_transport_probe_against_a_real_listener():
    server = await asyncio.start_server(lambda _r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    t = Transport("s", "me", "127.0.0.1", 1, direct_lane=direct.DirectLane())
    try:
        assert await t.probe("a", 1.0) is None  # no presence: no address
        t.peers["a"] = {"status": "online", "direct": f"127.0.0.1:{port}"}
        assert await t.probe("a", 1.0) is True
        server.close()
        await server.wait_closed()
        with socket.socket() as s:  # a port nobody listens on: refused at once
            s.bind(("127.0.0.1", 0))
            free = s.getsockname()[1]
        t.peers["a"]["direct"] = f"127.0.0.1:{free}"
        assert await t.probe("a", 1.0) is False
    finally:
        server.close()


def test_transport_bridge_state():
    t = Transport("s", "me", "127.0.0.1", 1)
    seen = []
    t.on_bridge = lambda name, up: seen.append((name, up))
    assert not t.bridge_down  # no bridge known: none is down
    t._mqtt_message("$SYS/broker/connection/br1/state", b"1")
    t._mqtt_message("$SYS/broker/connection/br1/state", b"1")  # no change: not told again
    assert not t.bridge_down and seen == [("br1", True)]
    t._mqtt_message("$SYS/broker/connection/br1/state", b"0")
    assert t.bridge_down and seen[-1] == ("br1", False)
    t._mqtt_message("$SYS/broker/connection/br1/state", b"junk")  # dropped, counted
    assert t.dropped["foreign_topic"] == 1 and t.bridge_down


# ----------------------------------------------------------------------------- lineages


def test_check_lineage():
    assert check_lineage("15.2.n5") == "15.2.n5"
    for bad in ("", "a b", "x" * 97, 7, None, "../etc", "n/1"):
        with pytest.raises(ValueError):
            check_lineage(bad)


def test_winner_most_followers_then_smallest_name():
    assert winner({"a": "L1", "b": "L1", "c": "L2"}) == "L1"
    assert winner({"a": "L2", "b": "L1"}) == "L1"  # a tie: the smallest name
    with pytest.raises(ValueError):
        winner({})


def never(_m: str) -> bool:
    return False


def test_result_keeps_its_lineage_when_nobody_is_cut_off():
    name, merged = result_lineage(ROOT, ["a", "b", "c"], {"b": ROOT, "c": ROOT}, never, 4, 0, "a")
    assert (name, merged) == (ROOT, [])


def test_result_forks_when_a_follower_is_cut_off():
    cut = {"c", "d"}
    name, merged = result_lineage(
        ROOT, ["a", "b", "c", "d"], {"b": ROOT}, lambda m: m in cut, 15, 2, "a"
    )
    assert name == fork_name(15, 2, "a") == "15.2.a" and merged == []
    # the next round on the same side: its followers are all reachable, the name stays
    name2, _ = result_lineage(name, ["a", "b"], {"b": name}, lambda m: m in cut, 16, 1, "b")
    assert name2 == name


def test_result_merges_into_the_lineage_most_reporters_followed():
    # b, c and d (L2) against the aggregator a (L1): L2 names the merged result
    name, merged = result_lineage("L1", ["a"], {"b": "L2", "c": "L2", "d": "L2"}, never, 30, 0, "a")
    assert (name, merged) == ("L2", ["L1"])
    # a and d (L2) against b and c (L1): a tie, the smallest name wins
    name, merged = result_lineage("L2", ["a"], {"b": "L1", "c": "L1", "d": "L2"}, never, 30, 0, "a")
    assert (name, merged) == ("L1", ["L2"])


def test_a_merged_result_does_not_fork_on_the_losing_side_cut_off():
    # the winner is another lineage than the aggregator's own: its own followers do not fork it
    name, _ = result_lineage(
        "L1", ["a", "x"], {"b": "L2", "c": "L2"}, lambda m: m == "x", 9, 0, "a"
    )
    assert name == "L2"


def test_members_adopt_what_they_apply():
    mine = Lineage()
    assert mine.name == ROOT
    mine.adopt({"lineage": "4.2.n2", "aggregated": ["n2", "n3"]})
    assert (mine.name, mine.followers) == ("4.2.n2", ["n2", "n3"])
    mine.adopt({"aggregated": ["n0"]})  # a peer without lineages: the name stays
    assert mine.name == "4.2.n2"


def test_announcement_lineage_is_checked():
    base = {"roster": ["a", "b"], "participants": ["a", "b"]}
    assert "lineage" not in check_announcement(base, {"a", "b"})
    assert check_announcement({**base, "lineage": "3.1.b"}, {"a", "b"})["lineage"] == "3.1.b"
    with pytest.raises(ValueError, match="lineage"):
        check_announcement({**base, "lineage": {"x": 1}}, {"a", "b"})


async def test_a_failed_probe_stops_counting_once_old(monkeypatch):
    monkeypatch.setattr("p2pfl.rounds.rotation.reach.PROBE_TTL_S", 0.0)
    peers = _Peers()
    reach = peers.reach()
    await reach.refresh(["a"])
    peers.lane["a"] = False
    await reach.refresh(["a"])
    assert reach.cut_off("a") == UNREACHABLE
    monkeypatch.setattr("p2pfl.rounds.rotation.reach.PROBE_KEPT_S", 0.0)
    await asyncio.sleep(0.01)
    assert reach.cut_off("a") is None  # the link may have healed: probe again to know


async def test_a_confirmed_peer_stays_cut_off_without_asking_again(monkeypatch):
    monkeypatch.setattr("p2pfl.rounds.rotation.reach.PROBE_TTL_S", 0.0)
    peers = _Peers()
    nodes = _swarm(peers, ["me", "a", "h1"])
    peers.lane["h1"] = True
    me = nodes["me"]
    me.answered.add("a")
    peers.lane["a"] = False
    await me.refresh(["a"])
    assert me.cut_off("a") == UNREACHABLE and peers.probed.count("a") == 2  # own + h1's
    monkeypatch.setattr("p2pfl.rounds.rotation.reach.PROBE_KEPT_S", 0.0)
    await asyncio.sleep(0.01)
    assert me.cut_off("a") is None  # lapsed: the wait's next probe renews it, alone
    monkeypatch.setattr("p2pfl.rounds.rotation.reach.PROBE_KEPT_S", 5.0)
    me._confirmed["a"] = time.monotonic()
    await me._suspect("a")
    assert me.cut_off("a") == UNREACHABLE and peers.probed.count("a") == 3 and me.suspected == 1
    for node in nodes.values():
        await node.aclose()
