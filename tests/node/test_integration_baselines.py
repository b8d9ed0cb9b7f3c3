"""Decentralized baselines end to end: a 4-node swarm (node processes, a real Mosquitto on
loopback, synthetic data) runs 2 rounds of each and writes complete results."""

from __future__ import annotations

import pytest
from swarm_helpers import check_run_dir

from p2pfl.check.load import load_topology
from p2pfl.launch.swarm import run_swarm
from p2pfl.learning.models import build_model

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("method", ["local", "dfedavgm", "dispfl"])
def test_baseline_runs_two_rounds(tmp_path, method):
    cfg = load_topology(
        "topologies/synthetic.yaml",
        [f"algorithm.name={method}", "algorithm.params={}", "rounds=2", "timing.linger_s=5"],
    )
    code, summary = run_swarm(cfg, tmp_path / "run", nodes_per_process=4, progress=False)
    assert code == 0
    logs = check_run_dir(tmp_path / "run", cfg.node_ids, 2)
    model = build_model(cfg.model, cfg.dataset.num_classes, tuple(cfg.dataset.input_shape))
    dense_bytes = sum(v.numel() * 4 for v in model.state_dict().values())
    for nid, recs in logs.items():
        for rec in recs:
            if method == "local":  # nothing sent; all it hears is the others' presence
                assert rec["bytes_sent"] == 0 and rec["bytes_recv"] < 2_000 and not rec["pulled"]
            else:  # every live ring neighbour answered and was merged
                assert sorted(rec["pulled"]) == sorted(rec["chosen"]) == sorted(rec["peers"])
                assert len(rec["chosen"]) == 2 and rec["bytes_sent"] > 0, (nid, rec)
            if method == "dispfl":  # sparse models with their masks: about half the bytes
                facts = rec["method"]  # the method's facts (merge, after_train)
                assert facts["merged_from"] == sorted(rec["pulled"]) and not rec["rejected"]
                assert facts["density"] == pytest.approx(0.5, abs=0.01)
                assert 0 < facts["mask_overlap"] < 1
                served = rec["bytes_sent"] / 2  # each node serves its 2 ring neighbours
                assert 0.4 * dense_bytes < served < 0.65 * dense_bytes, (served, dense_bytes)
        if method == "dispfl":  # round 1 prunes and regrows, the last round (f_R = 0) not
            assert recs[0]["method"]["regrown"] > 0 and recs[1]["method"]["regrown"] == 0
    assert summary["final"]["acc_mean"] > 0.25  # above chance on the 4-class synthetic task
