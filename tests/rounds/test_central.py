"""The rotating-aggregator driver against a real Mosquitto: nodes run in this process so a
test can slow one aggregator down or start a member late, and read the nodes' state."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch
from services_helpers import offline_services

from p2pfl.check.load import load_topology
from p2pfl.learning.state import layout_mismatch
from p2pfl.node.daemon import Node, NodeOptions
from p2pfl.rounds.rotation.centralized import check_announcement
from p2pfl.rounds.rotation.election import succession

pytestmark = pytest.mark.integration


def _cfg(broker, ids, overrides=()):
    cfg = load_topology(
        "topologies/synthetic.yaml",
        [
            "algorithm.name=fedavg",
            "algorithm.params={}",
            "rounds=2",
            "dataset.synthetic_train=400",
            "dataset.synthetic_test=200",
            *overrides,
        ],
    )
    return cfg.model_copy(
        update={
            "nodes": [n for n in cfg.nodes if n.id in ids] if ids else cfg.nodes,
            "broker": cfg.broker.model_copy(update={"host": broker.host, "port": broker.port}),
        }
    )


async def test_slow_aggregator_is_taken_over_and_its_late_reply_ignored(broker, tmp_path):
    """Round 1's aggregator (``b`` = sorted(a, b, c)[1]) stalls inside its server rule past
    the clients' deadline: ``c`` (next in order) takes round 1 over as attempt 1. While still
    stalled, ``b`` announces attempt 0 — a late reply of a dead attempt, which every member
    drops — and then adopts attempt 1 itself. Every node applies round 1 exactly once."""
    cfg = _cfg(
        broker,
        ["a", "b", "c"],
        ["timing.round_timeout_s=2", "timing.aggregator_timeout_s=3", "timing.linger_s=10"],
    )
    nodes = {nid: Node(cfg, nid, NodeOptions(out_dir=tmp_path)) for nid in cfg.node_ids}
    slow = nodes["b"]
    loop = asyncio.get_running_loop()
    stale_sent = []
    late_body = {
        "roster": ["a", "b", "c"],
        "participants": ["a", "b", "c"],
        "server": {},
        "receivers": ["a", "b", "c"],
        "common": True,
        "aggregated": ["a", "b", "c"],
    }

    def stall_once(real):
        def aggregate(*args, **kwargs):
            if not stale_sent:  # runs in a worker thread, like every server rule
                deadline = time.monotonic() + 30
                while 1 not in slow.driver.rotation.announced.get(1, {}):  # c's attempt 1
                    assert time.monotonic() < deadline, "nobody took round 1 over"
                    time.sleep(0.05)
                stale_sent.append(slow.transport.stats.messages_sent)
                asyncio.run_coroutine_threadsafe(
                    slow.transport.gossip(1, late_body, kind="announce", attempt=0), loop
                ).result(10)
            return real(*args, **kwargs)

        return aggregate

    async def patcher():
        while slow.method is None:
            await asyncio.sleep(0.01)
        slow.method.aggregate = stall_once(slow.method.aggregate)

    results = await asyncio.wait_for(
        asyncio.gather(patcher(), *(n.run() for n in nodes.values())), 120
    )
    records = dict(zip(nodes, results[1:], strict=True))
    assert stale_sent, "the round-1 aggregator never ran its server rule"
    for nid, recs in records.items():
        assert [r["round"] for r in recs] == [1, 2], nid
        first = recs[0]
        assert first["aggregator"] == "c" and first["attempt"] == 1, (nid, first)
        assert first["received"] or nid == "c"
    # a gave up on b at its deadline (or saw c's attempt 1 first): b is all it failed over
    assert all(f["aggregator"] == "b" for f in records["a"][0]["failovers"])
    assert records["b"][0]["failovers"][0]["why"] == "superseded"
    for nid in ("a", "c"):
        dropped = nodes[nid].transport.dropped
        assert dropped["stale_attempt"] + dropped["stale_round"] >= 1, (nid, dropped)
    # round 2 follows the roster c announced: sorted(a, b, c)[2 % 3], first attempt
    assert {(r[1]["aggregator"], r[1]["attempt"]) for r in records.values()} == {("c", 0)}


async def test_late_member_catches_up_and_joins_the_next_round(broker, tmp_path):
    """``d`` starts after the swarm finished round 1: it hears the next announcement, pulls
    the global model from that aggregator, and trains from the round after."""
    cfg = _cfg(
        broker,
        ["a", "b", "c", "d"],
        [
            "rounds=10",  # slack: d needs a moment to load and connect
            "timing.round_timeout_s=3",
            "timing.startup_timeout_s=2",
            "timing.linger_s=3",
        ],
    )
    opts = NodeOptions(out_dir=tmp_path)
    early = [Node(cfg, nid, opts) for nid in ("a", "b", "c")]
    late = Node(cfg, "d", opts)
    tasks = [asyncio.create_task(n.run()) for n in early]

    async def start_late():
        while len(early[0].records) < 1:
            await asyncio.sleep(0.05)
        return await late.run()

    results = await asyncio.wait_for(asyncio.gather(*tasks, start_late()), 120)
    d_recs = results[-1]
    assert d_recs[0]["observer"] is True and d_recs[0]["round"] >= 2
    assert d_recs[0]["received"] is True  # FedAvg's global model, pulled from the aggregator
    assert d_recs[-1]["round"] == 10
    joined = [r for r in d_recs if r["participated"]]
    assert joined and joined[0]["round"] == d_recs[0]["round"] + 1
    a_last = results[0][-1]
    assert "d" in a_last["aggregated"] and "d" in a_last["roster"]


async def test_members_hear_only_the_presence_their_part_needs(broker, tmp_path):
    """Eight members, two rounds: a member that aggregates neither round 1 nor round 2
    only ever hears those aggregators' presence (the broker delivers it no other: a round
    costs O(N) presence deliveries, not N²), while round 1's aggregator heard every
    member's (it drew round 2's roster); every node still runs both rounds on one model."""
    ids = [f"n{i}" for i in range(8)]
    cfg = _cfg(
        broker,
        None,
        ["nodes=8", "rounds=2", "timing.round_timeout_s=20", "timing.linger_s=5"],
    )
    assert cfg.node_ids == ids
    nodes = {nid: Node(cfg, nid, NodeOptions(out_dir=tmp_path)) for nid in ids}
    results = await asyncio.wait_for(asyncio.gather(*(n.run() for n in nodes.values())), 120)
    assert all([r["round"] for r in recs] == [1, 2] for recs in results)
    assert all(r["attempt"] == 0 for recs in results for r in recs)
    heads = {1: succession(1, ids)[:1], 2: succession(2, ids)[:1]}
    wide = set(heads[1]) | set(heads[2])
    narrow = [nid for nid in ids if nid not in wide]
    assert len(narrow) == 6
    for nid in narrow:
        heard = set(nodes[nid].transport.peers)
        assert heard <= wide, (nid, heard)
        other = narrow[0] if nid != narrow[0] else narrow[-1]
        assert not nodes[nid].transport.hears_presence(other)
    assert set(nodes[heads[1][0]].transport.peers) == set(ids) - {heads[1][0]}
    finals = {nid: n.method.model_state() for nid, n in nodes.items()}
    for state in finals.values():  # FedAvg: every member applied round 2's global model
        assert all(torch.equal(state[k], finals[ids[0]][k]) for k in state)


def test_announcement_validation_rejects_bad_bodies():
    members = {"a", "b", "c"}
    ok = {"roster": ["a", "b"], "participants": ["a"], "server": {}, "receivers": ["a"]}
    assert check_announcement(ok, members)["roster"] == ["a", "b"]
    for bad in (
        None,
        {**ok, "roster": []},
        {**ok, "roster": ["a", "zz"]},
        {**ok, "participants": ["c"]},  # not in the roster
        {**ok, "server": [1]},
        {**ok, "common": "yes"},
        {**ok, "roster": "a"},
    ):
        with pytest.raises(ValueError):
            check_announcement(bad, members)


def test_layout_mismatch_checks_keys_shapes_and_dtypes():
    import torch

    t = {"w": torch.zeros(2, 3), "n": torch.zeros((), dtype=torch.long)}
    assert (
        layout_mismatch({"w": torch.ones(2, 3), "n": torch.ones((), dtype=torch.long)}, t) is None
    )
    assert layout_mismatch({"w": torch.ones(2, 3)}, t) is not None
    assert layout_mismatch({"w": torch.ones(3, 2), "n": t["n"]}, t) is not None
    assert layout_mismatch({"w": torch.ones(2, 3, dtype=torch.float64), "n": t["n"]}, t) is not None


def _driver(node_id="b", ids=("a", "b", "c")):
    """A driver over real node services: a real (unconnected) transport and a real FedAvg,
    for its handlers."""
    from p2pfl.rounds.rotation.centralized import CentralizedRounds

    cfg = _cfg(SimpleNamespace(host="127.0.0.1", port=1), list(ids))
    return CentralizedRounds(offline_services(cfg, node_id))


def _env(sender, kind, rnd, attempt, body):
    from p2pfl.wire.envelope import Envelope

    return Envelope("s", sender, rnd, kind, f"{sender}{kind}{rnd}{attempt}", body, attempt=attempt)


ANN = {"roster": ["a", "b", "c"], "participants": ["a", "b", "c"], "server": {}}


async def test_handlers_drop_stale_misdirected_and_forged_messages():
    d = _driver("b")
    dropped = d.services.exchange.transport.dropped
    d.rosters[3] = ["a", "b", "c"]  # round 3: attempt 0 → sorted[3 % 3] = a, attempt 1 → b
    d.current, d.applied = (3, 0), 2
    d.on_gossip(_env("c", "announce", 3, 0, ANN))  # c is not attempt 0's aggregator
    assert dropped["not_aggregator"] == 1 and 3 not in d.rotation.announced
    d.on_gossip(_env("a", "announce", 2, 0, ANN))  # round 2 is applied already
    assert dropped["stale_round"] == 1
    d.on_gossip(_env("a", "announce", 3, 0, {**ANN, "roster": ["zz"]}))
    assert dropped["malformed"] == 1
    d.on_gossip(_env("a", "announce", 3, 0, ANN))
    assert d.rotation.announced[3][0].sender == "a"
    d.current = (3, 1)  # this member moved on to attempt 1: attempt 0 is dead
    d.on_gossip(_env("a", "announce", 3, 0, ANN))
    assert dropped["stale_attempt"] == 1
    d.on_inbox(_env("a", "report", 3, 2, {"n": 5, "report": {}}))  # attempt 2 → c, not b
    assert dropped["misdirected_report"] == 1
    d.on_inbox(_env("a", "report", 3, 1, {"n": -1, "report": {}}))
    assert dropped["malformed"] == 2
    d.on_inbox(_env("zz", "report", 3, 1, {"n": 5, "report": {}}))  # not a member: ignored
    d.on_inbox(_env("a", "report", 3, 1, {"n": 5, "report": {}}))
    assert d.role._reports[(3, 1)] == {"a": {"n": 5, "report": {}}}


def test_envelope_carries_the_attempt():
    from p2pfl.wire.codec import CodecError, encode
    from p2pfl.wire.envelope import Envelope

    env = _env("a", "report", 3, 2, {"n": 1})
    back = Envelope.unpack(env.pack(), 1 << 20)
    assert (back.round, back.attempt, back.kind) == (3, 2, "report")
    from p2pfl import PROTOCOL_VERSION

    base = {"v": PROTOCOL_VERSION, "swarm": "s", "from": "a", "round": 1, "kind": "report"}
    base["id"] = "x"
    assert Envelope.unpack(encode({**base, "attempt": 1}), 1 << 20).attempt == 1
    for bad in (-1, True, "1", 1 << 20):
        with pytest.raises(CodecError):
            Envelope.unpack(encode({**base, "attempt": bad}), 1 << 20)


def test_the_record_s_fields_of_a_settled_round_keep_their_order():
    """The roles' typed results become the record's fields in one place, in the order the
    records have always had: how the round settled (``aggregated`` is the announcement's,
    the aggregator's own included), the aggregator's facts, the audit, then secure
    aggregation's facts."""
    from p2pfl.rounds.rotation.aggregator import AggregatorFacts
    from p2pfl.rounds.rotation.late import LateOffer
    from p2pfl.rounds.rotation.plans import RoundPlan
    from p2pfl.rounds.rotation.quorum_close import Closing
    from p2pfl.rounds.rotation.succession import Failover, Settled

    d = _driver("b")
    plan = RoundPlan(3, ["a", "b", "c"], ["a", "b"], {})
    facts = AggregatorFacts(
        {"c": "gone"}, 0.5, 0.25, 0.125, [], Closing(2, "quorum", 1.0), {"t": 1}, "x"
    )
    settled = Settled(
        3, "b", 1, ANN, None, [Failover(0, "a", "deadline")], aggregated=facts, audit={"v": 1}
    )
    fields = d._fields(plan, settled, True, ["a"], False, {"member": {}, "t": 1})
    assert list(fields) == [
        "participated", "aggregated", "observer", "received", "roster", "lineage",
        "aggregator", "attempt", "failovers", "upload_failed", "aggregate_s", "collect_s",
        "serve_s", "quorum", "secagg", "aggregate_error", "audit",
    ]  # fmt: skip
    assert fields["aggregated"] == ["a"] and fields["secagg"] == {"member": {}, "t": 1}
    assert fields["failovers"] == [{"attempt": 0, "aggregator": "a", "why": "deadline"}]
    assert fields["quorum"] == {"needed": 2, "closed_by": "quorum", "deadline_s": 1.0}
    offer = LateOffer(4, 3, 1, {}, "c")
    member = Settled(3, "a", 0, ANN, None, offered_late=offer, audit={"v": 1})
    fields = d._fields(plan, member, True, ["a"], True, {"member": {}})
    assert list(fields)[6:] == [
        "aggregator",
        "attempt",
        "failovers",
        "offered_late",
        "audit",
        "secagg",
    ]
    assert fields["offered_late"] == {"round": 4, "staleness": 1}
