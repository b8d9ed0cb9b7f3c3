"""The paper-reproduction benchmark's table and suites, without running a swarm."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_accuracy", ROOT / "scripts/bench_accuracy.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_accuracy"] = mod  # pydantic resolves the models' annotations there
    spec.loader.exec_module(mod)
    return mod


def _row(acc, std, paper, rounds, paper_rounds):
    return {
        "paper": paper,
        "acc_mean": acc,
        "acc_std": std,
        "per_seed": [acc],
        "rounds": rounds,
        "paper_rounds": paper_rounds,
        "wall_s": 61.0,
        "bytes_sent": 2_500_000,
        "nodes_completed": 30,
        "nodes": 30,
        "curve": [
            {"round": 1, "acc_mean": 0.3, "bytes_sent": 1_000_000, "nodes": 30},
            {"round": 2, "acc_mean": acc / 100, "bytes_sent": 2_500_000, "nodes": 30},
        ],
    }


def test_table_from_a_tiny_result_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # one table row per line
    bench = _bench()
    result = {
        "suite": "fake-suite",
        "rounds": 2,
        "paper_rounds": 150,
        "seeds": [0, 1],
        "metric": "final",
        "source": "a paper, Table 9",
        "note": "JPEG-recompressed",
        "methods": {
            "fedavg": _row(60.0, 1.5, 67.16, 2, 150),
            "uapdfl": _row(75.5, 0.25, 74.85, 150, 150),
            "local": _row(50.0, 0.0, None, 2, 150),
        },
    }
    path = tmp_path / "fake.json"
    path.write_text(json.dumps(result))
    assert bench.main(["--from-json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "67.16" in out and "60.00 ± 1.50" in out and "-7.16" in out
    assert "+0.65" in out  # 75.5 - 74.85
    assert "2 (short)" in out  # a shortened run is never shown as the paper's setting
    assert "JPEG-recompressed" in out and "2.5 MB" in out
    assert (tmp_path / "fake.png").stat().st_size > 0
