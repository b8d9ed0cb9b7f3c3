"""Round records on a disk that fails: whole lines or nothing, kept and retried in order."""

from __future__ import annotations

import errno
import json
import os

import pytest

from p2pfl import metrics
from p2pfl.metrics import RecordLog, append_record, read_records, summarize


def test_a_failed_append_leaves_no_torn_line(tmp_path, monkeypatch):
    path = tmp_path / "n.jsonl"
    append_record(path, {"round": 1})
    real_write = os.write

    def half_then_full(fd, data):  # the disk fills up in the middle of the line
        real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(metrics.os, "write", half_then_full)
    with pytest.raises(OSError):
        append_record(path, {"round": 2, "test_acc": 0.5})
    assert path.read_text() == '{"round":1}\n'


def test_record_log_keeps_records_until_the_disk_takes_them(tmp_path, monkeypatch, caplog):
    path = tmp_path / "nodes" / "a.jsonl"
    log = RecordLog(path)
    assert log.append({"round": 1})
    full = {"on": True}
    real_write = os.write

    def write(fd, data):
        if full["on"]:
            real_write(fd, bytes(data[:3]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(metrics.os, "write", write)
    assert not log.append({"round": 2})
    assert not log.append({"round": 3})
    assert [r["round"] for r in log.pending] == [2, 3] and log.failures == 2
    assert "kept in memory" in caplog.text
    assert [json.loads(x)["round"] for x in path.read_text().splitlines()] == [1]
    full["on"] = False
    assert log.append({"round": 4})
    assert [r["round"] for r in read_records(path)] == [1, 2, 3, 4]
    assert path.read_text().count("\n") == 4 and not log.pending


def test_summary_of_a_partial_run_skips_what_it_cannot_use(tmp_path):
    nodes = tmp_path / "nodes"
    nodes.mkdir()
    good = {"round": 1, "test_acc": 0.5, "bytes_sent": 10, "t": 100.0, "round_s": 1.0}
    (nodes / "a.jsonl").write_text(json.dumps(good) + "\n" + '{"round": 2, "te')  # torn
    (nodes / "b.jsonl").write_text('{"round": 1}\n')  # no accuracy: not summarizable
    s = summarize(tmp_path, algorithm="x", expected_nodes=["a", "b", "c"], rounds=2)
    assert s["final"]["acc_mean"] == 0.5 and s["nodes_completed"] == 0
    assert s["nodes_incomplete"] == ["a", "b", "c"] and s["bytes_sent_total"] == 10


def test_finish_run_reports_a_summary_it_cannot_write(tmp_path):
    """A full disk (here: summary.json cannot be created) is reported, never raised: the
    launcher still prints the summary of what the nodes recorded."""
    from rich.console import Console

    from p2pfl.check.load import load_topology
    from p2pfl.launch.swarm import finish_run

    cfg = load_topology("topologies/synthetic.yaml")
    nodes = tmp_path / "nodes"
    nodes.mkdir()
    rec = {"round": 3, "test_acc": 0.75, "bytes_sent": 5, "t": 10.0}
    (nodes / "a.jsonl").write_text(json.dumps(rec) + "\n")
    (nodes / "b.meta.json").write_text('{"train_hist": [1')  # torn
    (tmp_path / "summary.json").mkdir()  # writing it fails with an OSError
    console = Console(record=True, width=200)
    summary = finish_run(cfg, tmp_path, 1.0, console)
    assert summary["final"]["acc_mean"] == 0.75 and summary["nodes_completed"] == 1
    assert "could not write the summary" in console.export_text()


def test_the_summary_has_epsilon_under_privacy_only(tmp_path):
    from p2pfl.metrics import append_record, summarize

    base = {"test_acc": 0.5, "bytes_sent": 1, "t": 1.0}
    for nid, eps in (("a", [0.3, 0.6]), ("b", [0.4, 0.4])):
        for r, e in enumerate(eps, 1):
            extra = {"dp_exhausted": True} if nid == "b" and r == 2 else {}
            append_record(
                tmp_path / "nodes" / f"{nid}.jsonl", {"round": r, **base, "epsilon": e, **extra}
            )
    summary = summarize(tmp_path, algorithm="uapdfl", expected_nodes=["a", "b"], rounds=2)
    assert summary["epsilon"] == {
        "max": 0.6,
        "mean": 0.5,
        "per_node": {"a": 0.6, "b": 0.4},
        "exhausted": ["b"],
    }
    plain = tmp_path / "plain"
    append_record(plain / "nodes" / "a.jsonl", {"round": 1, **base})
    assert "epsilon" not in summarize(plain, algorithm="fedavg", expected_nodes=["a"], rounds=1)


def test_the_summary_counts_the_node_rounds_each_node_skipped(tmp_path):
    from p2pfl.metrics import skipped_note

    base = {"test_acc": 0.5, "bytes_sent": 1, "t": 1.0}
    rounds = {
        "a": [1, 2, 3, 4, 5, 6],  # every round
        "b": [1, 5, 6],  # caught up from round 2 to 5
        "c": [4, 5, 6],  # joined at round 4
        "d": [1, 2],  # stopped early: incomplete, not skipped
    }
    for nid, rs in rounds.items():
        for r in rs:
            append_record(tmp_path / "nodes" / f"{nid}.jsonl", {"round": r, **base})
    summary = summarize(tmp_path, algorithm="uapdfl", expected_nodes=list(rounds), rounds=6)
    assert summary["rounds_skipped"] == {"total": 6, "per_node": {"b": 3, "c": 3}}
    assert summary["nodes_incomplete"] == ["d"]
    note = skipped_note(summary)
    assert note is not None and note.startswith("6 of 24 node-rounds skipped")
    assert note.endswith(": b 3, c 3")
    # a run that skipped nothing says so with a zero, and has no note
    whole = tmp_path / "whole"
    for r in (1, 2):
        append_record(whole / "nodes" / "a.jsonl", {"round": r, **base})
    summary = summarize(whole, algorithm="local", expected_nodes=["a"], rounds=2)
    assert summary["rounds_skipped"] == {"total": 0, "per_node": {}}
    assert skipped_note(summary) is None
    assert skipped_note({"final": {}}) is None  # an older run's summary does not say
