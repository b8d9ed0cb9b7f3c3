"""A topology in a subfolder, with its own data and its own model module beside it, runs the
same from any current directory: its paths (and the model's module) resolve against its
folder (docs/design.md, "Configuration"). Two real swarms, started from two directories,
record the same rounds; the trained model loads from a third."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import run_p2pfl

from p2pfl.metrics import read_records

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
MODEL = """
from torch import nn


def make(num_classes, input_shape):
    return nn.Sequential(nn.Linear(input_shape[0], 8), nn.ReLU(), nn.Linear(8, num_classes))
"""
TOPOLOGY = """
name: labs
seed: 3
rounds: 2
algorithm: {name: fedavg}
dataset:
  name: csv
  root: data/{id}.csv
  partition: none
  classes: 2
model: {name: "lab_model:make"}
training: {epochs: 2, batch_size: 8}
nodes: [lab-a, lab-b]
edges: full
timing: {round_timeout_s: 30, startup_timeout_s: 60, linger_s: 2}
"""


def _csv(seed: int) -> str:
    rows = [
        f"{(i * seed) % 11 / 10:.1f},{(i * 7) % 5 / 4:.2f},{int((i * seed) % 11 > 5)}"
        for i in range(48)
    ]
    return "x1,x2,label\n" + "\n".join(rows) + "\n"


def _p2pfl(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return run_p2pfl(*args, cwd=cwd)


def test_a_topology_in_a_subfolder_runs_the_same_from_any_directory(tmp_path):
    proj = tmp_path / "mine"
    (proj / "data").mkdir(parents=True)
    (proj / "data" / "lab-a.csv").write_text(_csv(3))
    (proj / "data" / "lab-b.csv").write_text(_csv(7))
    (proj / "lab_model.py").write_text(MODEL)
    (proj / "topology.yaml").write_text(TOPOLOGY)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    runs = {}
    for name, cwd in (("parent", tmp_path), ("elsewhere", elsewhere)):
        topo = os.path.relpath(proj / "topology.yaml", cwd)
        out = tmp_path / "runs" / name
        # swarm runs validate's checks first (tests/config/test_paths.py runs validate itself)
        done = _p2pfl(
            ["swarm", topo, "--out", str(out), "--no-progress", "--nodes-per-process", "2"], cwd
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        runs[name] = {
            node: [
                (r["round"], r["test_acc"], r.get("train_loss"))
                for r in read_records(out / "nodes" / f"{node}.jsonl")
            ]
            for node in ("lab-a", "lab-b")
        }
        assert [r[0] for r in runs[name]["lab-a"]] == [1, 2]
    assert runs["parent"] == runs["elsewhere"]
    # the run directory records the model's folder: the model loads from any directory
    third = tmp_path / "third"
    third.mkdir()
    run_dir = str(tmp_path / "runs" / "elsewhere")
    code = f"import p2pfl; print(type(p2pfl.load_model({run_dir!r}, 'lab-a')).__name__)"
    loaded = subprocess.run(
        [sys.executable, "-c", code],
        cwd=third,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert loaded.returncode == 0, loaded.stderr[-2000:]
