"""Centralized methods end to end: node processes, a real Mosquitto on loopback, synthetic
data. Every method runs 2 rounds on 5 nodes; round 1's aggregator is SIGKILLed mid-round."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from swarm_helpers import check_run_dir, start_nodes

from p2pfl.check.load import load_topology
from p2pfl.launch.swarm import run_swarm, stop_workers
from p2pfl.learning.models import build_model
from p2pfl.learning.state import part_keys
from p2pfl.metrics import read_records
from p2pfl.rounds.rotation.election import aggregator_for
from p2pfl.wire.codec import state_nbytes

pytestmark = pytest.mark.integration

FIVE = "nodes=[a, b, c, d, e]"
SMALL = ["dataset.synthetic_train=500", "dataset.synthetic_test=250", "timing.linger_s=5"]
METHODS = {
    "fedavg": {},
    "fedper": {},
    "criticalfl": {"initial_fraction": 0.4},
    "diversifed": {"tau": 1.0, "alpha": 1.0, "lam": 2.0},
    "pfedc": {"weighting": "mgda"},
    "fedsa": {"cv_t": 0.2, "sim_t": 0.2, "c_mic": 4, "s_mac": 4},
}


def _overrides(method: str, extra: list[str]) -> list[str]:
    params = "{" + ", ".join(f"{k}: {v}" for k, v in METHODS[method].items()) + "}"
    return [f"algorithm.name={method}", f"algorithm.params={params}", FIVE, *SMALL, *extra]


def _config(method: str, extra: list[str]):
    return load_topology("topologies/synthetic.yaml", _overrides(method, extra))


def _model_bytes(cfg, part: str) -> int:
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.dataset.num_classes, tuple(cfg.dataset.input_shape))
    state = model.state_dict()
    return state_nbytes({k: state[k] for k in part_keys(list(state), part)})


@pytest.mark.parametrize("method", sorted(METHODS))
def test_method_runs_two_rounds_with_one_upload_and_one_download(tmp_path, method):
    cfg = _config(method, ["rounds=2"])
    code, summary = run_swarm(cfg, tmp_path / "run", nodes_per_process=5, progress=False)
    assert code == 0
    logs = check_run_dir(tmp_path / "run", cfg.node_ids, 2)
    roster = cfg.node_ids
    for r in (1, 2):
        recs = {nid: logs[nid][r - 1] for nid in roster}
        aggs = {rec["aggregator"] for rec in recs.values()}
        assert aggs == {aggregator_for(r, roster)}, (r, aggs)
        assert all(rec["attempt"] == 0 and not rec["failovers"] for rec in recs.values())
        agg = aggs.pop()
        uploaded = recs[agg]["aggregated"]
        assert set(uploaded) == {n for n in roster if recs[n]["participated"]}
        if method != "criticalfl":
            assert sorted(uploaded) == roster
    assert summary["bytes_sent_total"] > 0
    if method in ("fedavg", "fedper", "fedsa"):
        # every client uploads its part once and receives the result once; the aggregator
        # sends nobody what it already has (FedPer: g only, both ways)
        part = "g" if method == "fedper" else "all"
        size = _model_bytes(cfg, part)
        clients = len(roster) - 1
        for r in (1, 2):
            recs = [logs[nid][r - 1] for nid in roster]
            agg = recs[0]["aggregator"]
            sent = {rec_nid: logs[rec_nid][r - 1]["bytes_sent"] for rec_nid in roster}
            for nid in roster:
                if nid != agg:
                    assert size <= sent[nid] <= size * 1.02 + 16_000, (r, nid, sent[nid], size)
            assert clients * size <= sent[agg] <= clients * size * 1.02 + 16_000, (r, sent, size)
    if method == "fedper":
        # h never travels: nodes end with different classifiers but one common g
        assert all(set(logs[n][-1]["peers"]) == set(roster) for n in roster)


def _wait_log(path: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in {path} after {timeout} s")


def test_round_one_aggregator_killed_mid_round(tmp_path, broker):
    """Each node in its own process. Round 1's aggregator (``b``) is SIGKILLed while it
    collects the round's uploads; the broker publishes its Last Will, the next peer in order
    (``c``) takes round 1 over as attempt 1, and the swarm finishes every round without it.

    To catch ``b`` collecting, one client (``e``) is frozen (SIGSTOP) as it starts training
    round 1 (training is made to last about a second), so ``b`` waits for its report; ``e``
    is let go once ``b`` is dead."""
    rounds = 3
    cfg, out, workers = start_nodes(
        tmp_path,
        broker,
        _overrides(
            "fedavg",
            [
                f"rounds={rounds}",
                "training.epochs=100",
                "timing.round_timeout_s=5",
                # b's death is heard by its Last Will, not this timeout: it only bounds how
                # long a client waits for a live aggregator, which on a loaded 2-core
                # machine (five processes training) may take longer than 8 s to aggregate
                "timing.aggregator_timeout_s=30",
            ],
        ),
    )
    victim = aggregator_for(1, cfg.node_ids)
    assert victim == "b"
    survivors = [n for n in cfg.node_ids if n != victim]
    slow_id = "e"  # a client, and not round 1's next aggregator
    slow = workers[slow_id]
    frozen = False
    try:
        _wait_log(slow.log_path, "ready after", 90)  # round 1's training starts now
        os.killpg(slow.proc.pid, signal.SIGSTOP)
        frozen = True
        _wait_log(workers[victim].log_path, "aggregating round 1 attempt 0", 90)
        os.killpg(workers[victim].proc.pid, signal.SIGKILL)
        os.killpg(slow.proc.pid, signal.SIGCONT)
        frozen = False
        for nid in survivors:
            assert workers[nid].proc.wait(timeout=120) == 0, workers[nid].log_path.read_text()
    finally:
        if frozen:
            os.killpg(slow.proc.pid, signal.SIGCONT)
        stop_workers(list(workers.values()), grace=2)
    successor = aggregator_for(1, cfg.node_ids, attempt=1)
    for nid in survivors:
        recs = read_records(out / "nodes" / f"{nid}.jsonl")
        assert [r["round"] for r in recs] == list(range(1, rounds + 1)), nid
        first = recs[0]
        assert first["aggregator"] == successor and first["attempt"] == 1, (nid, first)
        if nid != slow_id:  # frozen through attempt 0, it never turned to the victim
            assert first["failovers"][0]["aggregator"] == victim
        assert victim not in first["aggregated"]
        for rec in recs[1:]:
            assert victim not in rec["roster"] and rec["attempt"] == 0
            assert rec["aggregator"] == aggregator_for(rec["round"], survivors)
