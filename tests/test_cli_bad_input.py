"""Bad input for a device's own data and model, at the command line: each of these gets an
error naming the node, the file and the field, a non-zero exit, and no traceback unless
``-v`` asks for one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from p2pfl.cli import main

USER_CODE = textwrap.dedent(
    """
    from torch import nn


    def mlp(num_classes, input_shape):
        return nn.Sequential(nn.Linear(input_shape[0], 8), nn.ReLU(), nn.Linear(8, num_classes))


    def raises(num_classes, input_shape):
        raise RuntimeError("checkpoint server unreachable")


    def wrong_shape(num_classes, input_shape):
        return nn.Sequential(nn.Linear(input_shape[0] + 5, 8), nn.ReLU(), nn.Linear(8, num_classes))
    """
)
GOOD_CSV = "age,dose,label\n1.0,2.0,0\n2.0,1.0,1\n3.0,0.5,0\n4.0,3.0,1\n5.0,1.5,0\n"


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A user's directory: their model module, one CSV per node, a topology file."""
    (tmp_path / "clinic_models.py").write_text(USER_CODE)
    data = tmp_path / "data"
    data.mkdir()
    for node in ("a", "b"):
        (data / f"{node}.csv").write_text(GOOD_CSV)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("clinic_models", None)


def topology(project: Path, **changes) -> Path:
    cfg = {
        "name": "clinic",
        "nodes": ["a", "b"],
        "edges": "full",
        "algorithm": {"name": "fedavg"},
        "dataset": {
            "name": "csv",
            "root": "data/{id}.csv",
            "partition": "none",
            "label": "label",
            "classes": 2,
        },
        "model": {"name": "clinic_models:mlp"},
    }
    for dotted, value in changes.items():
        section, _, key = dotted.partition("__")
        cfg[section][key] = value
    path = project / "topology.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


CASES = {
    "missing label column": (
        {"dataset__label": "outcome"},
        "a",
        GOOD_CSV,
        "dataset.label",
        ["'outcome'", "a.csv", "its columns: age, dose, label"],
    ),
    "string feature": (
        {},
        "b",
        "age,site,label\n1,north,0\n2,south,1\n3,north,0\n",
        "dataset.root",
        ["'site'", "b.csv"],
    ),
    "import path that does not import": (
        {"model__name": "clinic_modelz:mlp"},
        None,
        None,
        "model.name",
        ["no module named 'clinic_modelz'"],
    ),
    "factory that raises": (
        {"model__name": "clinic_models:raises"},
        None,
        None,
        "model.name",
        ["RuntimeError: checkpoint server unreachable", "clinic_models.py"],
    ),
    "forward fails on the input shape": (
        {"model__name": "clinic_models:wrong_shape"},
        None,
        None,
        "model.name",
        ["forward fails on a batch of shape [2, 2]"],
    ),
    "personal prefix that matches nothing": (
        {"model__personal": ["classifier"]},
        None,
        None,
        "model.personal",
        ["prefix 'classifier' matches no parameter"],
    ),
    "label outside dataset.classes": (
        {},
        "b",
        "age,dose,label\n1,2,0\n2,1,7\n3,1,1\n4,2,0\n",
        "dataset.classes",
        ["7", "b.csv"],
    ),
    "empty data file": ({}, "b", "", "dataset.root", ["b.csv", "empty"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_names_node_file_and_field(project, capsys, case):
    changes, node, content, field, words = CASES[case]
    path = topology(project, **changes)
    if node is not None:
        (project / "data" / f"{node}.csv").write_text(content)
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: {field}:" in " ".join(err.split()), err
    flat = " ".join(err.split())
    for word in words:
        assert word in flat, (word, err)
    if node is not None:
        assert f"node {node!r}" in flat or f"node {node}" in flat, err
    assert "Traceback" not in err


def cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "p2pfl.cli", *args],
        cwd=cwd,
        env={**os.environ, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_swarm_stops_before_starting_anything(project):
    path = topology(project)
    (project / "data" / "b.csv").write_text("age,dose,label\n1,2,0\n2,1,9\n")
    out = cli(["swarm", str(path), "--out", str(project / "run")], project)
    assert out.returncode == 2, out.stdout + out.stderr
    flat = " ".join(out.stderr.split())
    assert "dataset.classes" in flat and "b.csv" in flat and "Traceback" not in flat
    assert "broker" not in out.stdout  # nothing was started


def test_verbose_shows_the_traceback(project):
    path = topology(project, model__name="clinic_models:raises")
    quiet = cli(["validate", str(path)], project)
    loud = cli(["validate", str(path), "-v"], project)
    assert quiet.returncode == loud.returncode == 2
    assert "Traceback" not in quiet.stderr and "Traceback" in loud.stderr
