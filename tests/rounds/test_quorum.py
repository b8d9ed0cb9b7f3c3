"""Semi-asynchronous rounds of the centralized methods (``timing.quorum``; docs/algorithms.md,
"Semi-asynchronous rounds"): the pure close and staleness rules, the staleness-weighted
combination (and its audit), the announcement's new fields, and a swarm of in-process nodes
over a real Mosquitto where one member is always late."""

from __future__ import annotations

import asyncio
import collections
import math
import time

import pytest
import torch
from services_helpers import offline_services

from p2pfl.algorithms.base import Upload
from p2pfl.algorithms.fedavg import fedavg_aggregate
from p2pfl.check.load import load_topology
from p2pfl.learning.state import weighted_mean
from p2pfl.node.daemon import Node, NodeOptions
from p2pfl.rounds.rotation.aggregator import AggregatorRole
from p2pfl.rounds.rotation.audit import recompute
from p2pfl.rounds.rotation.centralized import CentralizedRounds
from p2pfl.rounds.rotation.late import Counted
from p2pfl.rounds.rotation.plans import RoundPlan, check_announcement
from p2pfl.rounds.rotation.quorum import (
    MIN_DEADLINE_S,
    close_deadline,
    close_reason,
    quorum_count,
    staleness_weight,
)
from p2pfl.rounds.rotation.rotation import Heard
from p2pfl.services.training import LocalTraining

# ----------------------------------------------------------------------------- pure rules


def test_quorum_count_is_the_ceiling_of_q_times_the_live_uploaders():
    assert quorum_count(0.5, 4) == 2
    assert quorum_count(0.75, 4) == 3
    assert quorum_count(0.7, 10) == 7  # 0.7 · 10 is 7.000000000000001 in floats
    assert quorum_count(0.3, 10) == 3
    assert quorum_count(1.0, 3) == 3
    assert quorum_count(0.01, 3) == 1  # never 0 of a live uploader
    assert quorum_count(0.5, 0) == 0


def test_close_deadline_is_a_bounded_multiple_of_the_median_latency():
    assert close_deadline([], 60.0) == 60.0  # nothing seen yet: today's bound
    assert close_deadline([1.0, 2.0, 30.0], 60.0) == 4.0  # 2 · median, one outlier ignored
    assert close_deadline([0.01, 0.02], 60.0) == MIN_DEADLINE_S
    assert close_deadline([100.0], 60.0) == 60.0  # never past round_timeout_s
    assert close_deadline([math.nan, -1.0, 3.0], 60.0) == 6.0  # unusable values ignored


def test_close_reason_all_quorum_deadline_or_wait():
    live = ["a", "b", "c", "d"]
    assert close_reason(live, {"a", "b", "c", "d"}, 0.5, 0.0, 10.0) == "all"
    assert close_reason(live, {"a", "b"}, 0.5, 0.0, 10.0) == "quorum"
    assert close_reason(live, {"a", "b"}, 0.75, 0.0, 10.0) is None  # 3 needed
    assert close_reason(live, {"a", "b"}, 0.75, 10.0, 10.0) == "deadline"
    assert close_reason(live, {"a", "zz"}, 0.5, 0.0, 10.0) is None  # only live ones count
    assert close_reason([], set(), 0.5, 0.0, 10.0) == "all"


def test_staleness_weight_is_fedbuffs_polynomial_discount():
    assert staleness_weight(10, 0, 0.5) == 10 and isinstance(staleness_weight(10, 0, 0.5), int)
    assert staleness_weight(10, 1, 0.5) == pytest.approx(10 / math.sqrt(2))
    assert staleness_weight(12, 3, 1.0) == 3.0
    assert staleness_weight(10, 2, 0.0) == 10.0  # a = 0: stale and fresh alike


def _states():
    g = torch.Generator().manual_seed(0)
    return {
        p: {"g.w": torch.randn(3, 4, generator=g), "h.b": torch.randn(2, generator=g)}
        for p in ("a", "b", "c")
    }


def test_a_late_upload_is_combined_with_its_discounted_weight():
    """FedAvg of two fresh uploads and one counted 2 rounds late with a = 0.5: the weighted
    mean with weights n_a, n_b, n_c · 3^-0.5, to the bit, in float64."""
    states = _states()
    n = {"a": 30, "b": 10, "c": 20}
    w_c = staleness_weight(n["c"], 2, 0.5)
    uploads = {p: Upload(w_c if p == "c" else n[p], states[p], {}) for p in sorted(states)}
    got, total = fedavg_aggregate(uploads)
    want = weighted_mean([states[p] for p in "abc"], [30.0, 10.0, w_c])
    for k in want:
        assert torch.equal(got[k], want[k])
    assert total == int(30 + 10 + 20 / math.sqrt(3))
    # by hand: (30 s_a + 10 s_b + 20/√3 s_c) / (40 + 20/√3)
    by_hand = (30 * states["a"]["g.w"].double() + 10 * states["b"]["g.w"].double()) + (
        20 / math.sqrt(3)
    ) * states["c"]["g.w"].double()
    by_hand = (by_hand / (40 + 20 / math.sqrt(3))).float()
    assert torch.allclose(got["g.w"], by_hand, atol=1e-6)


def test_the_audit_recomputes_the_staleness_weights(make_method):
    """The announcement carries the raw claims and each late upload's staleness; the
    auditor's recomputation discounts them exactly as the aggregator did."""
    alg = make_method("fedavg", node_id="b")
    state = alg.model_state()
    g = torch.Generator().manual_seed(1)
    states = {
        p: {k: (v + 0.01 * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in state.items()}
        for p in ("a", "b", "c")
    }
    cfg = load_topology(
        "topologies/synthetic.yaml",
        ["algorithm.name=fedavg", "algorithm.params={}", "timing.quorum=0.5", "defence.rule=mean"],
    )
    a = cfg.timing.staleness_exponent
    claims = {"a": 30, "b": 10, "c": 20}
    uploads = {
        p: Upload(staleness_weight(claims[p], 1 if p == "a" else 0, a), states[p], {})
        for p in ("a", "b", "c")
    }
    served = alg.aggregate(uploads, {}, ["a", "b", "c"], 2)
    body = {"claims": claims, "reports": {}, "late": {"a": 1}, "aggregated": ["a", "b", "c"]}
    plan = RoundPlan(2, ["a", "b", "c"], ["a", "b", "c"], {})
    again = recompute(alg, cfg, "b", plan, states, body, states["b"])
    for k in served.common:
        assert torch.equal(served.common[k], again.common[k])
    wrong = recompute(alg, cfg, "b", plan, states, {**body, "late": {}}, states["b"])
    assert not all(torch.equal(served.common[k], wrong.common[k]) for k in served.common)


def test_announcement_fields_of_quorum_rounds_are_checked():
    members = {"a", "b", "c"}
    ok = {"roster": ["a", "b", "c"], "participants": ["a", "b"], "aggregated": ["a", "b"]}
    body = check_announcement(
        {**ok, "late": {"a": 1}, "closed_without": ["c"], "report_s": 0.25}, members
    )
    assert (body["late"], body["closed_without"], body["report_s"]) == ({"a": 1}, ["c"], 0.25)
    assert "late" not in check_announcement(ok, members)  # a round without quorum: as before
    for bad in (
        {"late": {"c": 1}},  # not aggregated
        {"late": {"a": 0}},
        {"late": {"a": True}},
        {"late": ["a"]},
        {"closed_without": ["zz"]},
        {"report_s": -1.0},
        {"report_s": math.inf},
        {"report_s": "1"},
    ):
        with pytest.raises(ValueError):
            check_announcement({**ok, **bad}, members)


# ----------------------------------------------------------------------------- the driver


def _driver(node_id="c", overrides=("timing.quorum=0.5",)):
    """A centralized driver over real node services (a real, unconnected transport and a
    real FedAvg), for its handlers and its bookkeeping."""
    cfg = load_topology(
        "topologies/synthetic.yaml", ["algorithm.name=fedavg", "algorithm.params={}", *overrides]
    )
    return CentralizedRounds(offline_services(cfg, node_id))


def _report(sender, rnd, body, attempt=0):
    from p2pfl.wire.envelope import Envelope

    return Envelope(
        "s", sender, rnd, "report", f"{sender}{rnd}{attempt}{body}", body, attempt=attempt
    )


def test_late_reports_are_checked_and_kept_apart_from_fresh_ones():
    d = _driver("c")  # round 2: attempt 0 → sorted(a, b, c, d)[2] = c
    d.rosters[2] = ["a", "b", "c", "d"]
    d.current, d.applied = (2, 0), 1
    dropped = d.services.exchange.transport.dropped
    role = d.role
    assert role.quorum.max_late == 2  # min(timing.max_staleness 4, ROUNDS_KEPT - 1)
    d.on_inbox(_report("a", 2, {"n": 5, "report": {}, "late": 1}))
    d.on_inbox(_report("a", 2, {"n": 6, "report": {}}))  # its fresh report: kept apart
    assert role.quorum.late_reports[(2, 0)]["a"] == {"n": 5, "report": {}, "trained": 1}
    assert role._reports[(2, 0)]["a"] == {"n": 6, "report": {}}
    for bad, reason in (
        ({"n": 5, "report": {}, "late": "1"}, "malformed"),
        ({"n": 5, "report": {}, "late": True}, "malformed"),
        ({"n": 5, "report": {}, "late": 2}, "stale_upload"),  # not earlier than round 2
        ({"n": 5, "report": {}, "late": -5}, "stale_upload"),  # further back than max_late
    ):
        before = dropped[reason]
        d.on_inbox(_report("b", 2, bad))
        assert dropped[reason] == before + 1, bad
    assert "b" not in role.quorum.late_reports[(2, 0)]
    # without a quorum a late report has no meaning: dropped, never counted
    plain = _driver("c", ())
    plain.rosters[2], plain.current, plain.applied = ["a", "b", "c", "d"], (2, 0), 1
    plain.on_inbox(_report("a", 2, {"n": 5, "report": {}, "late": 1}))
    assert (
        plain.services.exchange.transport.dropped["malformed"] == 1
        and not plain.role.quorum.late_reports
    )


def test_an_upload_is_counted_at_most_once():
    d = _driver("c")
    d.late.note(1, Counted(["a", "b", "c"], ["b", "c"], {}))  # a missed round 1's close
    d.late.note(2, Counted(["a", "b", "c"], ["a", "b", "c"], {"a": 1}))  # ... and counted in 2
    d.late.note(3, Counted(["a", "b", "c"], ["b", "c"], {}))
    assert d.late.counted_before("a", 1)  # counted late in round 2 already
    assert d.late.counted_before("b", 3)  # counted fresh in its own round
    assert not d.late.counted_before("a", 3)  # missed round 3: may count in round 4
    assert d.late.counted_before("d", 3)  # not a participant of round 3: has no such upload
    assert d.late.counted_before("a", 7)  # a round this node did not apply: cannot tell


async def test_a_late_upload_goes_to_the_round_after_the_newest_rightful_announcement():
    """``a`` missed round 1's close while the swarm already announced round 2: it offers its
    upload to round 3 (staleness 2, to round 3's first aggregator ``d``); an announcement of
    round 2 from a member that was not its aggregator does not move it on."""
    roster = ["a", "b", "c", "d"]
    body = {"roster": roster, "participants": roster, "server": {}}
    own = {"n": 7, "report": {}}
    sent = []

    def driver():
        d = _driver("a")

        async def send(peer, kind, rnd, msg, attempt=0):
            sent.append((peer, kind, rnd, attempt, msg))

        d.services.exchange.transport.send = send
        return d

    d = driver()
    d.rotation.announced = {1: {0: Heard(1, 0, "b", body)}, 2: {0: Heard(2, 0, "c", body)}}
    assert (await d.member.offer_late(1, body, own)).record() == {"round": 3, "staleness": 2}
    offer = {"n": 7, "report": {}, "late": 1}
    assert d.late.offers[3] == offer and sent == [("d", "report", 3, 0, offer)]
    assert d.rosters[3] == roster and d.rotation.aggregator(3, 0) == "d"
    d = driver()
    # b is not round 2's aggregator
    d.rotation.announced = {1: {0: Heard(1, 0, "b", body)}, 2: {0: Heard(2, 0, "b", body)}}
    assert (await d.member.offer_late(1, body, own)).record() == {"round": 2, "staleness": 1}
    assert sent[-1][:3] == ("c", "report", 2)
    d = driver()
    d.rotation.announced = {3: {0: Heard(3, 0, "d", body)}}  # the last round (rounds: 3)
    assert await d.member.offer_late(3, body, own) is None and not d.late.offers
    assert len(sent) == 2


async def test_the_aggregator_closes_at_its_quorum_or_at_the_adapted_deadline(monkeypatch):
    """Attempt 0 of round 2 at ``c`` (quorum 0.5 of the live expected uploaders a, b, d
    and c itself: 2 of 4): with one report in besides its own upload it closes at once; with
    none, at the deadline the announced latencies give (2 · median 0.2 s → the 1 s floor),
    long before ``round_timeout_s``."""
    import p2pfl.rounds.rotation.quorum_close as quorum_close_module

    monkeypatch.setattr(quorum_close_module, "waits_on", lambda _svc, _p, _r: True)  # all live
    d = _driver("c")
    role, expected = d.role, ["a", "b", "d"]
    plan = RoundPlan(2, ["a", "b", "c", "d"], ["a", "b", "c", "d"], {})
    role.keep_upload(2, d.alg.upload())
    own = {"n": 10, "report": {}}
    role.round_started(2)
    d.on_inbox(_report("a", 2, {"n": 5, "report": {}}))  # roster unknown yet: kept

    def got(attempt):
        return lambda: role._reports.get((2, attempt), {})

    closing = await role.quorum.close(
        plan, 0, own is not None, lambda: False, time.monotonic(), expected, got(0)
    )
    assert closing.record() == {"needed": 2, "closed_by": "quorum", "deadline_s": 20.0}
    role.quorum.latencies.extend([0.2, 0.1, 0.3])
    t0 = time.monotonic()
    closing = await role.quorum.close(plan, 1, False, lambda: False, t0, expected, got(1))
    waited = time.monotonic() - t0
    assert closing.record() == {"needed": 2, "closed_by": "deadline", "deadline_s": 1.0}
    assert 0.5 <= waited < 10, waited  # measured from the round's start, 1 s after it


# ----------------------------------------------------------------------------- the swarm


def _signed(cfg, tmp_path):
    """``cfg`` with signed messages (and so the audit), certificates made for it."""
    from p2pfl.security.certs import make_swarm_certs

    make_swarm_certs(tmp_path / "certs", cfg.name, cfg.node_ids)
    security = cfg.security.model_copy(update={"sign": True, "certs": str(tmp_path / "certs")})
    return cfg.model_copy(update={"security": security})


def _cfg(broker, overrides=()):
    cfg = load_topology(
        "topologies/synthetic.yaml",
        [
            "algorithm.name=fedavg",
            "algorithm.params={}",
            "rounds=3",
            "dataset.synthetic_train=400",
            "dataset.synthetic_test=200",
            "timing.round_timeout_s=20",
            "timing.linger_s=5",
            "timing.quorum=0.75",
            "defence.rule=mean",
            *overrides,
        ],
    )
    return cfg.model_copy(
        update={"broker": cfg.broker.model_copy(update={"host": broker.host, "port": broker.port})}
    )


@pytest.mark.integration
@pytest.mark.one_broker
@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "audited"])
async def test_a_late_member_is_not_waited_for_and_its_upload_counts_next_round(
    broker, tmp_path, monkeypatch, signed
):
    """Quorum 0.75 of four members: ``a`` (never an aggregator in 3 rounds: rounds 1-3 go to
    b, c, d) finishes each round's training only once that round was announced, so its
    upload always misses the close. Every round closes at its quorum (3 of 4) without
    waiting for it; ``a`` offers each missed upload to the next round, whose aggregator
    counts it with staleness 1 and weight ``n_a · 2^-0.5``; ``a`` itself never stalls: it
    applies every round's result and records every round. Signed, every round is audited:
    the auditor pulls the late upload (part ``late``), recomputes with its staleness
    weight and finds the aggregate honest."""
    cfg = _cfg(broker)
    if signed:
        cfg = _signed(cfg, tmp_path)
    nodes = {nid: Node(cfg, nid, NodeOptions(out_dir=tmp_path)) for nid in cfg.node_ids}
    late_heard: dict[int, asyncio.Event] = collections.defaultdict(asyncio.Event)
    real_train, real_collect = LocalTraining.train, AggregatorRole.collect

    async def train(self, round_no):
        if self.id == "a":  # trains only after its round closed without it
            driver = nodes["a"].driver
            assert await nodes["a"].services.peers.wait_for(
                lambda: round_no in driver.rotation.announced, time.monotonic() + 60
            ), f"round {round_no} never closed without a"
        elif round_no >= 2:  # the others go on once a's late offer reached the aggregator
            await asyncio.wait_for(late_heard[round_no].wait(), 60)
        return await real_train(self, round_no)

    def collect(self, env):
        kept = real_collect(self, env)
        if kept and isinstance(env.body, dict) and "late" in env.body:
            late_heard[env.round].set()
        return kept

    monkeypatch.setattr(LocalTraining, "train", train)
    monkeypatch.setattr(AggregatorRole, "collect", collect)
    results = await asyncio.wait_for(asyncio.gather(*(n.run() for n in nodes.values())), 150)
    records = dict(zip(nodes, results, strict=True))
    assert all([r["round"] for r in rs] == [1, 2, 3] for rs in records.values())
    n = {nid: len(node.data.train_y) for nid, node in nodes.items()}
    a_weight = staleness_weight(n["a"], 1, cfg.timing.staleness_exponent)
    for r, agg_id in ((1, "b"), (2, "c"), (3, "d")):
        recs = {nid: rs[r - 1] for nid, rs in records.items()}
        agg = recs[agg_id]
        assert agg["aggregator"] == agg_id and agg["attempt"] == 0
        # closed at the quorum, long before round_timeout_s, without a's fresh upload
        assert agg["quorum"]["closed_by"] == "quorum" and agg["quorum"]["needed"] == 3
        assert agg["collect_s"] < cfg.timing.round_timeout_s / 2
        late = {} if r == 1 else {"a": 1}  # round r counts a's upload of round r - 1
        for nid, rec in recs.items():
            assert rec["closed_without"] == ["a"], (nid, r)
            assert rec["late"] == late, (nid, r)
            assert rec["aggregated"] == sorted({"b", "c", "d", *late}), (nid, r)
        want_n = int(sum(n[p] for p in "bcd") + (a_weight if late else 0))
        assert agg["method"]["agg_aggregated_n"] == want_n
        # a did not stall: it got the round's model and evaluated it
        assert recs["a"]["participated"] and recs["a"]["received"] is True
        offered = recs["a"].get("offered_late")
        assert offered == ({"round": r + 1, "staleness": 1} if r < 3 else None)
        if signed:
            for nid, rec in recs.items():
                assert rec["audit"]["verdict"] == "ok", (nid, rec["audit"])
                assert "own_entry" not in rec["audit"], (nid, rec["audit"])
            assert all(rec["failovers"] == [] for rec in recs.values())
