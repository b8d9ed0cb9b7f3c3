"""The centralized driver's partition handling, on its handlers (a real, unconnected
transport and a real FedAvg; docs/wire.md, "Partitions"): lineages in reports, announcing
again to a member that reported late, and the newest far-ahead announcement kept for a
member that falls behind."""

from __future__ import annotations

import asyncio

from services_helpers import offline_services

from p2pfl.background import background
from p2pfl.check.load import load_topology
from p2pfl.rounds.rotation.centralized import ROUNDS_KEPT, CentralizedRounds
from p2pfl.wire.envelope import Envelope

ANN = {"roster": ["a", "b", "c"], "participants": ["a", "b", "c"], "server": {}}


def _driver(node_id: str = "b") -> CentralizedRounds:
    cfg = load_topology(
        "topologies/synthetic.yaml",
        ["algorithm.name=fedavg", "algorithm.params={}", "rounds=20"],
    )
    cfg = cfg.model_copy(
        update={
            "nodes": [n for n in cfg.nodes if n.id in ("a", "b", "c")],
            "broker": cfg.broker.model_copy(update={"host": "127.0.0.1", "port": 1}),
        }
    )
    return CentralizedRounds(offline_services(cfg, node_id))


def _env(sender, kind, rnd, attempt, body, mid=""):
    return Envelope(
        "s", sender, rnd, kind, f"{sender}{kind}{rnd}{attempt}{mid}", body, attempt=attempt
    )


def test_reports_carry_a_checked_lineage():
    d = _driver("b")
    d.rosters[3] = ["a", "b", "c"]  # attempt 1 of round 3 → b
    d.current, d.applied = (3, 1), 2
    d.on_inbox(_env("a", "report", 3, 1, {"n": 5, "report": {}, "lineage": "2.1.c"}))
    assert d.role._reports[(3, 1)]["a"]["lineage"] == "2.1.c"
    d.on_inbox(_env("c", "report", 3, 1, {"n": 5, "report": {}, "lineage": "a b"}))
    assert (
        d.services.exchange.transport.dropped["malformed"] == 1
        and "c" not in d.role._reports[(3, 1)]
    )


async def test_a_report_to_an_announced_attempt_gets_the_announcement_again():
    d = _driver("b")
    sent = []

    async def gossip(round_no, body, kind, attempt):
        sent.append((round_no, attempt, kind, body))

    d.services.exchange.transport.gossip = gossip
    d.rosters[3] = ["a", "b", "c"]
    d.current, d.applied = (3, 1), 2
    d.on_inbox(_env("a", "report", 3, 1, {"n": 5, "report": {}}))
    await asyncio.sleep(0)
    assert sent == []  # not announced yet: an ordinary report
    d.role._announcements[(3, 1)] = {**ANN, "lineage": "0"}
    async with background(d.role.reannounce()):  # as the driver's run holds it
        d.on_inbox(_env("c", "report", 3, 1, {"n": 5, "report": {}}))
        d.on_inbox(_env("a", "report", 3, 1, {"n": 5, "report": {}}, mid="again"))
        await asyncio.sleep(0.01)
    assert [(r, a, k) for r, a, k, _ in sent] == [(3, 1, "announce")]  # once a second at most
    d.role.forget(3)
    assert (3, 1) not in d.role._announcements


def test_the_newest_far_announcement_is_kept_for_a_catch_up():
    d = _driver("b")
    d.current, d.applied = (4, 0), 3
    peers = d.services.exchange.transport.peers
    far = 4 + ROUNDS_KEPT + 1
    peers["a"] = {"status": "online", "round": far - 1}  # the swarm finished far - 1
    d.on_gossip(_env("a", "announce", far, 0, ANN))
    assert (
        d.services.exchange.transport.dropped["future_round"] == 1
        and far not in d.rotation.announced
    )
    newest = d.observer.newest
    assert newest is not None and (newest.round, newest.attempt, newest.sender) == (far, 0, "a")
    d.on_gossip(_env("c", "announce", far + 5, 0, ANN))  # beyond what presence reports: no
    assert d.observer.newest.round == far
    d.on_gossip(_env("c", "announce", far - 1, 0, ANN))  # older than the one kept: no
    assert d.observer.newest.round == far
    peers["a"]["round"] = far
    d.on_gossip(_env("c", "announce", far + 1, 2, {**ANN, "roster": ["zz"]}))  # malformed
    assert d.observer.newest.round == far
    d.on_gossip(_env("c", "announce", far + 1, 2, ANN))
    newest = d.observer.newest
    assert (newest.round, newest.attempt, newest.sender) == (far + 1, 2, "c")


def test_the_member_s_lineage_is_in_its_report_and_follows_what_it_applies():
    d = _driver("b")
    assert d.lineage.name == "0"
    d.lineage.adopt({"lineage": "7.2.c", "aggregated": ["b", "c"]})
    assert (d.lineage.name, d.lineage.followers) == ("7.2.c", ["b", "c"])
    assert d.role.lineage is d.lineage and d.role.reach is d.reach and d.audit.reach is d.reach


def test_a_member_without_a_direct_lane_is_never_cut_off_by_probes():
    d = _driver("b")
    d.services.exchange.transport.peers["a"] = {"status": "online"}  # no direct address announced
    assert asyncio.run(d.reach.check("a")) is None
    d.services.exchange.transport.peers["a"]["status"] = "offline"
    assert d.reach.cut_off("a") == "offline"
