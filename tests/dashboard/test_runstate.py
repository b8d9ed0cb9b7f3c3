"""The dashboard's run-directory reader (p2pfl/dashboard/runstate.py) and the snapshot it
feeds (p2pfl/dashboard/snapshot.py): incremental tailing, torn and malformed lines, a file
replaced by a new run, means per round, node states without a broker."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from p2pfl.check.load import load_topology
from p2pfl.config.schema import dump_topology
from p2pfl.dashboard.live import LiveState
from p2pfl.dashboard.runstate import JsonlTail, RunState
from p2pfl.dashboard.snapshot import build_snapshot, node_state
from p2pfl.metrics import write_json


def _line(rec: dict) -> bytes:
    return (json.dumps(rec) + "\n").encode()


def _append(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def test_tail_reads_only_what_was_appended(tmp_path):
    path = tmp_path / "a.jsonl"
    tail = JsonlTail(path)
    assert tail.poll() == ([], False)  # no file yet
    _append(path, _line({"round": 1}) + _line({"round": 2}))
    recs, reset = tail.poll()
    assert [r["round"] for r in recs] == [1, 2] and not reset
    assert tail.poll() == ([], False)  # nothing new: nothing read
    _append(path, _line({"round": 3}))
    assert [r["round"] for r in tail.poll()[0]] == [3]
    assert tail.offset == path.stat().st_size


def test_tail_keeps_a_partial_last_line_until_it_is_complete(tmp_path):
    path = tmp_path / "a.jsonl"
    tail = JsonlTail(path)
    whole = _line({"round": 1, "test_acc": 0.5})
    _append(path, whole[:10])  # a record being written
    assert tail.poll() == ([], False)
    _append(path, whole[10:-1])
    assert tail.poll() == ([], False)
    _append(path, whole[-1:] + _line({"round": 2})[:3])
    recs, _ = tail.poll()
    assert recs == [{"round": 1, "test_acc": 0.5}]
    assert tail.malformed == 0


def test_tail_skips_malformed_and_overlong_lines(tmp_path):
    path = tmp_path / "a.jsonl"
    tail = JsonlTail(path, max_line=200)
    _append(path, b"not json\n" + b"[1, 2]\n" + b"\n" + _line({"round": 1}))
    _append(path, b'{"round": 2, "pad": "' + b"x" * 300)  # overlong, still growing
    recs, _ = tail.poll()
    assert [r["round"] for r in recs] == [1]
    _append(path, b"x" * 300 + b'"}\n' + _line({"round": 3}))
    recs, _ = tail.poll()
    assert [r["round"] for r in recs] == [3]
    assert tail.malformed == 3  # "not json", a list, the overlong line (counted once)


def test_tail_starts_over_when_the_file_is_truncated_or_replaced(tmp_path):
    path = tmp_path / "a.jsonl"
    tail = JsonlTail(path)
    _append(path, _line({"round": 1}) + _line({"round": 2}))
    tail.poll()
    path.write_bytes(_line({"round": 1}))  # truncated and rewritten: a new run
    recs, reset = tail.poll()
    assert reset and [r["round"] for r in recs] == [1]
    new = tmp_path / "b.jsonl"
    new.write_bytes(_line({"round": 7}) + _line({"round": 8}))
    os.replace(new, path)  # replaced by another file (another inode)
    recs, reset = tail.poll()
    assert reset and [r["round"] for r in recs] == [7, 8]
    path.unlink()
    assert tail.poll() == ([], True)


def _run_dir(tmp_path: Path, overrides: list[str] | None = None) -> tuple[Path, list[str]]:
    cfg = load_topology("topologies/synthetic.yaml", overrides or [])
    run = tmp_path / "run"
    (run / "nodes").mkdir(parents=True)
    (run / "config.yaml").write_text(dump_topology(cfg))
    return run, cfg.node_ids


def _rec(r: int, acc, **extra) -> dict:
    return {"round": r, "test_acc": acc, "bytes_sent": 1000 * r, "round_s": 1.5, **extra}


def test_run_state_means_per_round_over_the_nodes_that_reported(tmp_path):
    run, ids = _run_dir(tmp_path)
    assert ids == ["a", "b", "c", "d"]
    nodes = run / "nodes"
    _append(nodes / "a.jsonl", _line(_rec(1, 0.5)) + _line(_rec(2, 0.7)))
    _append(nodes / "b.jsonl", _line(_rec(1, 0.7)))
    _append(nodes / "c.jsonl", _line(_rec(1, float("nan"))) + b"garbage\n")  # NaN: left out
    state = RunState(run)
    assert state.refresh()
    assert state.cfg is not None and state.node_ids == ids
    assert state.mean_by_round("test_acc") == [(1, 0.6), (2, 0.7)]
    assert state.series("a", "test_acc") == [(1, 0.5), (2, 0.7)]
    assert state.last_round("a") == 2 and state.last_round("d") == 0
    version = state.version
    assert not state.refresh() and state.version == version  # nothing changed
    _append(nodes / "b.jsonl", _line(_rec(2, 0.9)))
    assert state.refresh() and state.version == version + 1
    assert state.mean_by_round("test_acc") == [(1, 0.6), (2, 0.8)]
    # only the fields the page shows are kept
    method = {"divergence": {"a": 1.0}, "dropout": True, "h_peers": ["a"], "test_acc": 9}
    _append(nodes / "d.jsonl", _line(_rec(1, 0.1, dropout=True, method=method)))
    state.refresh()
    kept = state.records["d"][0]
    assert "divergence" not in kept and "method" not in kept and kept["dropout"]
    assert kept["h_peers"] == ["a"] and kept["test_acc"] == 0.1  # a method's fact never wins


def test_snapshot_of_a_finished_run_without_a_broker(tmp_path):
    run, ids = _run_dir(tmp_path, ["rounds=2"])
    nodes = run / "nodes"
    for nid in ("a", "b", "c"):
        _append(nodes / f"{nid}.jsonl", _line(_rec(1, 0.5)) + _line(_rec(2, 0.75)))
    _append(nodes / "d.jsonl", _line(_rec(1, 0.5)))  # d died after round 1
    state = RunState(run)
    state.refresh()
    assert not state.finished
    assert [node_state(state, None, n) for n in ids] == ["done", "done", "done", "unknown"]
    time.sleep(0.01)  # the summary is newer than the config
    write_json(run / "summary.json", {"final": {"acc_mean": float("nan")}, "nodes": 4})
    state.refresh()
    assert state.finished
    snap = build_snapshot(state, None, broker_note="records only")
    assert snap["status"] == "finished" and snap["kind"] is None
    assert [n["state"] for n in snap["nodes"]] == ["done", "done", "done", "offline"]
    assert snap["series"]["acc"]["mean"] == [[1, 0.5], [2, 0.75]]
    assert snap["edges"] == [["a", "b"], ["a", "d"], ["b", "c"], ["c", "d"]]
    assert all(0 <= n["x"] <= 1 and 0 <= n["y"] <= 1 for n in snap["nodes"])
    assert snap["summary"]["acc_mean"] is None  # NaN is not JSON
    json.dumps(snap, allow_nan=False)


def test_snapshot_states_from_presence_and_phases(tmp_path):
    run, ids = _run_dir(tmp_path, ["rounds=2"])
    _append(run / "nodes" / "a.jsonl", _line(_rec(1, 0.5)) + _line(_rec(2, 0.6)))
    state = RunState(run)
    state.refresh()
    live = LiveState("synthetic", ids)
    from p2pfl.dashboard.live import Phase, Presence

    live.presence = {
        "a": Presence("offline", 2, 0.0),  # offline after its last round: done
        "b": Presence("online", 1, 0.0),
        "c": Presence("online", None, 0.0),
        "d": Presence("offline", 0, 0.0),
    }
    live.phases = {"b": Phase("aggregating", 2, 0.0)}
    assert [node_state(state, live, n) for n in ids] == ["done", "aggregating", "online", "offline"]
    # gone after announcing its last round, before its record was read: done as well
    live.presence["d"] = Presence("offline", 2, 0.0)
    assert node_state(state, live, "d") == "done"


def test_centralized_aggregators_and_uapdfl_decisions(tmp_path):
    run, ids = _run_dir(tmp_path, ["rounds=2"])
    nodes = run / "nodes"
    for nid in ids:  # round 1: c aggregates; round 2: d after a failover (attempt 1)
        recs = [_rec(1, 0.5, aggregator="c", attempt=0), _rec(2, 0.6, aggregator="d", attempt=1)]
        _append(nodes / f"{nid}.jsonl", b"".join(_line(r) for r in recs))
    state = RunState(run)
    state.refresh()
    snap = build_snapshot(state, None)
    assert snap["kind"] == "centralized"
    assert snap["aggregators"] == [
        {"round": 1, "node": "c", "attempt": 0},
        {"round": 2, "node": "d", "attempt": 1},
    ]
    assert snap["decisions"] == []

    run2 = tmp_path / "two"
    run2.mkdir()
    (run2 / "nodes").mkdir()
    (run2 / "config.yaml").write_text((run / "config.yaml").read_text())
    uapdfl = {  # a: this version's layout (the method's facts under "method"); b: an older run's
        "a": _rec(
            1,
            0.5,
            chosen=["b", "d"],
            dropout=True,
            method={"dropout": True, "dropout_peer": "b", "h_peers": [], "divergence": {}},
        ),
        "b": _rec(
            1,
            0.5,
            chosen=["a", "c"],
            dropout=False,
            dropout_peer=None,
            h_peers=["a", "zz"],  # an unknown id is dropped
            pulled={"a": "all", "c": "g"},
        ),
    }
    for nid, rec in uapdfl.items():
        _append(run2 / "nodes" / f"{nid}.jsonl", _line(rec))
    state2 = RunState(run2)
    state2.refresh()
    snap = build_snapshot(state2, None)
    assert snap["kind"] == "decentralized"
    assert snap["decisions"] == [
        {
            "round": 1,
            "node": "a",
            "dropout": True,
            "dropout_peer": "b",
            "h_peers": [],
            "pulled": {},
        },
        {
            "round": 1,
            "node": "b",
            "dropout": False,
            "dropout_peer": None,
            "h_peers": ["a"],
            "pulled": {"a": "all", "c": "g"},
        },
    ]
    assert snap["last_pulls"] == [
        {"from": "a", "to": "b", "part": "all", "round": 1},
        {"from": "c", "to": "b", "part": "g", "round": 1},
    ]


def test_a_missing_or_broken_config_is_reported_not_raised(tmp_path):
    state = RunState(tmp_path)
    state.refresh()
    assert state.cfg is None
    assert build_snapshot(state, None)["status"] == "waiting for config.yaml"
    (tmp_path / "config.yaml").write_text("nodes: [a, a]\nedges: {kind: nope}\n")
    state.refresh()
    assert state.cfg is None and state.config_error.startswith("config.yaml")
    assert build_snapshot(state, None)["nodes"] == []
