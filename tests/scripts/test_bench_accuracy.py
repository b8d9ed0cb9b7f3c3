"""The paper-reproduction benchmark's table and suites, without running a swarm."""

from __future__ import annotations

import json

import pytest


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


def test_table_from_a_tiny_result_file(tmp_path, capsys, monkeypatch, load_script):
    monkeypatch.setenv("COLUMNS", "200")  # one table row per line
    bench = load_script("bench_accuracy")
    result = {
        "suite": "fake-suite",
        "rounds": 2,
        "paper_rounds": 150,
        "seeds": [0, 1],
        "metric": "final",
        "source": "a paper, Table 9",
        "note": "JPEG-recompressed",
        "methods": {
            "fedavg": {**_row(60.0, 1.5, 67.16, 2, 150), "per_seed": [58.5, 61.5]},
            "uapdfl": _row(75.5, 0.25, 74.85, 150, 150),
            "local": _row(50.0, 0.0, None, 2, 150),
        },
    }
    path = tmp_path / "fake.json"
    path.write_text(json.dumps(result))
    assert bench.main(["--from-json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "67.16" in out and "60.00 ± 1.50" in out and "-7.16" in out
    assert "58.50 61.50 (Δ 3.00)" in out  # the seed spread of a row run with several seeds
    assert "+0.65" in out  # 75.5 - 74.85
    assert "2 (short)" in out  # a shortened run is never shown as the paper's setting
    assert "JPEG-recompressed" in out and "2.5 MB" in out
    assert (tmp_path / "fake.png").stat().st_size > 0


def test_merge_of_parts_run_separately(tmp_path, capsys, monkeypatch, load_script):
    monkeypatch.setenv("COLUMNS", "200")
    bench = load_script("bench_accuracy")
    common = {
        "suite": "uapdfl-cnn-cifar10-a0.5",
        "rounds": 50,
        "paper_rounds": 150,
        "seeds": [0],
        "metric": "final",
        "source": "UA-PDFL Table 1",
        "note": "",
    }
    a = {**common, "wall_s": 300.0, "methods": {"uapdfl": _row(64.2, 0, 74.85, 50, 150)}}
    variant = {**_row(73.2, 0, 74.85, 50, 150), "note": "th_I 0.5 ablation"}
    b = {
        **common,
        "wall_s": 400.0,
        "methods": {"uapdfl-thI0.5": variant, "local": _row(65.0, 0, 65.06, 50, 150)},
    }
    pa, pb, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "merged.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    assert bench.main(["--from-json", str(pa), str(pb), "--json", str(out)]) == 0
    merged = json.loads(out.read_text())
    # the suite's order (local first, the variant after uapdfl); the longest part's wall time
    assert list(merged["methods"]) == ["local", "uapdfl", "uapdfl-thI0.5"]
    assert merged["wall_s"] == 400.0 and merged["merged_from"] == 2
    text = capsys.readouterr().out
    assert "uapdfl-thI0.5: th_I 0.5 ablation" in text  # a variant's note is shown
    other = {**b, "rounds": 10}
    pb.write_text(json.dumps(other))
    with pytest.raises(SystemExit):  # parts of different lengths are not one result
        bench.main(["--from-json", str(pa), str(pb)])
    b["methods"] = {"uapdfl": b["methods"]["local"]}
    pb.write_text(json.dumps(b))
    with pytest.raises(SystemExit):  # a method measured twice
        bench.main(["--from-json", str(pa), str(pb)])


def test_variant_rows_run_their_algorithm_with_their_knobs(load_script):
    bench = load_script("bench_accuracy")
    suites, _ = bench.load_suites()
    suite = suites["uapdfl-cnn-cifar10-a0.5"]
    spec = suite.methods["uapdfl-thI0.5"]
    over = bench.method_overrides(suite, "uapdfl-thI0.5", spec, "uapdfl")
    assert "algorithm.params.th_I=0.5" in over
    assert not any(o.startswith("algorithm.name=") for o in over)  # the topology's method
    dfed = bench.method_overrides(suite, "dfedavgm", suite.methods["dfedavgm"], "uapdfl")
    assert "algorithm.name=dfedavgm" in dfed and "algorithm.params={}" in dfed
    for name, s in suites.items():  # every row names a registered method
        for row, spec in s.methods.items():
            from p2pfl.algorithms import known_algorithms

            assert (spec.algorithm or row) in known_algorithms(), (name, row)


def test_a_row_whose_runs_skipped_rounds_is_flagged(tmp_path, capsys, monkeypatch, load_script):
    """A run that skipped node-rounds (nodes that caught up under load) is flagged in the
    table, its caption and the result file; one that skipped none, or an older result file
    that does not say, is not."""
    monkeypatch.setenv("COLUMNS", "250")
    bench = load_script("bench_accuracy")
    spec = bench.MethodSpec(paper=65.0)
    run = {
        "final": {"acc_mean": 0.5},
        "best_acc_mean": 0.6,
        "rounds_reached": 20,
        "wall_s": 10.0,
        "bytes_sent_total": 0,
        "nodes_completed": 20,
        "nodes": 20,
        "curve": [{"round": 20, "acc_mean": 0.5, "bytes_sent": 0, "nodes": 20}],
    }
    clean = bench.method_result(spec, [{**run, "rounds_skipped": {"total": 0}}] * 2, "final")
    assert clean["rounds_skipped_per_seed"] == [0, 0] and clean["load_dependent"] is False
    assert bench.skip_flag(clean) == ""
    skipped = {**run, "rounds_skipped": {"total": 196, "per_node": {"n3": 196}}}
    loaded = bench.method_result(spec, [{**run, "rounds_skipped": {"total": 0}}, skipped], "final")
    assert loaded["rounds_skipped_per_seed"] == [0, 196] and loaded["load_dependent"] is True
    assert bench.skip_flag(loaded) == "⚠ 196 skipped"
    old = bench.method_result(spec, [run], "final")  # a summary from before the count
    assert old["rounds_skipped_per_seed"] == [None] and old["load_dependent"] is False
    assert bench.skip_flag(old) == "" and bench.skip_flag({"rounds": 3}) == ""
    assert bench.skipped_of({"rounds_skipped": {"total": True}}) is None  # not a count

    result = {
        "suite": "fake-suite",
        "rounds": 20,
        "paper_rounds": 20,
        "seeds": [0, 1],
        "metric": "final",
        "source": "a paper",
        "note": "",
        "methods": {
            "local": {**loaded, "paper_rounds": 20},
            "fedavg": {**clean, "paper_rounds": 20},
        },
    }
    merged = bench.merge_results([result, {**result, "methods": {}}])
    assert merged["load_dependent"] == ["local"]
    path = tmp_path / "fake.json"
    path.write_text(json.dumps(result))
    assert bench.main(["--from-json", str(path)]) == 0
    out = capsys.readouterr().out
    local_row = next(line for line in out.splitlines() if line.strip("│ ").startswith("local"))
    fedavg_row = next(line for line in out.splitlines() if line.strip("│ ").startswith("fedavg"))
    assert "⚠ 196 skipped" in local_row and "skipped" not in fedavg_row
    assert "local: node-rounds skipped under load (seed 1: 196; of 400 per seed)" in out
    assert "depends on the machine's load" in out
