"""The method-comparison benchmark's table, on a tiny fake run directory."""

from __future__ import annotations

import json


def test_from_runs_tabulates_and_writes_json(tmp_path, capsys, load_script):
    bench = load_script("bench_methods")
    for method, acc in (("fedavg", 0.5), ("fedper", 0.75)):
        d = tmp_path / "runs" / method
        d.mkdir(parents=True)
        summary = {
            "rounds_reached": 10,
            "final": {"acc_mean": acc, "acc_std": 0.1},
            "best_acc_mean": acc + 0.01,
            "wall_s": 12.0,
            "bytes_sent_total": 3_000_000,
            "nodes_completed": 8,
            "nodes": 8,
        }
        (d / "summary.json").write_text(json.dumps(summary))
    out = tmp_path / "res.json"
    args = ["t.yaml", "--methods", "fedavg,fedper", "--out", str(tmp_path / "runs")]
    assert bench.main([*args, "--from-runs", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "0.7500 ± 0.1000" in text and "3.0 MB" in text
    rows = json.loads(out.read_text())["methods"]
    assert rows["fedper"]["acc_mean"] == 0.75 and rows["fedavg"]["rounds"] == 10
