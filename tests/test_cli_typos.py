"""Typos at the command line: a mistyped command or choice is one line naming the nearest
valid names, exit 2, no usage block and no traceback; a mistyped field, method, model or
dataset in a topology (or ``--method``) says "did you mean" in ``validate``'s error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from p2pfl.cli import main

ROOT = Path(__file__).resolve().parents[1]


def cli(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "p2pfl.cli", *args],
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "200", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["swarn", "topologies/synthetic.yaml"],
            "p2pfl: error: unknown command 'swarn' (did you mean 'swarm'?); commands: swarm, node,",
        ),
        (["valdate", "x.yaml"], "unknown command 'valdate' (did you mean 'validate'?)"),
        (["qqqq"], "p2pfl: error: unknown command 'qqqq'; commands: swarm,"),
        (
            ["export", "runs/x", "--format", "onx"],
            "p2pfl export: error: --format: invalid choice 'onx' (did you mean 'onnx'?); one of: "
            "safetensors, onnx, torchscript",
        ),
    ],
)
def test_a_mistyped_command_or_choice_is_one_line_with_a_suggestion(args, line):
    out = cli(args)
    assert out.returncode == 2
    assert out.stderr.strip() == out.stderr.strip().splitlines()[0], out.stderr  # one line
    assert line in out.stderr
    assert "usage:" not in out.stderr and "Traceback" not in out.stderr


def test_other_usage_errors_keep_argparses_usage():
    out = cli(["swarm"])
    assert out.returncode == 2
    assert "usage: p2pfl swarm" in out.stderr and "required: topology" in out.stderr


def test_validate_suggests_for_a_topologys_typos(tmp_path, capsys):
    path = tmp_path / "t.yaml"
    path.write_text("name: x\nnodes: 2\nround: 3\nmodel: {name: cnn, personnal: [fc]}\n")
    assert main(["validate", str(path), "--no-data"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{path}: round: unknown field (did you mean 'rounds'?)" in err
    assert f"{path}: model.personnal: unknown field (did you mean 'personal'?)" in err
    assert "Traceback" not in err


def test_a_mistyped_method_on_the_command_line_is_suggested(capsys):
    args = ["validate", "topologies/synthetic.yaml", "--no-data", "--method", "fedavgg"]
    assert main(args) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "unknown algorithm 'fedavgg' (did you mean 'fedavg'" in err
    assert "set on the command line: algorithm.name=fedavgg" in err
