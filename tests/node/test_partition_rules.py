"""The pure rules of partitions (docs/wire.md, "Partitions"): who a member can reach
(:mod:`p2pfl.rounds.rotation.reach`) and which model lineage a result follows
(:mod:`p2pfl.rounds.rotation.lineage`); and the transport's part: a direct-lane probe against a real
listener and the broker's bridge state."""

from __future__ import annotations

import asyncio
import socket

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
from p2pfl.rounds.rotation.reach import OFFLINE, UNREACHABLE, Reachability, verdict
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

    async def probe(self, peer: str, _timeout: float) -> bool | None:
        self.probed.append(peer)
        return self.lane[peer]

    def reach(self) -> Reachability:
        return Reachability(
            "me",
            online=lambda p: self.online[p],
            probe=self.probe,
            bridge_down=lambda: self.bridge,
            changed=self._changed,
        )

    def _changed(self) -> None:
        self.changes += 1


async def test_reachability_follows_probes_and_wakes_waits(monkeypatch):
    peers = _Peers()
    reach = peers.reach()
    assert reach.cut_off("me") is None
    assert await reach.check("a") is None and "a" in reach.answered
    peers.lane["a"] = False
    assert await reach.check("a") is None  # the probe is fresh: not repeated
    monkeypatch.setattr("p2pfl.rounds.rotation.reach.PROBE_TTL_S", 0.0)
    assert await reach.check("a") == UNREACHABLE
    assert peers.changes == 1 and reach.cut_lately("a")
    peers.lane["a"] = True  # healed
    assert await reach.check("a") is None and peers.changes == 2
    assert reach.cut_lately("a")  # cut off during this round: it may have missed something
    reach.begin_round()
    assert not reach.cut_lately("a")
    peers.online["b"] = False  # a Will: no probe needed
    n = len(peers.probed)
    assert await reach.check("b") == OFFLINE and len(peers.probed) == n


async def test_reachability_never_answered_counts_only_with_a_bridge_down(monkeypatch):
    monkeypatch.setattr("p2pfl.rounds.rotation.reach.PROBE_TTL_S", 0.0)
    peers = _Peers()
    peers.lane["b"] = False
    reach = peers.reach()
    assert await reach.check("b") is None  # behind NAT, say: MQTT still serves it
    peers.bridge = True
    assert reach.cut_off("b") == UNREACHABLE


async def test_watching_reprobes_until_left(monkeypatch):
    monkeypatch.setattr("p2pfl.rounds.rotation.reach.RECHECK_S", 0.01)
    monkeypatch.setattr("p2pfl.rounds.rotation.reach.PROBE_TTL_S", 0.0)
    peers = _Peers()
    reach = peers.reach()
    async with reach.watching(lambda: ["a"]):
        await asyncio.sleep(0.1)
    n = len(peers.probed)
    assert n >= 2
    await asyncio.sleep(0.05)
    assert len(peers.probed) == n  # stopped


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
    assert await reach.check("a") is None
    peers.lane["a"] = False
    assert await reach.check("a") == UNREACHABLE
    monkeypatch.setattr("p2pfl.rounds.rotation.reach.PROBE_KEPT_S", 0.0)
    await asyncio.sleep(0.01)
    assert reach.cut_off("a") is None  # the link may have healed: probe again to know
