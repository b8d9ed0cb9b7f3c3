"""Differential privacy end to end (privacy.dp): a 4-node swarm (one process, a real broker
on loopback, synthetic data) for a decentralized method (UA-PDFL) and a centralized one
(FedAvg). Under DP-SGD every record carries a growing ε, the summary has it; a node whose
budget runs out stops training, keeps serving, and the swarm completes. Under level: update
every round's record carries the ε of that many releases."""

from __future__ import annotations

import json

import pytest
from swarm_helpers import check_run_dir

from p2pfl.check.load import load_topology
from p2pfl.launch.swarm import run_swarm
from p2pfl.privacy.update_accountant import update_epsilon

pytestmark = pytest.mark.integration

ROUNDS = 3


def _run(tmp_path, method: str, dp: str, extra: tuple[str, ...] = ()):
    cfg = load_topology(
        "topologies/synthetic.yaml",
        [
            *extra,
            f"algorithm.name={method}",
            "algorithm.params={}" if method != "uapdfl" else "algorithm.params={com: 2}",
            f"rounds={ROUNDS}",
            "timing.linger_s=5",
            f"privacy={{dp: {dp}}}",
        ],
    )
    code, summary = run_swarm(cfg, tmp_path / "run", nodes_per_process=4, progress=False)
    assert code == 0
    return cfg, summary, check_run_dir(tmp_path / "run", cfg.node_ids, ROUNDS)


@pytest.mark.parametrize("method", ["uapdfl", "fedavg"])
def test_every_record_carries_a_growing_epsilon(tmp_path, method):
    cfg, summary, logs = _run(tmp_path, method, "{noise_multiplier: 1.0, max_grad_norm: 1.0}")
    for nid, recs in logs.items():
        eps = [rec["epsilon"] for rec in recs]
        assert all(isinstance(e, float) and e > 0 for e in eps), (nid, eps)
        assert eps == sorted(eps) and eps[0] < eps[-1], (nid, eps)
        assert not any(rec.get("dp_exhausted") for rec in recs)
        assert all(rec["train_loss"] is not None for rec in recs)
    merged = [rec["method"].get("merged_from") for recs in logs.values() for rec in recs]
    assert any(merged) or method == "fedavg", merged  # noisy states are still merged
    if method == "uapdfl":  # the representations gossiped still come and are compared
        assert any(rec["method"].get("divergence") for recs in logs.values() for rec in recs)
    assert set(summary["epsilon"]["per_node"]) == set(cfg.node_ids)
    assert summary["epsilon"]["max"] == max(recs[-1]["epsilon"] for recs in logs.values())
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert written["epsilon"]["exhausted"] == []


@pytest.mark.parametrize("method", ["uapdfl", "fedavg"])
def test_a_spent_budget_stops_training_and_the_swarm_completes(tmp_path, method):
    """σ planned for 1 round of a 3-round run: each node trains round 1, then says its
    budget is spent and only merges what its neighbours serve (it keeps serving too). The
    noise of ε = 0.5 moves the models far apart; the default ``clip`` defence allows for
    it (docs/algorithms.md, "DP and the defence") and refuses nobody."""
    cfg, summary, logs = _run(tmp_path, method, "{target_epsilon: 0.5, rounds: 1}")
    for nid, recs in logs.items():
        assert not any(rec["rejected"] for rec in recs), (nid, [r["rejected"] for r in recs])
        first, later = recs[0], recs[1:]
        assert first["epsilon"] <= 0.5 and "dp_exhausted" not in first, (nid, first)
        assert first["train_loss"] is not None
        for rec in later:
            assert rec["dp_exhausted"] is True and rec["train_loss"] is None, (nid, rec)
            assert rec["epsilon"] == first["epsilon"]  # no more steps, no more ε
            if method == "uapdfl":  # it still pulls and merges its neighbours' states
                assert rec["pulled"] and rec["method"]["merged_from"], (nid, rec)
            else:  # it still uploads (its last applied model) and applies the result
                assert rec["participated"] and rec["received"], (nid, rec)
        assert sum(rec["bytes_sent"] for rec in later) > 0  # and serves its peers
    assert summary["epsilon"]["exhausted"] == sorted(cfg.node_ids)
    assert summary["nodes_completed"] == len(cfg.node_ids)


@pytest.mark.parametrize("method", ["uapdfl", "fedavg"])
def test_update_level_records_one_release_a_round(tmp_path, method):
    """Each node releases its noised update once a round: round r's ε is that of r Gaussian
    releases. The noised models are far apart (σC per coordinate); the default ``clip``
    defence allows for it and refuses nobody."""
    dp = "{level: update, noise_multiplier: 2.0, max_update_norm: 0.5, accountant: analytic}"
    cfg, summary, logs = _run(tmp_path, method, dp)
    want = [round(update_epsilon([(2.0, r)], 1e-5, "analytic"), 6) for r in range(1, ROUNDS + 1)]
    for nid, recs in logs.items():
        assert not any(rec["rejected"] for rec in recs), (nid, [r["rejected"] for r in recs])
        assert [rec["epsilon"] for rec in recs] == want, (nid, recs)
        assert all(rec["train_loss"] is not None for rec in recs)
        assert not any(rec.get("dp_exhausted") for rec in recs)
        if method == "uapdfl":  # the released models are pulled and merged
            assert any(rec["method"].get("merged_from") for rec in recs), (nid, recs)
        else:  # every member uploads its release and applies the result
            assert all(rec["participated"] and rec["received"] for rec in recs), (nid, recs)
    assert summary["epsilon"]["max"] == want[-1]
    assert summary["epsilon"]["exhausted"] == []
    assert summary["nodes_completed"] == len(cfg.node_ids)


def test_an_audited_dp_swarm_passes_its_audits(tmp_path):
    """FedAvg under DP-SGD in a signed swarm (so every round is audited) with the default
    ``clip`` defence and noise large enough that clip would refuse every upload without its
    DP allowance: the aggregator announces the allowance its clip measured with, each
    auditor bounds it and recomputes with it, nobody is refused and every verdict is
    ``ok``."""
    cfg, _summary, logs = _run(
        tmp_path,
        "fedavg",
        "{noise_multiplier: 5.0, max_grad_norm: 1.0}",
        ("security.sign=true",),
    )
    assert cfg.defence.rule == "centered_clip"
    for nid, recs in logs.items():
        for rec in recs:
            assert rec["audit"]["verdict"] == "ok", (nid, rec["audit"])
            assert not rec["rejected"] and rec["received"], (nid, rec)
