"""The dashboard's view of robustness (p2pfl/dashboard/runstate.py, ``Robustness``, and
p2pfl/dashboard/snapshot.py): what each node refused and distrusts, attacking and
rolled-back nodes, the edges flagged, the refusals counted as records arrive, and older
runs' records without any of it."""

from __future__ import annotations

import json
from pathlib import Path

from p2pfl.check.load import load_topology
from p2pfl.config.schema import dump_topology
from p2pfl.dashboard.runstate import RunState
from p2pfl.dashboard.snapshot import build_snapshot

NORM = "norm ratio 25.0 > max_norm_ratio 10"


def _run_dir(tmp_path: Path) -> Path:
    cfg = load_topology("topologies/synthetic.yaml", ["rounds=5"])  # a ring a-b-c-d
    run = tmp_path / "run"
    (run / "nodes").mkdir(parents=True)
    (run / "config.yaml").write_text(dump_topology(cfg))
    return run


def _write(run: Path, nid: str, *recs: dict) -> None:
    with open(run / "nodes" / f"{nid}.jsonl", "a") as f:
        for rec in recs:
            f.write(json.dumps(rec) + "\n")


def _rec(r: int, **extra) -> dict:
    return {"round": r, "test_acc": 0.5, "bytes_sent": 10, "round_s": 1.0, "chosen": [], **extra}


def _snap(run: Path) -> tuple[RunState, dict]:
    state = RunState(run)
    state.refresh()
    return state, build_snapshot(state, None)


def _node(snap: dict, nid: str) -> dict:
    return next(n for n in snap["nodes"] if n["id"] == nid)


def test_a_distrusted_peer_flags_the_edge_with_the_last_reason(tmp_path):
    run = _run_dir(tmp_path)
    # round 1: a refuses b and distrusts it until round 4; round 2: b is not drawn
    _write(
        run,
        "a",
        _rec(1, rejected={"b": NORM}, distrusted={"b": 4}, capped={}, diverged=None),
        _rec(2, rejected={}, distrusted={"b": 4}, capped={}, diverged=None),
    )
    _write(run, "b", _rec(1, rejected={}, distrusted={}, diverged=None))
    state, snap = _snap(run)
    assert snap["edge_flags"] == [
        {
            "edge": ["a", "b"],
            "distrusted": True,
            "refused": [
                {"by": "a", "peer": "b", "until": 4, "round": 1, "reason": NORM, "now": False}
            ],
        }
    ]
    a = _node(snap, "a")
    assert a["rejected"] == {} and a["distrusted"] == {"b": 4}
    assert a["diverged"] is None and "attack" not in a
    assert snap["refusals"] == 1
    json.dumps(snap, allow_nan=False)

    # round 3: both ends refuse each other, b without distrust (distrust_rounds 0)
    _write(run, "a", _rec(3, rejected={"b": "non-finite values"}, distrusted={"b": 8}))
    _write(run, "b", _rec(2, rejected={"a": "layout differs"}, distrusted={}))
    assert state.refresh()
    snap = build_snapshot(state, None)
    (flag,) = snap["edge_flags"]
    assert flag["distrusted"] is True
    assert flag["refused"] == [
        {
            "by": "a",
            "peer": "b",
            "until": 8,
            "round": 3,
            "reason": "non-finite values",
            "now": True,
        },
        {
            "by": "b",
            "peer": "a",
            "until": None,
            "round": 2,
            "reason": "layout differs",
            "now": True,
        },
    ]
    assert snap["refusals"] == 3  # counted as the records arrive
    assert _node(snap, "b")["rejected"] == {"a": "layout differs"}

    # b's distrust lapses and nobody refuses anymore: the edge is no longer flagged
    _write(run, "a", _rec(4, rejected={}, distrusted={}))
    _write(run, "b", _rec(3, rejected={}, distrusted={}))
    state.refresh()
    snap = build_snapshot(state, None)
    assert snap["edge_flags"] == [] and snap["refusals"] == 3


def test_a_refusal_without_distrust_and_distrust_off_the_topology(tmp_path):
    run = _run_dir(tmp_path)
    # c refuses d this round (no reputation), and distrusts a, which is no ring neighbour
    _write(run, "c", _rec(1, rejected={"d": NORM}, distrusted={"a": 6}))
    _, snap = _snap(run)
    assert snap["edge_flags"] == [
        {
            "edge": ["c", "d"],
            "distrusted": False,
            "refused": [
                {"by": "c", "peer": "d", "until": None, "round": 1, "reason": NORM, "now": True}
            ],
        }
    ]
    assert _node(snap, "c")["distrusted"] == {"a": 6}  # on the node, not on an edge


def test_attacking_and_rolled_back_nodes(tmp_path):
    run = _run_dir(tmp_path)
    _write(run, "a", _rec(1, attack=["sign_flip", "inflate_n"], rejected={}, distrusted={}))
    _write(run, "b", _rec(1, attack=[], distrusted={}))  # an attacker resting this round
    rollback = {"merged_from": ["a", "c"], "rolled_back_to": 1}
    _write(run, "c", _rec(1, diverged=None), _rec(2, diverged=rollback))
    _write(run, "d", _rec(1, diverged=rollback), _rec(2, diverged=None, capped={"a": 1e9}))
    _, snap = _snap(run)
    a, b, c, d = (_node(snap, n) for n in "abcd")
    assert a["attack"] == ["sign_flip", "inflate_n"] and b["attack"] == []
    assert "attack" not in c and "attack" not in d
    assert c["diverged"] == rollback and c["rollbacks"] == 1
    assert d["diverged"] is None and d["rollbacks"] == 1  # rolled back earlier, not now
    assert d["capped"] == {"a": 1e9}
    assert snap["edge_flags"] == [] and snap["refusals"] == 0


def test_older_records_and_odd_values_give_no_flags_and_no_errors(tmp_path):
    run = _run_dir(tmp_path)
    for nid in "abcd":  # records from before robustness: none of the fields
        _write(run, nid, _rec(1, pulled={"b": "all"}), _rec(2))
    state, snap = _snap(run)
    for n in snap["nodes"]:
        assert n["rejected"] == {} and n["distrusted"] == {} and n["capped"] == {}
        assert n["diverged"] is None and n["rollbacks"] == 0 and "attack" not in n
    assert snap["edge_flags"] == [] and snap["refusals"] == 0
    json.dumps(snap, allow_nan=False)

    # hand-edited or foreign values are dropped, never raised on
    _write(
        run,
        "a",
        _rec(
            3,
            rejected=["b"],
            distrusted={"b": "soon", "d": True, "c": 7, "": 3},
            capped={"b": float("nan")},
            attack="sign_flip",
            diverged=True,
        ),
    )
    _write(run, "b", _rec(3, rejected={"a": {"why": 1}}, diverged={"merged_from": "c"}))
    assert state.refresh()
    snap = build_snapshot(state, None)
    a, b = _node(snap, "a"), _node(snap, "b")
    assert a["rejected"] == {} and a["distrusted"] == {"c": 7} and a["capped"] == {}
    assert "attack" not in a
    assert a["diverged"] == {"merged_from": [], "rolled_back_to": None}
    assert b["rejected"] == {"a": '{"why": 1}'}
    assert b["diverged"] == {"merged_from": [], "rolled_back_to": None}
    assert snap["refusals"] == 1
    json.dumps(snap, allow_nan=False)


def test_a_replaced_record_file_starts_the_node_over(tmp_path):
    run = _run_dir(tmp_path)
    _write(run, "a", _rec(1, rejected={"b": NORM, "d": NORM}, distrusted={"b": 4, "d": 4}))
    state, snap = _snap(run)
    assert snap["refusals"] == 2 and len(snap["edge_flags"]) == 2
    (run / "nodes" / "a.jsonl").write_text(json.dumps(_rec(1)) + "\n")  # a new run
    state.refresh()
    snap = build_snapshot(state, None)
    assert snap["refusals"] == 0 and snap["edge_flags"] == []
    assert _node(snap, "a")["distrusted"] == {}
