"""scripts/bench_privacy.py: the loss-threshold attack's arithmetic on synthetic losses, the
member / non-member matching, the table and acceptance lines of a hand-made result, and
one tiny end-to-end run (a 4-node synthetic swarm, 1 round, Local with and without DP)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest


@pytest.fixture
def bench(load_script):
    return load_script("bench_privacy")


def test_identical_distributions_give_no_advantage(bench):
    rng = np.random.default_rng(0)
    members, nonmembers = rng.exponential(1.0, 2000), rng.exponential(1.0, 2000)
    assert abs(bench.threshold_advantage(members, nonmembers, 1.0)) < 0.05
    best, _ = bench.best_threshold_advantage(members, nonmembers)
    null = bench.null_best_advantage(members, nonmembers, rng, permutations=50)
    assert 0 <= best < 0.07 and 0 < null < 0.07  # sampling noise only, read against null


def test_separable_losses_give_advantage_one(bench):
    members, nonmembers = np.linspace(0.0, 0.4, 50), np.linspace(0.6, 3.0, 70)
    assert bench.threshold_advantage(members, nonmembers, 0.5) == 1.0
    best, tau = bench.best_threshold_advantage(members, nonmembers)
    assert best == 1.0 and 0.4 < tau < 0.6
    assert bench.threshold_advantage(members, nonmembers, tau) == best  # τ reaches it
    rng = np.random.default_rng(1)
    # Yeom's τ is the mean training loss: between the two sets here, so it separates them
    summary = bench.attack_summary(np.full(10, 0.5), members, nonmembers, rng)
    assert summary["adv_yeom"] == 1.0 and summary["tau_yeom"] == pytest.approx(0.5)
    assert summary["adv_best"] == 1.0 and summary["adv_best_null"] < 0.5 and summary["n"] == 50


def test_threshold_rule_and_ties(bench):
    # "member iff loss < τ": 2 of 4 members and 1 of 4 non-members are below 1.0
    assert bench.threshold_advantage([0.1, 0.5, 1.0, 2.0], [0.2, 1.0, 3.0, 4.0], 1.0) == 0.25
    assert bench.best_threshold_advantage([1.0, 1.0], [1.0, 1.0])[0] == 0.0  # all tied
    # members worse than non-members: the best rule calls nobody a member
    best, tau = bench.best_threshold_advantage([5.0, 6.0], [1.0, 2.0])
    assert best == 0.0 and tau < 1.0
    assert bench.threshold_advantage([], [1.0], 0.5) == 0.0


def test_matched_nonmembers_share_the_label_histogram(bench):
    labels = np.array([0] * 10 + [1] * 10 + [2] * 3)
    members = np.array([0, 1, 2, 3, 10, 11, 20, 21])  # 4 of class 0, 2 of 1, 2 of 2
    pool = np.arange(23)  # the members are taken out of it
    used, non = bench.matched_nonmembers(labels, members, pool, np.random.default_rng(0))
    assert set(used) <= set(members) and not set(non) & set(members)
    # class 2 has only one record left in the pool: one class-2 member is dropped to match
    assert np.bincount(labels[used], minlength=3).tolist() == [4, 2, 1]
    assert np.bincount(labels[non], minlength=3).tolist() == [4, 2, 1]
    assert list(used) == sorted(used) and list(non) == sorted(non)


def _run(preset, method, eps, acc, yeom, best=0.1, n=300):
    node = {"n": n, "adv_yeom": yeom, "adv_best": best, "adv_best_null": 0.06}
    return {
        "preset": preset,
        "method": method,
        "epsilon_target": eps,
        "nodes": 20,
        "rounds": 20,
        "acc": acc,
        "epsilon_max": None if eps is None else eps - 0.01,
        "exhausted": [],
        "wall_s": 100.0,
        "mi": {"per_node": {"n0": node}, "mean": bench_pooled({"n0": node})},
    }


def bench_pooled(per_node):
    total = sum(r["n"] for r in per_node.values())
    keys = ("adv_yeom", "adv_best", "adv_best_null")
    return {k: sum(r[k] * r["n"] for r in per_node.values()) / total for k in keys}


def test_pooled_weights_nodes_by_their_samples(bench):
    per_node = {
        "a": {"n": 300, "adv_yeom": 0.2, "adv_best": 0.3, "adv_best_null": 0.05},
        "b": {"n": 100, "adv_yeom": 0.0, "adv_best": 0.1, "adv_best_null": 0.09},
    }
    assert bench.pooled(per_node)["adv_yeom"] == pytest.approx(0.15)
    assert bench.pooled(per_node)["adv_best_null"] == pytest.approx(0.06)


def test_table_and_acceptance_from_a_result_file(bench, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    runs = [
        _run("suite", "uapdfl", 8.0, 81.0, 0.03),
        _run("suite", "uapdfl", None, 85.0, 0.12),
        _run("quick", "local", None, 70.0, 0.01),
        _run("quick", "uapdfl", None, 80.0, 0.20),
        _run("quick", "uapdfl", 8.0, 70.0, 0.06),
    ]
    checks = bench.acceptance(runs)
    assert [(c["preset"], c["ok"]) for c in checks] == [
        ("suite", True),
        ("suite", True),
        ("quick", False),
        ("quick", False),
    ]
    assert checks[0]["value"] == pytest.approx(4.0)
    assert [(r["preset"], r["method"], r["epsilon_target"]) for r in bench.ordered(runs)] == [
        ("suite", "uapdfl", None),
        ("suite", "uapdfl", 8.0),
        ("quick", "uapdfl", None),
        ("quick", "uapdfl", 8.0),
        ("quick", "local", None),
    ]
    result = {
        "meta": {"suite": "s", "seed": 0, "delta": 1e-5, "max_grad_norm": 1.0, "target": "n0"},
        "runs": runs,
        "acceptance": checks,
    }
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    assert bench.main(["--from-json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "PASS  [suite] UA-PDFL at ε=8 loses ≤ 5 points vs no DP: 4.000" in out
    assert "FAIL  [quick] UA-PDFL at ε=8: MI advantage" in out
    assert "-4.00" in out and "-10.00" in out and "7.99" in out
    assert "[quick] Local without DP is already below 0.05" in out


@pytest.mark.skipif(shutil.which("mosquitto") is None, reason="needs mosquitto")
def test_tiny_end_to_end_run(bench, tmp_path, capsys):
    suites = tmp_path / "suites.yaml"
    suites.write_text(
        "tiny:\n  topology: topologies/synthetic.yaml\n"
        '  set: ["dataset.train_per_node=60", "timing.linger_s=1"]\n'
        "  methods:\n    local: {paper: null}\n"
    )
    out = tmp_path / "result.json"
    argv = ["--suites", str(suites), "--suite", "tiny", "--methods", "local", "--epsilons", "8"]
    argv += ["--nodes", "2", "--rounds", "1", "--out", str(tmp_path / "runs")]
    assert bench.main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["commands"][0].startswith("python scripts/bench_privacy.py --suites")
    cells = {(r["method"], r["epsilon_target"]): r for r in result["runs"]}
    assert set(cells) == {("local", None), ("local", 8.0)}
    assert cells[("local", None)]["epsilon_max"] is None
    assert 0 < cells[("local", 8.0)]["epsilon_max"] <= 8.0
    for r in result["runs"]:
        assert r["preset"] == "n2-r1" and r["exit_code"] == 0
        assert set(r["mi"]["per_node"]) == {"n0", "n1"}
        assert all(0 < node["n"] <= 60 for node in r["mi"]["per_node"].values())
    assert "[n2-r1] UA-PDFL" not in capsys.readouterr().out  # no UA-PDFL run: no verdict
    # --resume of the same cells runs nothing, appends its command and keeps a hand-written note
    result["meta"]["notes"] = ["measured on a laptop"]
    out.write_text(json.dumps(result))
    assert bench.main([*argv, "--json", str(out), "--resume"]) == 0
    again = json.loads(out.read_text())
    assert again["meta"]["notes"] == ["measured on a laptop"]
    assert len(again["meta"]["commands"]) == 2 and again["meta"]["commands"][1].endswith("--resume")
    assert again["runs"] == result["runs"]
