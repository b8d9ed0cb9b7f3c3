"""The command line: validate's error report, and a swarm that cleans up on Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2pfl.cli import main
from p2pfl.metrics import read_records

ROOT = Path(__file__).resolve().parents[1]


def test_validate_ok(capsys):
    assert main(["validate", "topologies/ring-8.yaml"]) == 0
    err = capsys.readouterr().err
    assert "ok" in err and "8 nodes" in err and "8 edges" in err


def test_validate_reports_every_error_with_file_and_field(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: x\nnodes: 3\nrounds: -1\ntraining: {lr: 0, optimiser: sgd}\n"
        "algorithm: {name: uapdfl, params: {th_I: -1}}\n"
    )
    assert main(["validate", str(bad)]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    text = "\n".join(lines)
    for field in ("rounds", "training.lr", "training.optimiser", "algorithm"):
        assert f"{bad}: {field}:" in text, text
    assert "params.th_I" in text


def test_validate_set_override_is_checked(capsys):
    assert main(["validate", "topologies/synthetic.yaml", "--set", "edges.kind=moebius"]) == 2
    assert "edges.kind" in capsys.readouterr().err


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            pids.append(int(entry.name))
    return pids


@pytest.mark.integration
def test_ctrl_c_stops_every_process_it_started(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "scripts/launch_swarm.py",
            "topologies/synthetic.yaml",
            "--set",
            "rounds=200",
            "--out",
            str(out),
            "--no-progress",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not read_records(out / "nodes" / "a.jsonl"):
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "no round completed"
            time.sleep(0.2)
        started = _processes_mentioning(str(out))
        # 4 nodes packed about one process per core (the default), + mosquitto (its config
        # lives in the run dir)
        from p2pfl.launch.swarm import auto_per_process

        assert len(started) >= -(-4 // auto_per_process(4)) + 1
        os.kill(proc.pid, signal.SIGINT)  # what Ctrl-C sends to the foreground process
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(0.5)
    assert _processes_mentioning(str(out)) == []
    output = proc.stdout.read().decode()
    assert "interrupted" in output
    assert (out / "summary.json").exists()  # the partial run is still summarized


def test_node_without_a_broker_fails_with_a_message(tmp_path, capsys, caplog):
    """No broker at the address: the node retries for ``startup_timeout_s``, then exits
    non-zero with a one-line reason, not a traceback."""
    from p2pfl.launch.broker import free_port

    args = ["node", "topologies/synthetic.yaml", "--id", "a", "--no-rich"]
    args += ["--broker", f"127.0.0.1:{free_port()}", "--out", str(tmp_path)]
    args += ["--set", "timing.startup_timeout_s=1"]
    assert main(args) == 1
    text = caplog.text + capsys.readouterr().err
    assert "no MQTT broker reachable" in text, text
    assert "did not answer" in text, text  # the retry, said once
    assert "Traceback" not in text, text


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("dataset.input_shape=[1,2,2]", "model.name: model 'cnn' cannot take"),
        ("dataset.partition=pathological(9)", "dataset.partition: pathological(9): k must be"),
    ],
)
def test_node_with_bad_inputs_fails_naming_the_field(tmp_path, capsys, override, expected):
    args = ["node", "topologies/synthetic.yaml", "--id", "a", "--no-rich", "--out", str(tmp_path)]
    args += ["--set", override]
    assert main(args) == 2  # checked as validate checks, before the node starts: exit 2
    err = capsys.readouterr().err
    assert f"topologies/synthetic.yaml: {expected}" in err, err
    assert "Traceback" not in err, err


def test_nodes_are_packed_about_one_process_per_core():
    from p2pfl.launch.swarm import auto_per_process

    assert auto_per_process(8, cores=2) == 4 and auto_per_process(100, cores=2) == 50
    assert auto_per_process(3, cores=16) == 1 and auto_per_process(17, cores=16) == 2
    with pytest.raises(SystemExit) as exc:  # argparse: a usage error
        main(["swarm", "topologies/synthetic.yaml", "--nodes-per-process", "0"])
    assert exc.value.code == 2


def test_dashboard_certs_must_be_a_directory(tmp_path, capsys):
    """``p2pfl dashboard RUN --certs DIR``: the observer identity's directory is checked
    before anything listens."""
    (tmp_path / "run").mkdir()
    missing = tmp_path / "nowhere"
    assert main(["dashboard", str(tmp_path / "run"), "--certs", str(missing)]) == 2
    err = " ".join(capsys.readouterr().err.split())  # the console wraps long lines
    assert f"--certs {missing}: not a directory" in err


def test_a_node_trusts_only_the_launchers_check_of_the_file_it_reads(tmp_path):
    """--checked DIGEST (p2pfl swarm's node processes) skips the data and model checks
    only where DIGEST is the config file's and nothing on the command line changes it."""
    from p2pfl.check.checked import config_digest
    from p2pfl.cli import _launcher_checked
    from p2pfl.cli_parser import build_parser

    path = tmp_path / "config.yaml"
    path.write_text(Path("topologies/synthetic.yaml").read_text())
    digest = config_digest(path)

    def trusted(*extra: str) -> bool:
        args = build_parser().parse_args(["node", str(path), "--id", "a", *extra])
        return _launcher_checked(args, [])

    assert trusted("--checked", digest)
    assert not trusted()  # a standalone node checks
    assert not trusted("--checked", "0" * 64)
    assert not trusted("--checked", digest, "--set", "model.name=mlp")
    assert not trusted("--checked", digest, "--data-root", str(tmp_path))
    path.write_text(path.read_text() + "\n# changed\n")
    assert not trusted("--checked", digest)


def test_a_trusted_node_still_fails_on_inputs_that_cannot_work(tmp_path, capsys):
    """Where the launcher's word is trusted, a node whose inputs cannot work (here the
    model cannot take the data, a check that only the launcher would have made) still
    fails with a one-line error naming the file and the field, not a traceback."""
    from p2pfl.check.checked import config_digest
    from p2pfl.check.load import load_topology
    from p2pfl.config.schema import dump_topology

    path = tmp_path / "config.yaml"
    path.write_text(
        dump_topology(load_topology("topologies/synthetic.yaml", ["dataset.input_shape=[1,2,2]"]))
    )
    args = ["node", str(path), "--id", "a", "--no-rich", "--out", str(tmp_path)]
    assert main([*args, "--checked", config_digest(path)]) != 0
    err = capsys.readouterr().err
    assert "model.name" in err and "Traceback" not in err, err
