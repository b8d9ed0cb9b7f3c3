"""scripts/bench_audit.py's arithmetic on hand-made records (the swarm runs are the
benchmark's, not the suite's)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_audit import run_metrics, summarise  # noqa: E402


def rec(round_no, round_s, sent, audit=None, acc=0.5):
    out = {"round": round_no, "round_s": round_s, "bytes_sent": sent, "test_acc": acc}
    if audit is not None:
        out["audit"] = audit
    return out


def test_costs_split_the_auditor_from_the_members():
    records = {
        "a": [
            rec(1, 1.0, 100, {"auditor": "a", "verdict": "ok", "audit_s": 0.4, "audit_bytes": 300}),
            rec(2, 3.0, 100, {"auditor": "b", "verdict": "ok", "audit_s": 0.2}),
        ],
        "b": [
            rec(1, 2.0, 50, {"auditor": "a", "verdict": "ok", "audit_s": 0.3}),
            rec(
                2,
                2.0,
                50,
                {"auditor": "b", "verdict": "mismatch", "audit_s": 0.6, "audit_bytes": 500},
                acc=0.7,
            ),
        ],
    }
    m = run_metrics(records)
    assert m["round_s"] == 2.0 and m["bytes_per_round"] == 150
    assert m["auditor_s"] == 0.5 and m["auditor_bytes"] == 400
    assert m["member_wait_s"] == 0.25 and m["verdicts"] == ["mismatch", "ok"]
    assert m["accuracy"] == 0.6


def test_without_audit_the_audit_columns_are_empty_and_the_ratio_compares_medians():
    off = {"a": [rec(1, 1.0, 100)], "b": [rec(1, 1.0, 100)]}
    m = run_metrics(off)
    assert m["auditor_s"] is None and m["member_wait_s"] is None and m["verdicts"] == []
    runs = [
        {"audit": False, **m},
        {"audit": True, **{**m, "round_s": 1.5, "bytes_per_round": 300.0, "auditor_s": 0.2}},
    ]
    s = summarise(runs)
    assert s["ratio"] == {"round_s": 1.5, "bytes_per_round": 1.5}
    assert s["on"]["auditor_s"] == 0.2 and s["off"]["auditor_s"] is None
