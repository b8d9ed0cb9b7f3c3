"""The scale benchmark on a tiny swarm: real node processes and broker, every row filled."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.integration


def test_two_small_sizes_run_and_report(tmp_path, load_script):
    bench = load_script("bench_scale")
    out = tmp_path / "scale.json"
    assert bench.main(["--nodes", "5,3", "--repeats", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    small, large = doc["sizes"]
    assert (small["nodes"], large["nodes"]) == (3, 5)
    for row in doc["sizes"]:
        assert row["exit"] == 0 and row["nodes_completed"] == row["nodes"]
        assert row["round_s_median"] > 0 and row["peak_pss_mb"] > 0
        # a ring: each node hears two neighbours, and weights took the direct lane
        assert 0 < row["broker_out_mb_per_round"] < row["mb_per_round"]
        assert len(row["runs_wall_s"]) == 1
    assert "mb_per_node" in large and "mb_per_node" not in small


def test_method_and_fraction_options(tmp_path, load_script):
    """``--method fedavg --fraction 0.5``: the centralized method with half the members
    drawn each round (2 of 4 train), named in the results."""
    bench = load_script("bench_scale")
    assert bench.method_overrides(None, None) == []
    assert bench.method_overrides("fedavg", 0.1) == [
        "algorithm.name=fedavg",
        "algorithm.params={}",
        "algorithm.params.fraction=0.1",
    ]
    out = tmp_path / "scale.json"
    argv = ["--nodes", "4", "--repeats", "1", "--method", "fedavg", "--fraction", "0.5"]
    assert bench.main([*argv, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert (doc["method"], doc["fraction"]) == ("fedavg", 0.5)
    (row,) = doc["sizes"]
    assert row["method"] == "fedavg" and row["exit"] == 0 and row["nodes_completed"] == 4
    assert row["trained_per_round"] == 2


def test_median_of_runs(load_script):
    bench = load_script("bench_scale")
    runs = [
        {"nodes": 4, "processes": 2, "exit": 0, "nodes_completed": 4, "wall_s": w, "x": x}
        for w, x in ((3.0, 1), (9.0, 5), (4.0, 2))
    ]
    runs[1]["exit"], runs[1]["nodes_completed"] = 1, 3
    row = bench.median_of(runs)
    assert (row["wall_s"], row["x"], row["exit"], row["nodes_completed"]) == (4.0, 2, 1, 3)
    assert row["runs_wall_s"] == [3.0, 9.0, 4.0]
