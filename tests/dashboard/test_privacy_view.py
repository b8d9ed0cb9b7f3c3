"""The dashboard's ε (p2pfl/dashboard/snapshot.py): each node's ε after its last record and
whether its budget is spent under privacy.dp; nothing at all for a run without it."""

from __future__ import annotations

import json
from pathlib import Path

from p2pfl.check.load import load_topology
from p2pfl.config.schema import dump_topology
from p2pfl.dashboard.runstate import RunState
from p2pfl.dashboard.snapshot import build_snapshot


def _snap(tmp_path: Path, records: dict[str, list[dict]]) -> dict:
    cfg = load_topology("topologies/synthetic.yaml", ["rounds=3"])
    run = tmp_path / "run"
    (run / "nodes").mkdir(parents=True)
    (run / "config.yaml").write_text(dump_topology(cfg))
    for nid, recs in records.items():
        with open(run / "nodes" / f"{nid}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in recs)
    state = RunState(run)
    state.refresh()
    return {n["id"]: n for n in build_snapshot(state, None)["nodes"]}


def _rec(r: int, **extra) -> dict:
    return {"round": r, "test_acc": 0.5, "bytes_sent": 10, "round_s": 1.0, **extra}


def test_nodes_show_their_last_epsilon_and_a_spent_budget(tmp_path):
    nodes = _snap(
        tmp_path,
        {
            "a": [_rec(1, epsilon=0.4), _rec(2, epsilon=0.7)],
            "b": [_rec(1, epsilon=0.5), _rec(2, epsilon=0.5, dp_exhausted=True)],
        },
    )
    assert nodes["a"]["epsilon"] == 0.7 and nodes["a"]["dp_exhausted"] is False
    assert nodes["b"]["epsilon"] == 0.5 and nodes["b"]["dp_exhausted"] is True
    assert "epsilon" not in nodes["c"]  # no record yet


def test_a_run_without_privacy_has_no_epsilon(tmp_path):
    nodes = _snap(tmp_path, {"a": [_rec(1)], "b": [_rec(1)]})
    assert all("epsilon" not in n and "dp_exhausted" not in n for n in nodes.values())
