"""Compressed transfers end to end (docs/wire.md, "Compression"): a small swarm on a real
Mosquitto on loopback, with and without ``transfer.compress: int8``, on each lane and for
both kinds of method (snapshots pulled by neighbours; uploads and aggregator results); and
``topk(0.1)``, whose pulls name the base they hold and get deltas once a stream has reached
the same puller before."""

from __future__ import annotations

import math

import pytest
from swarm_helpers import check_run_dir

from p2pfl.check.load import load_topology
from p2pfl.launch.broker import have_mosquitto
from p2pfl.launch.swarm import run_swarm

pytestmark = pytest.mark.integration


def run(tmp_path, name: str, overrides: list[str]) -> list[dict]:
    cfg = load_topology("topologies/synthetic.yaml", ["rounds=2", *overrides])
    out = tmp_path / name
    code, _ = run_swarm(cfg, out, nodes_per_process=4, broker_kind="mosquitto", progress=False)
    assert code == 0
    logs = check_run_dir(out, cfg.node_ids, 2)
    return [r for recs in logs.values() for r in recs]


@pytest.mark.parametrize(
    "method, lane",
    [("uapdfl", "direct"), ("fedavg", "mqtt")],
)
def test_int8_sends_fewer_state_bytes_and_the_swarm_still_learns(tmp_path, method, lane):
    if not have_mosquitto():
        pytest.fail("mosquitto is not installed: apt-get install -y mosquitto")
    base = [
        f"algorithm.name={method}",
        *([] if method == "uapdfl" else ["algorithm.params={}"]),
        f"transfer.direct={str(lane == 'direct').lower()}",
    ]
    recs = {c: run(tmp_path, c, [*base, f"transfer.compress={c}"]) for c in ("none", "int8")}
    sent = {c: sum(r["bytes_sent"] for r in rs) for c, rs in recs.items()}
    for c, rs in recs.items():
        assert {lane_ for r in rs for lane_ in r["lanes"].values()} == {lane}, c
        assert all(r["rejected"] == {} for r in rs), c
        assert all(math.isfinite(r["test_acc"]) and r["test_acc"] > 0 for r in rs), c
    print(f"{method} over {lane}: bytes sent {sent}")
    assert sent["int8"] < 0.6 * sent["none"], sent
    # the decoded (lossy) states are what the nodes merged: the losses move a little,
    # the accuracy hardly
    loss = {c: [r["test_loss"] for r in rs] for c, rs in recs.items()}
    acc = {c: sum(r["test_acc"] for r in rs) / len(rs) for c, rs in recs.items()}
    print(f"{method} over {lane}: test loss {loss}, mean acc {acc}")
    assert loss["int8"] != loss["none"]
    assert abs(acc["int8"] - acc["none"]) < 0.1, acc


def run_rounds(tmp_path, name: str, overrides: list[str], rounds: int) -> list[dict]:
    cfg = load_topology("topologies/synthetic.yaml", [f"rounds={rounds}", *overrides])
    out = tmp_path / name
    code, _ = run_swarm(cfg, out, nodes_per_process=4, broker_kind="mosquitto", progress=False)
    assert code == 0
    logs = check_run_dir(out, cfg.node_ids, rounds)
    return [r for recs in logs.values() for r in recs]


@pytest.mark.parametrize(
    "method, lane, nodes, rounds, first_delta",
    [
        # every node pulls its ring neighbours every round: deltas from round 2 on
        ("dfedavgm", "direct", ["a", "b", "c", "d"], 3, 2),
        # the aggregator rotates over the 3 members: a stream of uploads or results
        # reaches the same puller again, with a base, from round 4 on
        ("fedavg", "mqtt", ["a", "b", "c"], 5, 4),
    ],
)
def test_topk_pulls_get_deltas_from_the_base_they_name(
    tmp_path, method, lane, nodes, rounds, first_delta
):
    if not have_mosquitto():
        pytest.fail("mosquitto is not installed: apt-get install -y mosquitto")
    base = [
        f"algorithm.name={method}",
        "algorithm.params={}",
        f"transfer.direct={str(lane == 'direct').lower()}",
        f"nodes=[{','.join(nodes)}]",
    ]
    modes = ("none", "topk(0.1)")
    recs = {c: run_rounds(tmp_path, c, [*base, f"transfer.compress={c}"], rounds) for c in modes}
    # the bytes each round's pulls brought (a puller pulls within its round; a server may
    # already be in its next round when it answers, so bytes_sent can shift by a round)
    recv = {c: {r: 0 for r in range(1, rounds + 1)} for c in modes}
    for c, rs in recs.items():
        for r in rs:
            recv[c][r["round"]] += r["bytes_recv"]
            assert r["lanes"] and set(r["lanes"].values()) == {lane}, c
            assert r["rejected"] == {} and r["dropped_total"] == 0, (c, r)  # no bad_transfer
            assert not r.get("pull_failed") and not r.get("failovers"), (c, r)
            assert math.isfinite(r["test_acc"]) and r["test_acc"] > 0, c
    print(f"{method} over {lane}: bytes received per round {recv}")
    none, topk = recv["none"], recv["topk(0.1)"]
    assert topk[1] >= none[1]  # the first pull of each stream is dense
    for r in range(first_delta, rounds + 1):
        assert topk[r] < 0.5 * none[r], (r, recv)
    # what the nodes merged is the senders' published estimates: lossy, but they learn
    acc = {
        c: sum(r["test_acc"] for r in rs if r["round"] == rounds) / len(nodes)
        for c, rs in recs.items()
    }
    print(f"{method} over {lane}: mean final accuracy {acc}")
    assert acc["topk(0.1)"] > 0.4, acc  # 4 classes: chance is 0.25
