"""The in-process replay (scripts/replay_decentralized.py) against the real swarm: the same
seed gives the same accuracies and the same UA-PDFL decisions, round by round."""

from __future__ import annotations

from pathlib import Path

import pytest

from p2pfl.check.load import load_topology
from p2pfl.launch.swarm import run_swarm
from p2pfl.metrics import read_run

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


def test_replay_matches_the_swarm_to_the_last_digit(tmp_path, load_script):
    # full graph: every node draws com = 2 of its 3 neighbours, so the peer draws matter
    cfg = load_topology(ROOT / "topologies/synthetic.yaml", ["edges=full", "rounds=4"])
    code, _ = run_swarm(cfg, tmp_path / "run", nodes_per_process=4, progress=False)
    assert code == 0
    swarm = read_run(tmp_path / "run")
    replayed = load_script("replay_decentralized").replay(cfg)["records"]
    assert sorted(replayed) == sorted(swarm)
    for nid, recs in swarm.items():
        assert len(recs) == len(replayed[nid]) == cfg.rounds
        # the last round may differ: a node leaves neighbours that already finished ("done")
        # out of its draw, and which ones have depends on timing
        for live, again in zip(recs[:-1], replayed[nid][:-1], strict=True):
            assert again["test_acc"] == live["test_acc"], (nid, live["round"])
            for key in ("chosen", "dropout"):
                assert again[key] == live[key], (nid, live["round"], key)
            for key in ("h_peers", "divergence", "relative", "drift"):  # UA-PDFL's facts
                assert again["method"][key] == live["method"][key], (nid, live["round"], key)


def test_methods_that_train_first_are_refused(load_script):
    cfg = load_topology(
        ROOT / "topologies/synthetic.yaml", ["algorithm.name=dfedavgm", "algorithm.params={}"]
    )
    with pytest.raises(SystemExit, match="only decentralized merge-then-train"):
        load_script("replay_decentralized").replay(cfg)
