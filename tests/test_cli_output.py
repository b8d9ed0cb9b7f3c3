"""What the ``p2pfl`` command line prints, and leaves, for a user reading it: ``--help``
lists every command in plain words, one line each; a swarm whose output is not a terminal
(a pipe, a file) prints one line a round and tables that start on their own line; a user
model's ``model.json`` carries only the fields that shape it; and a clean run leaves no
ERROR line in any log, the embedded broker's included."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "learning"))
from user_models_src import USER_MODULE  # noqa: E402

from p2pfl.cli import COMMANDS, main  # noqa: E402
from p2pfl.cli_parser import build_parser  # noqa: E402
from p2pfl.config.schema import BUILTIN_MODELS, ModelConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 3
NODES = ["a", "b", "c"]
ROUND_LINE = re.compile(r"^round (\d+)/(\d+): (\d+)/(\d+) nodes, acc (\d\.\d{3}), (\d+\.\d) s$")


def test_help_lists_every_command_on_one_line_in_plain_words(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps to the terminal's width
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "``" not in text and ":mod:" not in text, text  # no reST markup
    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(sub.choices) == set(COMMANDS)
    lines = text.splitlines()
    for action in sub._choices_actions:  # each command: its name and summary on one line
        [line] = [ln for ln in lines if ln.startswith(f"    {action.dest} ")]
        assert line.split() == [action.dest, *action.help.split()], line


@pytest.mark.parametrize(
    "cfg",
    [
        ModelConfig(name="mlp", hidden=32),
        ModelConfig(name="cnn", padding="valid", head="last"),
        *(ModelConfig(name=n) for n in BUILTIN_MODELS),
        ModelConfig(name="usernet:make", personal=["classifier"], kwargs={"hidden": 8}),
    ],
    ids=lambda c: c.name,
)
def test_a_models_recorded_fields_rebuild_it(cfg):
    recorded = cfg.applicable()
    assert ModelConfig.model_validate(recorded) == cfg
    assert json.loads(json.dumps(recorded)) == recorded


@pytest.fixture(scope="module")
def piped_swarm(tmp_path_factory):
    """A 3-node swarm of a user model on the embedded broker, run as a user would run
    ``p2pfl swarm ... > log 2>&1``: its output, its run directory."""
    tmp = tmp_path_factory.mktemp("piped")
    (tmp / "usernet.py").write_text(USER_MODULE)  # the node processes import it from cwd
    out = tmp / "run"
    sets = [
        "model={name: 'usernet:make'}",
        f"nodes=[{', '.join(NODES)}]",
        "edges=full",
        f"rounds={ROUNDS}",
        "timing.linger_s=5",
    ]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "p2pfl.cli", "swarm", str(ROOT / "topologies" / "synthetic.yaml")]
        + [f"--set={s}" for s in sets]
        + ["--broker-kind", "embedded", "--out", str(out)],
        cwd=tmp,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": path, "COLUMNS": "80"},
        timeout=300,
    )
    text = proc.stdout.decode()
    assert proc.returncode == 0, text
    return text, out


@pytest.mark.integration
def test_a_piped_swarm_prints_one_line_a_round(piped_swarm):
    text, out = piped_swarm
    lines = text.splitlines()
    rounds = [m.groups() for m in map(ROUND_LINE.match, lines) if m]
    assert [int(r[0]) for r in rounds] == list(range(1, ROUNDS + 1)), text
    assert all(r[1:4] == (str(ROUNDS), str(len(NODES)), str(len(NODES))) for r in rounds)
    elapsed = [float(r[5]) for r in rounds]
    assert elapsed == sorted(elapsed), text
    final = json.loads((out / "summary.json").read_text())["final"]
    assert float(rounds[-1][4]) == pytest.approx(final["acc_mean"], abs=5e-4), text
    assert "┃ node" not in text  # the live table is a terminal's


@pytest.mark.integration
def test_every_table_of_a_piped_swarm_starts_on_its_own_line(piped_swarm):
    text, _ = piped_swarm
    lines = text.splitlines()
    assert "summary: uapdfl" in [ln.strip() for ln in lines], text  # the title, alone
    for ln in lines:  # a box's corners and borders open their line
        for corner in "┏└┌╭":
            if corner in ln:
                assert ln.lstrip().startswith(corner), text


@pytest.mark.integration
def test_a_user_models_json_carries_only_its_own_fields(piped_swarm):
    _, out = piped_swarm
    for nid in NODES:
        meta = json.loads((out / "nodes" / f"{nid}.model.json").read_text())
        assert meta["model"] == {"name": "usernet:make", "personal": None, "kwargs": {}}, meta


@pytest.mark.integration
def test_a_clean_run_logs_no_error(piped_swarm):
    text, out = piped_swarm
    broker_log = (out / "broker" / "embedded.log").read_text()
    assert "READY" in broker_log  # the embedded broker's log is the one read here
    logs = {"output": text, "broker": broker_log}
    logs.update({p.name: p.read_text() for p in (out / "logs").glob("*.log")})
    assert len(logs) >= 3
    for name, log in logs.items():
        assert not [ln for ln in log.splitlines() if "ERROR" in ln], (name, log[-3000:])
