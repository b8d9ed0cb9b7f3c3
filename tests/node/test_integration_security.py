"""End to end on a real Mosquitto: a swarm with TLS, client certificates, the per-node ACL
and signed messages; and a node that joins a swarm already under way."""

from __future__ import annotations

import math

import pytest
from swarm_helpers import check_run_dir, start_nodes, wait_round

from p2pfl.check.load import load_topology
from p2pfl.launch.swarm import run_swarm, spawn_worker, stop_workers
from p2pfl.metrics import read_records

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("method", ["uapdfl", "fedavg"])
def test_secure_swarm_runs_with_tls_acl_and_signatures(tmp_path, method):
    """The launcher creates the swarm's certificates, starts a TLS-only Mosquitto that
    requires them, and every node signs and verifies every message: a healthy swarm drops
    nothing and still exchanges weights (peer to peer, and through the rotating
    aggregator, whose announcements and uploads pass the same ACL)."""
    cfg = load_topology(
        "topologies/synthetic.yaml",
        [f"algorithm.name={method}", "algorithm.params={}", "rounds=2"]
        + ["security.tls=true", "security.sign=true"],
    )
    out = tmp_path / "run"
    code, summary = run_swarm(cfg, out, nodes_per_process=2, progress=False)
    assert code == 0
    logs = check_run_dir(out, cfg.node_ids, 2)
    assert (out / "certs" / "ca.crt").exists()
    for nid, recs in logs.items():
        assert all(r["dropped_total"] == 0 for r in recs), nid
        assert recs[-1]["bytes_recv"] > 10_000, nid  # weights moved over the signed TLS lane
        assert math.isfinite(recs[-1]["test_acc"])
    recorded = load_topology(out / "config.yaml")
    assert recorded.security.certs == str((out / "certs").absolute())


def test_late_node_is_picked_up(tmp_path, broker):
    """``d`` starts after the others are under way: it joins after the latest round its
    neighbours report, they include it from then on, and everyone finishes."""
    rounds = 40  # synthetic rounds take ~0.2 s: long enough for d to start meanwhile
    cfg, out, workers = start_nodes(
        tmp_path,
        broker,
        [
            f"rounds={rounds}",
            "timing.round_timeout_s=8",
            "timing.startup_timeout_s=2",
            "timing.linger_s=3",
            "algorithm.params.divergence_rule=fixed",
            "algorithm.params.th_I=0",
            "training.epochs=2",
        ],
        only=["a", "b", "c"],
    )
    try:
        wait_round(out, "a", 2, 90)
        workers["d"] = spawn_worker(out / "config.yaml", ["d"], broker.address, out, False)
        for nid, w in workers.items():
            assert w.proc.wait(timeout=120) == 0, (nid, w.log_path.read_text()[-3000:])
    finally:
        stop_workers(list(workers.values()), grace=2)
    late = read_records(out / "nodes" / "d.jsonl")
    assert late and late[0]["round"] > 2 and late[-1]["round"] == rounds, late
    # its neighbours published their gossip again when it came online: nobody was missing
    assert late[0]["chosen"] and late[0]["missing"] == [], late[0]
    for nid in ("a", "c"):  # d's ring neighbours
        recs = read_records(out / "nodes" / f"{nid}.jsonl")
        assert [r["round"] for r in recs] == list(range(1, rounds + 1))
        assert "d" not in recs[0]["peers"]
        joined = [r["round"] for r in recs if "d" in r["peers"]]
        assert joined and joined[-1] == rounds and min(joined) >= late[0]["round"], (nid, joined)
