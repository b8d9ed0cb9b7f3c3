"""The robustness benchmark (scripts/bench_robust.py): its grid, its metrics from hand-made
records, its resume logic, and one tiny real run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from p2pfl.check.load import load_topology

ROOT = Path(__file__).resolve().parents[2]


def _grid(bench, **kw):
    args = {
        "topology": "topologies/synthetic.yaml",
        "partitions": ["dirichlet(0.5)", "dirichlet(0.1)"],
        "nodes": 20,
        "methods": ["uapdfl", "fedavg"],
        "defences": ["clip", "median"],
        "attacks": ["none", "nan", "aggregator"],
        "fractions": [0.0, 0.1, 0.2],
        "seeds": [0],
        "rounds": 3,
        "is_centralized": lambda m: m == "fedavg",
    }
    return bench.expand_grid(**{**args, **kw})


def test_grid_runs_the_clean_run_once_and_the_aggregator_only_when_centralized(load_script):
    bench = load_script("bench_robust")
    runs = _grid(bench)
    # per (partition, defence): uapdfl 1 clean + 2 fractions x nan; fedavg 1 + 2 x 2
    assert len(runs) == 2 * 2 * (3 + 5)
    assert len({bench.run_key(s) for s in runs}) == len(runs)
    clean = [s for s in runs if s["attack"] == "none"]
    assert len(clean) == 2 * 2 * 2  # one per (partition, method, defence), not per attack
    assert all(s["fraction"] == 0.0 and s["attackers"] is None for s in clean)
    assert not any(s["attack"] == "aggregator" and s["method"] == "uapdfl" for s in runs)
    assert sum(s["attack"] == "aggregator" for s in runs) == 2 * 2 * 2  # fedavg x 2 fractions
    assert {s["fraction"] for s in runs if s["attack"] == "nan"} == {0.1, 0.2}
    # seeds multiply every run
    assert len(_grid(bench, seeds=[0, 1])) == 2 * len(runs)


def test_grid_references_and_named_attackers(load_script):
    bench = load_script("bench_robust")
    # no clean run asked for: the reference is still there, unless left out
    only = _grid(bench, attacks=["nan"], fractions=[0.2], partitions=["iid"], defences=["clip"])
    assert [s["attack"] for s in only] == ["none", "nan", "none", "nan"]
    bare = _grid(
        bench,
        attacks=["nan"],
        fractions=[0.2],
        partitions=["iid"],
        defences=["clip"],
        reference=False,
    )
    assert [s["attack"] for s in bare] == ["nan", "nan"]
    asked = _grid(bench, attacks=["nan"], fractions=[0, 0.2], partitions=["iid"], reference=False)
    assert sum(s["attack"] == "none" for s in asked) == 4
    # a reference defence adds its clean run once per (partition, method, seed)
    ref = _grid(
        bench, attacks=["nan"], fractions=[0.2], partitions=["iid"], reference_defence="mean"
    )
    assert sum(s["attack"] == "none" and s["defence"] == "mean" for s in ref) == 2
    # the acceptance setting: one named attacker of 8 instead of fractions
    acc = _grid(
        bench,
        nodes=8,
        attacks=["none", "nan", "scale"],
        fractions=[0.0],
        attacker_nodes=["n3"],
        partitions=["dirichlet(0.5)"],
        defences=["clip"],
    )
    hostile = [s for s in acc if s["attack"] != "none"]
    assert len(hostile) == 4 and all(s["attackers"] == ["n3"] for s in hostile)
    assert all(s["fraction"] == 1 / 8 for s in hostile)
    with pytest.raises(ValueError, match="unknown attacks"):
        _grid(bench, attacks=["nope"])
    with pytest.raises(ValueError, match="unknown defences"):
        _grid(bench, defences=["krum"])


def test_cli_parsers(load_script):
    bench = load_script("bench_robust")
    assert bench.split_list("a, dirichlet(0.5),b") == ["a", "dirichlet(0.5)", "b"]
    assert bench.split_list("dirichlet(0.5),dirichlet(0.1)") == ["dirichlet(0.5)", "dirichlet(0.1)"]
    for text in ("0.5", "dir0.5", "Dir(0.5)", "dirichlet(0.5)"):
        assert bench.partition_spec(text) == "dirichlet(0.5)"
    assert bench.partition_spec("iid") == "iid"
    assert bench.fraction_of("20%") == 0.2 and bench.fraction_of("0.1") == 0.1
    with pytest.raises(ValueError):
        bench.fraction_of("1.5")


def test_overrides_build_the_intended_topology(load_script):
    bench = load_script("bench_robust")
    runs = _grid(
        bench,
        methods=["uapdfl", "fedavg"],
        attacks=["aggregator", "label_flip_targeted"],
        fractions=[0.1],
        partitions=["dirichlet(0.1)"],
        defences=["median"],
        train_per_node=50,
        extra=["edges=full"],
    )
    by = {(s["method"], s["attack"]): s for s in runs}
    path = ROOT / "topologies/synthetic.yaml"
    # the base topology runs uapdfl: its knobs are kept; fedavg gets its defaults
    over = bench.overrides_of(by[("uapdfl", "label_flip_targeted")], "uapdfl")
    assert not any(o.startswith("algorithm.") for o in over)
    cfg = load_topology(path, over)
    assert cfg.algorithm.params["com"] == 2 and cfg.defence.rule == "median"
    assert (cfg.dataset.partition, cfg.dataset.train_per_node, cfg.rounds) == (
        "dirichlet(0.1)",
        50,
        3,
    )
    attackers = cfg.attackers()
    assert len(attackers) == 2  # 10% of 20
    (spec,) = next(iter(attackers.values()))
    assert (spec.kind, spec.source, spec.target) == ("label_flip", 0, 2)
    agg = load_topology(path, bench.overrides_of(by[("fedavg", "aggregator")], "uapdfl"))
    assert agg.algorithm.name == "fedavg"
    (spec,) = next(iter(agg.attackers().values()))
    assert (spec.kind, getattr(spec, bench.result_field())) == ("nan", "result")
    clean = load_topology(path, bench.overrides_of(by[("fedavg", "none")], "uapdfl"))
    assert clean.attacks == [] and clean.attackers() == {}
    named = bench.clean_settings(by[("fedavg", "none")])
    named.update(attack="scale", attackers=["n3"], fraction=1 / 20)
    cfg = load_topology(path, bench.overrides_of(named, "uapdfl"))
    assert list(cfg.attackers()) == ["n3"] and cfg.attackers()["n3"][0].factor == 100


def _dec(rnd, acc, pulled, rejected, **kw):
    return {"round": rnd, "test_acc": acc, "pulled": pulled, "rejected": rejected, **kw}


def test_metrics_of_decentralized_records(load_script):
    bench = load_script("bench_robust")
    records = {
        "a": [
            _dec(1, 0.5, {"b": "full"}, {"c": "clip: distance", "d": "non-finite"}),
            _dec(2, 0.8, {"b": "full", "c": "full"}, {"d": "non-finite"}),
        ],
        "b": [_dec(1, 0.4, {"a": "full", "d": "shared"}, {}), _dec(2, 0.6, {"a": "full"}, {})],
        "c": [_dec(1, 0.3, {}, {}), _dec(2, 0.7, {}, {"a": "norm", "c": "own"})],
        # the attacker's own records never count, whatever they say
        "d": [_dec(1, 0.1, {"a": "full"}, {"a": "x", "b": "y"}, attack=["nan"])],
    }
    m = bench.run_metrics(records, ["a", "b", "c", "d"], ["d"])
    assert (m["honest_nodes"], m["honest_reported"], m["attackers"]) == (3, 3, ["d"])
    assert m["acc_mean"] == pytest.approx(0.7) and m["acc_worst"] == 0.6
    assert m["acc_final"] == {"a": 0.8, "b": 0.6, "c": 0.7}
    # honest peers considered: a: {b, c} + {b, c}; b: {a} + {a}; c: {} + {a}  -> 7
    # refused: a/r1 c, c/r2 a -> 2 (c refusing itself is not a peer)
    assert (m["false_rejections"], m["honest_considered"]) == (2, 7)
    assert m["false_rejection"] == pytest.approx(2 / 7)
    # attacker: a/r1 and a/r2 refused d, b/r1 admitted d -> 2 of 3
    assert (m["attacker_rejections"], m["attacker_considered"]) == (2, 3)
    assert m["rounds_reached"] == 2


def test_metrics_of_centralized_records(load_script):
    bench = load_script("bench_robust")

    def rec(rnd, acc, aggregator, aggregated, rejected, received=True):
        return {
            "round": rnd,
            "test_acc": acc,
            "aggregator": aggregator,
            "aggregated": aggregated,
            "participated": True,
            "received": received,
            "rejected": rejected,
            "failovers": [],
        }

    everyone = ["a", "b", "c", "d"]
    records = {
        # a aggregated round 1: the uploads of b, c (and d, refused); a's own does not count
        "a": [rec(1, 0.9, "a", everyone, {"d": "non-finite"}), rec(2, 0.9, "c", everyone, {})],
        # b applied a's result in round 1; in round 2 it refused c's honest result (failover)
        # and applied d's
        "b": [
            rec(1, 0.5, "a", everyone, {}),
            rec(2, 0.7, "d", everyone, {"c": "result: norm"}),
        ],
        # c: round 1 applied a's; round 2 c aggregated, its defence dropping b and d
        "c": [
            rec(1, 0.6, "a", everyone, {}),
            rec(2, 0.8, "c", everyone, {"b": "clip: distance", "d": "clip: distance"}),
        ],
        "d": [rec(1, 0.2, "a", everyone, {}), rec(2, 0.2, "c", everyone, {})],
    }
    # an observer round with no result: nothing considered
    records["a"].append(rec(3, 0.9, None, [], {}, received=False))
    m = bench.run_metrics(records, everyone, ["d"])
    assert m["acc_mean"] == pytest.approx((0.9 + 0.7 + 0.8) / 3) and m["acc_worst"] == 0.7
    # considered honest: a/r1 {b, c}; a/r2 {c}; b/r1 {a}; b/r2 {c} (refused, d not honest);
    # c/r1 {a}; c/r2 {a, b}  -> 8; refused honest: b/r2 c, c/r2 b -> 2
    assert (m["false_rejections"], m["honest_considered"]) == (2, 8)
    # attacker: a/r1 d refused, b/r2 d applied, c/r2 d refused -> 2 of 3
    assert (m["attacker_rejections"], m["attacker_considered"]) == (2, 3)
    none = bench.run_metrics({}, everyone, ["d"])
    assert none["acc_mean"] is None and none["false_rejection"] is None


def _run(bench, settings, finals, **metrics):
    accs = list(finals.values())
    return {
        "key": bench.run_key(settings),
        "settings": settings,
        "wall_s": metrics.pop("wall_s", 10.0),
        "exit_code": 0,
        "metrics": {
            "acc_final": finals,
            "acc_mean": sum(accs) / len(accs),
            "acc_worst": min(accs),
            **metrics,
        },
    }


def test_deltas_use_the_same_honest_nodes_and_medians_go_over_seeds(load_script):
    bench = load_script("bench_robust")
    base = _grid(bench, attacks=["nan"], fractions=[0.25], partitions=["iid"], defences=["clip"])
    base = [s for s in base if s["method"] == "uapdfl"]
    clean0, nan0 = base
    runs = []
    for seed, drop in ((0, 0.1), (1, 0.2), (2, 0.3)):
        c = {**clean0, "seed": seed}
        a = {**nan0, "seed": seed}
        runs.append(_run(bench, c, {"a": 0.8, "b": 0.6, "c": 0.7, "d": 0.1}, asr=0.05))
        runs.append(
            _run(
                bench,
                a,
                {"a": 0.8 - drop, "b": 0.6 - drop, "c": 0.7 - drop},
                false_rejection=0.1 * seed if seed else None,
                wall_s=5.0 * (seed + 1),
            )
        )
    bench.with_deltas(runs, None)
    attacked = [r for r in runs if r["settings"]["attack"] == "nan"]
    # the clean side averages a, b, c only (0.7), not d
    assert [r["metrics"]["clean_acc_mean"] for r in attacked] == [pytest.approx(0.7)] * 3
    assert [r["metrics"]["delta_pts"] for r in attacked] == [
        pytest.approx(-10),
        pytest.approx(-20),
        pytest.approx(-30),
    ]
    assert all(
        r["reference"] == bench.run_key({**clean0, "seed": r["settings"]["seed"]}) for r in attacked
    )
    rows = {r["settings"]["attack"]: r for r in bench.medians_over_seeds(runs)}
    assert rows["nan"]["seeds"] == [0, 1, 2]
    assert rows["nan"]["delta_pts"] == pytest.approx(-20)
    assert rows["nan"]["false_rejection"] == pytest.approx(0.15)  # None left out
    assert rows["nan"]["wall_s"] == 10.0 and rows["nan"]["asr"] is None
    assert rows["none"]["asr"] == 0.05 and rows["none"]["delta_pts"] == pytest.approx(0)
    # a run without its clean reference has no delta
    lone = [r for r in runs if r["settings"]["attack"] == "nan"][:1]
    bench.with_deltas(lone, None)
    assert lone[0]["metrics"]["delta_pts"] is None and lone[0]["reference"] is None
    # the reference defence picks another clean run
    bench.with_deltas(runs, "median")
    assert all(r["metrics"]["delta_pts"] is None for r in attacked)


def test_asr_counts(load_script):
    bench = load_script("bench_robust")
    labels = torch.tensor([0, 0, 0, 0, 2, 1])
    pred = torch.tensor([2, 2, 0, 1, 2, 2])
    assert bench.asr_counts(pred, labels, 0, 2) == (2, 4)
    assert bench.asr_counts(pred, labels, 3, 2) == (0, 0)


def test_resume_skips_runs_already_in_the_json(tmp_path, load_script, monkeypatch, capsys):
    bench = load_script("bench_robust")
    s = _grid(bench)[0]
    assert bench.run_key(dict(reversed(list(s.items())))) == bench.run_key(s)  # order-free
    for field, value in (("seed", 1), ("defence", "mean"), ("set", ["edges=ring"])):
        assert bench.run_key({**s, field: value}) != bench.run_key(s)
    failed = {"key": "x", "metrics": None}
    assert bench.done_keys({"runs": [failed, {"key": "y", "metrics": {}}]}) == {"y"}

    calls = []

    def fake_run(settings, args, console):
        calls.append(settings)
        accs = {"n0": 0.5, "n1": 0.7, "n2": 0.6, "n3": 0.4}
        if settings["attackers"]:  # n3 attacks; the honest nodes lose 5 points each
            accs = {n: a - 0.05 for n, a in accs.items() if n != "n3"}
        run = _run(bench, settings, accs, false_rejection=0.0, wall_s=1.0)
        return {**run, "run_dir": "x", "overrides": []}

    monkeypatch.setattr(bench, "one_run", fake_run)
    monkeypatch.setenv("COLUMNS", "250")
    out = tmp_path / "res.json"
    argv = [
        "--grid",
        "acceptance",
        "--nodes",
        "4",
        "--methods",
        "fedavg,uapdfl",
        "--attacks",
        "nan",
        "--json",
        str(out),
    ]
    assert bench.main(argv) == 0
    assert len(calls) == 4  # 2 methods x (clean + nan on n3)
    doc = json.loads(out.read_text())
    assert len(doc["runs"]) == 4 and len(doc["medians"]) == 4
    assert doc["commands"] and doc["machine"] and "false_rejection" in doc["definitions"]
    text = capsys.readouterr().out
    assert "1/4 (n3)" in text and "-5.00" in text  # 0.55 vs 0.6 over n0..n2, not 0.55
    assert bench.main(argv) == 0
    assert len(calls) == 4  # nothing again
    assert bench.main([*argv, "--seeds", "0,1"]) == 0
    assert len(calls) == 8 and len(json.loads(out.read_text())["runs"]) == 8
    assert bench.main([*argv, "--dry-run"]) == 0
    assert "4 runs, 0 to do, 4 done" in capsys.readouterr().out


def test_dry_run_of_the_acceptance_grid(load_script, capsys, tmp_path):
    from p2pfl.algorithms import known_algorithms

    bench = load_script("bench_robust")
    assert (
        bench.main(["--grid", "acceptance", "--dry-run", "--json", str(tmp_path / "r.json")]) == 0
    )
    text = capsys.readouterr().out
    # every method: the clean run and nan, scale, noise, sign_flip by n3 (edges=full, 8 nodes)
    assert f"{5 * len(known_algorithms())} runs, {5 * len(known_algorithms())} to do" in text
    assert "INVALID" not in text and "nodes=8 rounds=15" in text
    assert not (tmp_path / "r.json").exists()


@pytest.mark.integration
def test_a_tiny_real_run_with_a_targeted_label_flip(tmp_path, load_script, monkeypatch):
    bench = load_script("bench_robust")
    monkeypatch.setenv("COLUMNS", "250")
    out = tmp_path / "res.json"
    argv = [
        "--grid",
        "acceptance",
        "--nodes",
        "4",
        "--rounds",
        "2",
        "--methods",
        "fedavg",
        "--attacks",
        "label_flip_targeted",
        "--set",
        "timing.linger_s=1",
        "--out",
        str(tmp_path / "runs"),
        "--json",
        str(out),
    ]
    assert bench.main(argv) == 0
    doc = json.loads(out.read_text())
    runs = {r["settings"]["attack"]: r for r in doc["runs"]}
    assert set(runs) == {"none", "label_flip_targeted"}
    for r in runs.values():
        m = r["metrics"]
        assert r["exit_code"] == 0 and m["rounds_reached"] == 2
        assert 0 <= m["acc_worst"] <= m["acc_mean"] <= 1
        assert 0 <= m["false_rejection"] <= 1 and m["honest_considered"] > 0
        assert 0 <= m["asr"] <= 1 and m["asr_source_samples"] > 0
        assert r["wall_s"] > 0
    attacked = runs["label_flip_targeted"]["metrics"]
    assert attacked["attackers"] == ["n3"] and attacked["honest_nodes"] == 3
    assert sorted(attacked["asr_per_node"]) == ["n0", "n1", "n2"]
    assert attacked["delta_pts"] is not None

    def boom(*a, **k):
        raise AssertionError("resumed run was run again")

    monkeypatch.setattr(bench, "one_run", boom)
    assert bench.main(argv) == 0
