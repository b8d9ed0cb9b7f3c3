"""Asynchronous rounds on a real swarm (node processes, a real broker on loopback, synthetic
data): with one device emulated ten times slower, the others never wait for it, its states
still reach them with their staleness recorded, and every node finishes its rounds."""

from __future__ import annotations

import math
import statistics

import pytest
from swarm_helpers import check_run_dir

from p2pfl.algorithms import get_algorithm
from p2pfl.check.load import load_topology
from p2pfl.launch.swarm import run_swarm
from p2pfl.rounds.gossip.asynchronous import fresh_peers, staleness_weight

pytestmark = pytest.mark.integration


def test_staleness_weight_and_bound() -> None:
    assert staleness_weight(0, 0.5) == 1.0
    assert staleness_weight(3, 0.5) == pytest.approx(0.5)
    assert staleness_weight(3, 0.0) == 1.0
    assert fresh_peers({"a": 5, "b": 1, "c": 9}, 6, 4) == {"a": 1, "c": 0}
    assert fresh_peers({"a": 1}, 6, 5) == {"a": 5}


def run(tmp_path, overrides: list[str], rounds: int = 6):
    cfg = load_topology(
        "topologies/synthetic.yaml",
        [f"rounds={rounds}", "timing.linger_s=30", *overrides],
    )
    code, _ = run_swarm(cfg, tmp_path / "run", nodes_per_process=4, progress=False)
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("*.log"))
    assert code == 0, logs[-3000:]
    assert "Traceback" not in logs
    # asynchronous: a node the loaded machine slows may skip rounds to catch up (counted)
    return check_run_dir(tmp_path / "run", cfg.node_ids, rounds, may_skip=True), logs


@pytest.mark.parametrize("method", ["uapdfl", "dfedavgm", "dispfl"])
def test_a_slow_device_does_not_set_the_pace(tmp_path, method):
    # ring a-b-c-d-a; c trains 10 times slower than the others
    records, _ = run(
        tmp_path,
        [
            f"algorithm.name={method}",
            "algorithm.params={}",
            "timing.mode=async",
            "dataset.synthetic_train=2400",
            "devices=[{nodes: [c], speed: 0.1}]",
        ],
    )
    for nid, recs in records.items():
        assert all(math.isfinite(r["test_loss"]) for r in recs), nid
        assert all("staleness" in r for r in recs), nid
    # the fast nodes end their rounds before the slow one: nobody waited for it
    slow_end = records["c"][-1]["t"]
    assert all(records[n][-1]["t"] < slow_end for n in ("a", "b", "d"))
    # c's states still reached its neighbours, stale, with their staleness recorded (a
    # method that exchanges after training first gossips once c's slow first round is
    # over, by when the others may have finished: it is checked for not waiting only)
    if not get_algorithm(method).exchange_after_training:
        from_c = [
            (r["staleness"]["c"], r["pulled"].get("c"))
            for n in ("b", "d")
            for r in records[n]
            if "c" in r["staleness"]
        ]
        assert from_c and max(t for t, _ in from_c) >= 1, from_c
        assert any(part for _, part in from_c), from_c
    # c's training time is stretched in its records: ten times its own work, against the
    # quickest round of a fast node (the least slowed by the other nodes of its process,
    # so a busy machine cannot make the fast nodes look slow)
    slow = statistics.median(r["train_s"] for r in records["c"])
    quickest = min(r["train_s"] for n in ("a", "b", "d") for r in records[n])
    assert slow > 3 * quickest, (slow, quickest)


@pytest.mark.parametrize("method", ["uapdfl", "fedavg"])
def test_an_offline_window_takes_a_device_off_and_back(tmp_path, method):
    mode = "timing.mode=async" if method == "uapdfl" else "timing.quorum=0.5"
    records, logs = run(
        tmp_path,
        [
            f"algorithm.name={method}",
            "algorithm.params={}",
            mode,
            # d is away for its first 1.5 s; the others' rounds are slowed so the run
            # outlasts the window and d comes back to a swarm still under way
            "devices=[{nodes: [a, b, c], speed: 0.2}, {nodes: [d], offline: [[0, 1.5]]}]",
            "dataset.synthetic_train=2400",
        ],
        rounds=6,
    )
    assert "emulated device offline" in logs
    # while d was away the others went on without it; back, it took part again
    first = [records[n][0] for n in ("a", "c")]
    if method == "fedavg":
        assert all("d" not in r["aggregated"] for r in first), first
        assert any("d" in r["aggregated"] for r in records["a"][1:])
    else:
        assert all("d" not in r["chosen"] for r in first), first
        assert any("d" in r["pulled"] for n in ("a", "c") for r in records[n][1:])
