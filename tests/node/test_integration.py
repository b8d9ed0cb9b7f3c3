"""End to end against a real Mosquitto on loopback: node processes, synthetic data."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from swarm_helpers import check_run_dir, start_nodes, wait_round

from p2pfl.check.load import load_topology
from p2pfl.cli import main as cli_main
from p2pfl.launch.swarm import run_swarm, stop_workers
from p2pfl.metrics import read_records

pytestmark = pytest.mark.integration


def test_swarm_takes_dropout_and_personalization_branches(tmp_path):
    """th_I = 0: round 1 starts from the common initial model, so every divergence is exactly 0
    and client-wise dropout is taken; once local training has made the models differ, the
    divergences are > 0 and layer-wise personalization is taken."""
    cfg = load_topology(
        "topologies/synthetic.yaml",
        ["algorithm.params.divergence_rule=fixed", "algorithm.params.th_I=0"],
    )
    code, summary = run_swarm(cfg, tmp_path / "run", nodes_per_process=2, progress=False)
    assert code == 0
    logs = check_run_dir(tmp_path / "run", cfg.node_ids, cfg.rounds)
    for nid, recs in logs.items():
        assert recs[0]["dropout"] is True, nid
        assert recs[0]["method"]["dropout"] is True  # UA-PDFL's fact, copied to the top level
        assert len(recs[0]["method"]["merged_from"]) == 1
        assert recs[0]["method"]["dropout_peer"] in recs[0]["pulled"]
        assert all(r["dropout"] is False for r in recs[1:]), nid
        assert all(r["pulled"] and set(r["pulled"].values()) == {"g"} for r in recs[1:]), nid
        assert sorted(recs[-1]["peers"]) == sorted(r for r in recs[-1]["chosen"])
        assert all(r["bytes_sent"] > 0 and r["bytes_recv"] > 0 for r in recs)
    # the synthetic task is learnable: the swarm ends well above chance (1/4)
    assert summary["final"]["acc_mean"] > 0.5


def test_swarm_always_dropout_with_high_threshold(tmp_path):
    cfg = load_topology(
        "topologies/synthetic.yaml",
        ["algorithm.params.divergence_rule=fixed", "algorithm.params.th_I=1e9", "rounds=2"],
    )
    code, _ = run_swarm(cfg, tmp_path / "run", nodes_per_process=4, progress=False)
    assert code == 0
    logs = check_run_dir(tmp_path / "run", cfg.node_ids, 2)
    assert all(
        r["dropout"] and list(r["pulled"].values()) == ["all"]
        for recs in logs.values()
        for r in recs
    )


@pytest.mark.parametrize("how", ["kill", "freeze"])
def test_dead_node_does_not_stall_others(tmp_path, broker, how):
    """SIGKILL (the broker publishes the Last Will) or SIGSTOP (silent: only the round
    deadline helps) one node after its first round; the others finish every round, no round
    of theirs takes much longer than the deadline, and they record who was missing.

    A round here takes about a tenth of a second, so the victim may run a few rounds past
    its first before the signal lands (more on a loaded machine): what its neighbours can
    have heard from it is read from its own records once it is stopped, and the checks
    start after that round."""
    deadline_s = 6.0
    rounds = 8
    cfg, out, workers = start_nodes(
        tmp_path,
        broker,
        [
            f"rounds={rounds}",
            f"timing.round_timeout_s={deadline_s}",
            "timing.linger_s=2",
            "algorithm.params.divergence_rule=fixed",
            "algorithm.params.th_I=0",
        ],
    )
    victim = "c"
    try:
        wait_round(out, victim, 1, 90)
        os.killpg(workers[victim].proc.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        t_kill = time.time()
        # stopped: its records are final; it may have gossiped the round after its last one
        gossiped = read_records(out / "nodes" / f"{victim}.jsonl")[-1]["round"] + 1
        assert gossiped + 2 <= rounds, f"{victim} was in round {gossiped} of {rounds} when stopped"
        survivors = [n for n in cfg.node_ids if n != victim]
        for nid in survivors:
            assert workers[nid].proc.wait(timeout=90) == 0, workers[nid].log_path.read_text()
    finally:
        if how == "freeze":
            os.killpg(workers[victim].proc.pid, signal.SIGKILL)
        stop_workers(list(workers.values()), grace=2)
    for nid in survivors:
        recs = read_records(out / "nodes" / f"{nid}.jsonl")
        assert [r["round"] for r in recs] == list(range(1, rounds + 1)), nid
        after = [r for r in recs if r["t"] > t_kill + 1]
        for r in after:
            # comm never waits past the deadline (plus scheduling slack on 2 cores)
            assert r["comm_s"] <= deadline_s + 3.0, (nid, r)
    # c's neighbours (ring a-b-c-d) noticed it was gone: no round after the last one it
    # gossiped heard it, and with SIGKILL the Last Will took it out of the draw (a round
    # two after that one starts once the round before gave up on it)
    for nid in ("b", "d"):
        recs = read_records(out / "nodes" / f"{nid}.jsonl")
        assert all(victim not in r["peers"] for r in recs[gossiped:]), (nid, recs)
        last = recs[-1]
        if how == "kill":
            assert victim not in last["chosen"], (nid, last)
        else:
            # still "online" by presence until the broker drops it (1.5 x the 15 s
            # keepalive, which a slow machine may reach before the last round): chosen in
            # some round after the freeze, then missing or failed, never waited on past
            # the deadline (above)
            after = [r for r in recs if r["t"] > t_kill]
            assert any(victim in r["missing"] or victim in r["pull_failed"] for r in after), recs
    # a run of hand-started daemons can be summarized afterwards
    assert cli_main(["summarize", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["nodes_completed"] == 3 and summary["nodes_incomplete"] == [victim]


@pytest.mark.parametrize("method", ["uapdfl", "fedavg"])
def test_direct_lane_carries_the_weights_and_changes_no_result(tmp_path, method):
    """The same swarm with the direct lane (default) and without it: every pull of the first
    goes direct and the broker carries control traffic only; both give the same records."""
    accs, mqtt_bytes, direct_bytes = {}, {}, {}
    for direct in (True, False):
        cfg = load_topology(
            "topologies/synthetic.yaml",
            [
                "rounds=2",
                f"algorithm.name={method}",
                *([] if method == "uapdfl" else ["algorithm.params={}"]),
                f"transfer.direct={str(direct).lower()}",
            ],
        )
        code, _ = run_swarm(cfg, tmp_path / str(direct), nodes_per_process=4, progress=False)
        assert code == 0
        logs = check_run_dir(tmp_path / str(direct), cfg.node_ids, 2)
        recs = [r for rs in logs.values() for r in rs]
        lanes = {lane for r in recs for lane in r["lanes"].values()}
        assert lanes == ({"direct"} if direct else {"mqtt"}), lanes
        accs[direct] = {n: [r["test_acc"] for r in rs] for n, rs in logs.items()}
        direct_bytes[direct] = sum(r["direct_bytes_sent"] for r in recs)
        mqtt_bytes[direct] = sum(r["bytes_sent"] - r["direct_bytes_sent"] for r in recs)
    assert accs[True] == accs[False]
    assert direct_bytes[False] == 0 and direct_bytes[True] > 0
    # with the lane, the broker sees only control traffic: a small share of the weights
    assert mqtt_bytes[True] < 0.1 * mqtt_bytes[False], mqtt_bytes


def test_checked_swarm_builds_once_and_trains_the_same(tmp_path):
    """p2pfl swarm's node processes trust the launcher's check of the very config file
    they read (run_swarm(checked=True)) and build each node's model and method once: the
    trained models are bit for bit those of nodes that check again."""
    cfg = load_topology("topologies/synthetic.yaml", ["rounds=1"])
    runs = {}
    for checked in (True, False):
        out = tmp_path / f"checked-{checked}"
        code, _ = run_swarm(cfg, out, nodes_per_process=2, progress=False, checked=checked)
        assert code == 0
        logs = "".join(p.read_text() for p in (out / "logs").glob("*.log"))
        assert ("inputs checked by the launcher" in logs) is checked
        runs[checked] = {n: (out / "nodes" / f"{n}.safetensors").read_bytes() for n in cfg.node_ids}
    assert runs[True] == runs[False]
