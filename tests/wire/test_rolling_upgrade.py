"""A rolling upgrade half done (README.md, "Rolling upgrades"): three nodes of this release
and one node of the protocol 3 release (its own code, from this repository's history) run
one swarm on a real broker, for a decentralized method (UA-PDFL) and a centralized one
(FedAvg). Every node runs every round with every peer, and pulls cross the versions both
ways. The FedAvg case proves that announcements reach the old node whole (it
drops one by difference as malformed) and that no ``probe_req``/``roster_req`` reaches it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from wire_helpers import ROOT, protocol_3_release

pytestmark = [pytest.mark.integration, pytest.mark.one_broker]

TOPOLOGY = """\
name: mixed-{method}
seed: 0
rounds: 3
algorithm: {{name: {method}, params: {params}}}
dataset: {{name: synthetic, partition: dirichlet(0.5), num_classes: 4, input_shape: [1, 8, 8],
  synthetic_train: 800, synthetic_test: 400}}
model: {{name: cnn}}
training: {{epochs: 1, batch_size: 20, optimizer: sgd, lr: 0.05, momentum: 0.5}}
nodes: [a, b, c, d]
edges: {edges}
timing: {{round_timeout_s: 30, startup_timeout_s: 60, linger_s: 5}}
"""


def records(run: Path, node: str) -> list[dict]:
    return [json.loads(line) for line in (run / "nodes" / f"{node}.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "method, params, edges",
    [("uapdfl", "{mu: 0.1, com: 2}", "ring"), ("fedavg", "{}", "full")],
)
def test_a_swarm_half_upgraded_runs_every_round(broker, tmp_path, method, params, edges):
    release = protocol_3_release(tmp_path / "release3")
    topology = tmp_path / "topology.yaml"
    topology.write_text(TOPOLOGY.format(method=method, params=params, edges=edges))
    address = f"{broker.host}:{broker.port}"

    def node(code: Path, ids: list[str], out: Path, log: Path) -> subprocess.Popen:
        args = [a for i in ids for a in ("--id", i)]
        return subprocess.Popen(
            [sys.executable, "-m", "p2pfl.cli", "node", str(topology), *args,
             "--broker", address, "--out", str(out), "--no-rich"],
            cwd=code, env={**os.environ, "PYTHONPATH": str(code)},
            stdout=log.open("w"), stderr=subprocess.STDOUT,
        )  # fmt: skip

    new_log, old_log = tmp_path / "new.log", tmp_path / "old.log"
    procs = [
        node(ROOT, ["a", "b", "c"], tmp_path / "new", new_log),
        node(release, ["d"], tmp_path / "old", old_log),
    ]
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = new_log.read_text() + old_log.read_text()
    assert codes == [0, 0], logs[-4000:]
    new = {n: records(tmp_path / "new", n) for n in "abc"}
    old = {"d": records(tmp_path / "old", "d")}
    every = {**new, **old}
    for n, rows in every.items():
        assert [r["round"] for r in rows] == [1, 2, 3], (n, logs[-4000:])
    for n in "abc":
        assert all(r["dropped_total"] == 0 for r in new[n]), n
    # only this release's first presences (protocol 4, before it heard d) were dropped by d
    assert old["d"][-1]["dropped_total"] <= 3
    # and nothing else: no announcement by difference, no kind protocol 3 does not know
    drops = [line for line in old_log.read_text().splitlines() if "d: dropped message (" in line]
    assert all("(protocol_version)" in line for line in drops), drops
    # the nodes that hear d's presence say, once each, what it runs
    heard = {n for n in "abc" if f"{n}: peer 'd' runs protocol 3" in logs}
    assert heard and all(logs.count(f"{n}: peer 'd' runs protocol 3") == 1 for n in heard)
    if method == "uapdfl":
        assert all(not r["pull_failed"] for rows in every.values() for r in rows)
        assert any(set(r["pulled"]) & {"a", "c"} for r in old["d"])  # d pulls from 3
        assert any("d" in r["pulled"] for n in "ac" for r in new[n])  # 3 pulls from d
    else:
        # one aggregator per round, the same at every node; d (protocol 3) takes its turn
        for i in range(3):
            assert len({rows[i]["aggregator"] for rows in every.values()}) == 1
        assert "d" in {r["aggregator"] for r in new["a"]}
        assert all(not r["failovers"] for rows in new.values() for r in rows)
