"""scripts/dp_cost_alone.py: each node trains three times from one initial model, DP with
the σ a node plans for its run, and the record says what clipping and noise cost."""

from __future__ import annotations

import json

from p2pfl.privacy.accountant import plan_noise, steps_per_epoch


def test_three_trainings_per_node_with_the_planned_noise(load_script, tmp_path):
    script = load_script("dp_cost_alone")
    out = tmp_path / "cost.json"
    argv = ["topologies/synthetic.yaml", "--nodes", "a,c", "--set", "rounds=2"]
    assert script.main([*argv, "--jobs", "1", "--epsilon", "4", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert set(record["nodes"]) == {"a", "c"}
    for r in record["nodes"].values():
        assert r["steps"] == 2 * steps_per_epoch(r["q"])  # 2 rounds of 1 epoch
        assert r["sigma"] == plan_noise(4.0, 1e-5, r["q"], r["steps"])
        assert all(0.0 <= r[v] <= 1.0 for v in ("plain", "clip", "dp"))
    for v in ("plain", "clip", "dp"):
        assert record["mean"][v] == sum(r[v] for r in record["nodes"].values()) / 2
