"""One bad peer on a real swarm (node processes, a real broker on loopback, synthetic data):
its hostile states are refused by admission or the defence with the peer named in the
records and the log, honest nodes stay finite, and a malicious aggregator's result makes
the round fail over to the next peer."""

from __future__ import annotations

import math

import pytest
from swarm_helpers import check_run_dir

from p2pfl.check.load import load_topology
from p2pfl.launch.swarm import run_swarm

pytestmark = pytest.mark.integration


def run(tmp_path, overrides: list[str], rounds: int = 3):
    cfg = load_topology(
        "topologies/synthetic.yaml",
        ["edges=full", f"rounds={rounds}", "timing.linger_s=5", *overrides],
    )
    code, summary = run_swarm(cfg, tmp_path / "run", nodes_per_process=4, progress=False)
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("*.log"))
    assert code == 0, logs[-3000:]
    assert "Traceback" not in logs
    return check_run_dir(tmp_path / "run", cfg.node_ids, rounds), logs


@pytest.mark.parametrize(
    ("method", "attack", "reason", "rule"),
    [
        ("uapdfl", "nan", "non-finite", None),
        ("uapdfl", "scale", "norm", None),
        ("uapdfl", "sign_flip", "clip: distance", "clip"),
        ("dfedavgm", "nan", "non-finite", None),
        ("fedavg", "nan", "non-finite", None),
        ("fedavg", "sign_flip", "clip: distance", "clip"),
    ],
)
def test_a_poisoning_peer_is_refused_and_named(tmp_path, method, attack, reason, rule):
    records, logs = run(
        tmp_path,
        [
            f"algorithm.name={method}",
            "algorithm.params={}",
            f"attacks=[{{kind: {attack}, nodes: [d]}}]",
            *([f"defence.rule={rule}"] if rule else []),
        ],
    )
    assert all(rec["attack"] == [attack] for rec in records["d"])
    refusals = []
    for nid in ("a", "b", "c"):
        for rec in records[nid]:
            assert math.isfinite(rec["test_loss"]) and "attack" not in rec, (nid, rec)
            assert rec["diverged"] is None
            assert set(rec["rejected"]) <= {"d"}, (nid, rec["rejected"])  # no honest peer
            if "d" in rec["rejected"]:
                refusals.append(rec["rejected"]["d"])
    assert refusals and all(reason in r for r in refusals), refusals
    assert "refused d's state" in logs or "left out d" in logs
    if method == "fedavg":  # a refused upload is not among what a round aggregated
        for nid in ("a", "b", "c"):
            for rec in records[nid]:
                if rec["aggregator"] != "d":
                    assert "d" not in rec["aggregated"], (nid, rec["round"], rec["aggregated"])


def test_the_default_defence_pulls_a_sign_flipper_in_and_refuses_no_one(tmp_path):
    """``centered_clip``: the flipped upload (at about twice the model's norm) is pulled onto
    the bound and counted, named in the aggregator's ``clipped``; nothing is refused or
    distrusted (the decentralized path is the same ``Defence.combine``: test_defence.py)."""
    records, _ = run(
        tmp_path,
        [
            "algorithm.name=fedavg",
            "algorithm.params={}",
            "attacks=[{kind: sign_flip, nodes: [d]}]",
        ],
    )
    clipped = []
    for nid in ("a", "b", "c"):
        for rec in records[nid]:
            assert math.isfinite(rec["test_loss"]) and rec["rejected"] == {}, (nid, rec)
            assert rec["distrusted"] == {}
            clipped += [ratio for peer, ratio in rec.get("clipped", {}).items() if peer == "d"]
            assert set(rec.get("clipped", {})) <= {"d"}, (nid, rec["clipped"])
    assert clipped and all(r > 1 for r in clipped), clipped


def test_an_inflated_sample_count_is_capped(tmp_path):
    records, _ = run(
        tmp_path,
        ["algorithm.name=fedavg", "algorithm.params={}", "attacks=[{kind: inflate_n, nodes: [d]}]"],
    )
    capped = [rec["capped"] for nid in "abc" for rec in records[nid] if rec["capped"]]
    capped += [rec["capped"] for rec in records["d"] if rec["capped"]]
    assert capped and all(c == {"d": 10**9} for c in capped), capped


def test_a_malicious_aggregator_is_refused_and_the_round_fails_over(tmp_path):
    # round 1's aggregator is b (sorted roster [a, b, c, d], (r + attempt) mod 4)
    records, logs = run(
        tmp_path,
        [
            "algorithm.name=fedavg",
            "algorithm.params={}",
            "attacks=[{kind: nan, nodes: [b], corrupts: result}]",
        ],
    )
    first = {nid: records[nid][0] for nid in "acd"}
    for nid, rec in first.items():
        assert rec["aggregator"] == "c" and rec["attempt"] == 1, (nid, rec)
        assert rec["failovers"][0]["aggregator"] == "b", rec["failovers"]
        assert "result refused: non-finite" in rec["failovers"][0]["why"]
        assert rec["distrusted"].get("b", 0) > 2
    for nid in "acd":
        for rec in records[nid]:
            assert math.isfinite(rec["test_loss"]), (nid, rec)
            assert not (rec["aggregator"] == "b" and rec["received"]), (nid, rec)
    assert "refused b's state: result: non-finite" in logs


def test_the_audit_passes_an_honest_aggregator_and_reports_its_cost(tmp_path):
    records, _ = run(
        tmp_path, ["algorithm.name=fedavg", "algorithm.params={}", "security.sign=true"]
    )
    for nid, recs in records.items():
        for rec in recs:
            audit = rec["audit"]
            assert audit["verdict"] == "ok" and audit["auditor"] != rec["aggregator"], (nid, rec)
            assert rec["failovers"] == [] and rec["dropped_total"] == 0, (nid, rec)
            if audit["auditor"] == nid:  # it pulled the round's uploads to recompute
                assert audit["audit_bytes"] > 0, rec


def test_the_audit_catches_a_subtly_dishonest_aggregator(tmp_path):
    # b aggregates round 1 (and round 5): it serves its aggregate scaled by 1.0001, which
    # passes every admission check; the round's auditor recomputes and catches it
    records, logs = run(
        tmp_path,
        [
            "algorithm.name=fedavg",
            "algorithm.params={}",
            "security.sign=true",
            "rounds=5",
            "attacks=[{kind: scale, factor: 1.0001, nodes: [b], corrupts: result}]",
        ],
        rounds=5,
    )
    for nid in "acd":
        first, fifth = records[nid][0], records[nid][4]
        assert first["failovers"][0]["aggregator"] == "b", first
        assert first["failovers"][0]["why"].startswith("audit: tensor"), first["failovers"]
        assert first["aggregator"] == "c" and first["audit"]["verdict"] == "ok", first
        assert {"attempt": 0, "aggregator": "b", "why": "convicted"} in fifth["failovers"]
        assert all(math.isfinite(rec["test_loss"]) for rec in records[nid])
    assert "the audit caught aggregator b" in logs
