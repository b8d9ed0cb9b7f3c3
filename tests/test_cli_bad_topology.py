"""Bad topologies at the command line (docs/design.md, "Configuration"): every command
reads a topology through one path (:mod:`p2pfl.check.checked`) with the checks of
``validate``, before anything starts, and each case gets a non-zero exit, no traceback, and
a message naming the user's file and the field."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from p2pfl.cli import main

BASE = {
    "name": "bad",
    "rounds": 2,
    "algorithm": {"name": "fedavg"},
    "dataset": {
        "name": "synthetic",
        "partition": "iid",
        "num_classes": 4,
        "input_shape": [1, 8, 8],
        "synthetic_train": 200,
        "synthetic_test": 100,
    },
    "model": {"name": "mlp", "hidden": 16},
    "nodes": ["a", "b", "c"],
    "edges": "ring",
}


def write(tmp_path: Path, name: str = "topo.yaml", **sections) -> Path:
    cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in BASE.items()}
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key].update(value)
        else:
            cfg[key] = value
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def cli(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "p2pfl.cli", *args],
        cwd=cwd,
        env={**os.environ, "COLUMNS": "300"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def flat(text: str) -> str:
    return " ".join(text.split())


def assert_clean(code: int, err: str, path: Path | str, *words: str) -> None:
    """Exit 2, no traceback, and ``<path>: <first word>`` then every other word."""
    text = flat(err)
    assert code == 2, err
    assert "Traceback" not in err, err
    assert f"{path}: {words[0]}" in text, err
    for word in words[1:]:
        assert word in text, (word, err)


# ----------------------------------------------------------------------------- bounds


def test_a_hundred_million_nodes_is_refused_by_validate_and_swarm(tmp_path):
    """``nodes: 100000000`` raised MemoryError in the schema; now the bound on ``nodes``
    names the file and the field, under both commands, as the real command line runs."""
    path = write(tmp_path, nodes=100_000_000)
    for args in (["validate", str(path)], ["swarm", str(path), "--out", str(tmp_path / "run")]):
        out = cli(args, tmp_path)
        assert_clean(out.returncode, out.stderr, path, "nodes:", "100,000,000", "10,000")
        assert "MemoryError" not in out.stderr
    assert not (tmp_path / "run").exists()  # swarm started nothing


@pytest.mark.parametrize(
    ("section", "value", "field"),
    [
        ("rounds", 10**12, "rounds"),
        ("training", {"epochs": 10**9}, "training.epochs"),
        ("training", {"batch_size": 10**9}, "training.batch_size"),
        ("model", {"hidden": 10**9}, "model.hidden"),
        ("dataset", {"synthetic_train": 10**12}, "dataset.synthetic_train"),
        ("dataset", {"num_classes": 10**9}, "dataset.num_classes"),
        ("timing", {"max_staleness": 10**12}, "timing.max_staleness"),
        ("edges", {"kind": "random-k", "k": 10**9}, "edges.k"),
        ("privacy", {"secagg": True, "secagg_neighbours": 10**8}, "privacy.secagg_neighbours"),
        ("algorithm", {"name": "uapdfl", "params": {"com": 10**9}}, "algorithm: params.com"),
    ],
)
def test_counts_that_allocate_are_bounded(tmp_path, capsys, section, value, field):
    path = write(tmp_path, **{section: value})
    code = main(["validate", str(path), "--no-data"])
    assert_clean(code, capsys.readouterr().err, path, f"{field}:")


def test_a_bound_set_on_the_command_line_says_so(tmp_path, capsys):
    path = write(tmp_path)
    code = main(["swarm", str(path), "--set", "nodes=100000000", "--out", str(tmp_path / "r")])
    assert_clean(code, capsys.readouterr().err, path, "nodes:", "nodes=100000000")
    assert not (tmp_path / "r").exists()


# ----------------------------------------------------------------------------- the file


def test_a_binary_topology_is_named_not_a_unicode_traceback(tmp_path):
    """A binary, non-UTF-8 file raised UnicodeDecodeError in load.py."""
    path = tmp_path / "model.bin"
    path.write_bytes(bytes(range(256)) * 4)
    for args in (
        ["validate", str(path)],
        ["swarm", str(path), "--out", str(tmp_path / "run")],
        ["node", str(path), "--id", "a"],
    ):
        out = cli(args, tmp_path)
        assert_clean(out.returncode, out.stderr, path, "not a text file")
        assert "UnicodeDecodeError" not in out.stderr


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("", ["name: Field required", "nodes: Field required"]),
        ("- a\n- b\n", ["top level must be a mapping", "not a list"]),
        ("42\n", ["top level must be a mapping", "not a single int value"]),
        ("name: x\nnodes: [a, b\n", ["line 3: invalid YAML"]),
        ("name: x\x00\nnodes: 2\n", ["invalid YAML"]),
    ],
    ids=["empty", "list", "scalar", "unclosed", "nul"],
)
def test_files_that_are_not_a_topology(tmp_path, capsys, content, words):
    path = tmp_path / "t.yaml"
    path.write_text(content)
    code = main(["validate", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert f"{path}: {words[0]}" in flat(err), err
    for word in words[1:]:
        assert word in flat(err), (word, err)


def test_a_directory_and_a_missing_file(tmp_path, capsys):
    assert main(["validate", str(tmp_path)]) == 2
    assert f"{tmp_path}: is a directory" in flat(capsys.readouterr().err)
    gone = tmp_path / "nope.yaml"
    assert main(["swarm", str(gone)]) == 2
    assert f"{gone}: cannot read file" in flat(capsys.readouterr().err)


def test_an_alias_bomb_is_refused_before_it_expands(tmp_path, capsys):
    lines = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for i, prev in zip("bcdefghi", "abcdefgh", strict=True):
        lines.append(f"{i}: &{i} [{', '.join([f'*{prev}'] * 10)}]")
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join([*lines, "name: x", "nodes: 2", ""]))
    assert main(["validate", str(path)]) == 2
    assert f"{path}: more than 10,000,000 values" in flat(capsys.readouterr().err)


# ----------------------------------------------------------------------------- swarm = validate


def _garbage_zip(tmp_path: Path) -> Path:
    path = tmp_path / "images.zip"
    path.write_bytes(b"PK\x03\x04" + bytes(range(256)) * 8)
    return path


def _corrupt_fmnist(tmp_path: Path) -> Path:
    raw = tmp_path / "fm" / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for name in ("train-images", "train-labels", "t10k-images", "t10k-labels"):
        kind = "idx3" if "images" in name else "idx1"
        (raw / f"{name}-{kind}-ubyte").write_bytes(b"\x00\x01garbage" * 5)
    return tmp_path / "fm"


SWARM_CASES = {
    "missing data root": (
        lambda tmp: {"dataset": {"name": "fashionmnist", "root": str(tmp / "gone")}},
        "dataset.root:",
        ["does not exist"],
    ),
    "corrupt data file": (
        lambda tmp: {"dataset": {"name": "fashionmnist", "root": str(_corrupt_fmnist(tmp))}},
        "dataset.root:",
        ["fashionmnist"],
    ),
    "garbage zip": (
        lambda tmp: {"dataset": {"name": "imagefolder", "root": str(_garbage_zip(tmp))}},
        "dataset.root:",
        ["images.zip"],
    ),
    "input shape the model cannot take": (
        lambda tmp: {"model": {"name": "cnn"}, "dataset": {"input_shape": [1, 2, 2]}},
        "model.name:",
        ["cannot take", "[1, 2, 2]"],
    ),
}


@pytest.mark.parametrize("case", list(SWARM_CASES))
def test_swarm_runs_the_checks_of_validate_before_anything_starts(tmp_path, capsys, case):
    """These started the broker and every node, each exiting 1 naming ``<run>/config.yaml``;
    now ``swarm`` stops first, as ``validate`` does, naming the user's file."""
    sections, field, words = SWARM_CASES[case]
    path = write(tmp_path, **sections(tmp_path))
    run = tmp_path / "run"
    assert_clean(main(["validate", str(path)]), capsys.readouterr().err, path, field, *words)
    out = cli(["swarm", str(path), "--out", str(run)], tmp_path)
    assert_clean(out.returncode, out.stderr, path, field, *words)
    assert "config.yaml" not in out.stderr and "exited with" not in out.stdout
    assert not run.exists()  # no broker, no node, no run directory


def test_node_runs_the_checks_before_connecting(tmp_path, capsys):
    """``p2pfl node`` checks the data and model of the nodes it hosts before any connects
    (the broker given here does not exist: a node that got as far would say so)."""
    path = write(tmp_path, model={"name": "cnn"}, dataset={"input_shape": [1, 2, 2]})
    code = main(["node", str(path), "--id", "a", "--broker", "127.0.0.1:1", "--no-rich"])
    assert_clean(code, capsys.readouterr().err, path, "model.name:", "[1, 2, 2]")


def test_swarm_nodes_name_the_users_file(tmp_path, capsys):
    """A node process of ``p2pfl swarm`` reads ``<run>/config.yaml``; ``--source`` (which
    the launcher passes) makes its messages name the user's file instead."""
    path = write(tmp_path, dataset={"name": "fashionmnist", "root": str(tmp_path / "gone")})
    run_cfg = tmp_path / "run" / "config.yaml"
    run_cfg.parent.mkdir()
    run_cfg.write_text(path.read_text())
    args = ["node", str(run_cfg), "--id", "a", "--broker", "127.0.0.1:1", "--source", str(path)]
    code = main(args)
    err = capsys.readouterr().err
    assert_clean(code, err, path, "dataset.root:", "does not exist")
    assert str(run_cfg) not in err


def test_a_zip_with_a_corrupt_image_names_the_member(tmp_path, capsys):
    png = bytes.fromhex(
        "89504e470d0a1a0a0000000d49484452000000010000000108000000003a7e9b55"
        "0000000a49444154789c636800000082008177cd72b60000000049454e44ae426082"
    )
    zpath = tmp_path / "imgs.zip"
    with zipfile.ZipFile(zpath, "w") as zf:
        for split in ("train", "test"):
            for cls in ("cat", "dog"):
                zf.writestr(f"{split}/{cls}/{cls}.png", png)
        zf.writestr("train/cat/broken.png", b"not a png")
    path = write(tmp_path, dataset={"name": "imagefolder", "root": str(zpath)})
    code = main(["swarm", str(path), "--out", str(tmp_path / "run")])
    assert_clean(code, capsys.readouterr().err, path, "dataset.root:", "broken.png")
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- flags and devices


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--rounds", "0"], "--rounds"),
        (["--timeout", "-1"], "--timeout"),
        (["--broker", "nonsense"], "--broker"),
        (["--dashboard-port", "70000"], "--dashboard-port"),
    ],
)
def test_bad_swarm_flags_are_usage_errors(tmp_path, capsys, args, flag):
    path = write(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["swarm", str(path), *args])
    assert exc.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err


def test_a_device_torch_does_not_know_or_this_machine_lacks(tmp_path, capsys):
    path = write(tmp_path, training={"device": "gpu9"})
    assert main(["validate", str(path)]) == 2
    assert f"{path}: training.device: 'gpu9' is not a torch device" in flat(capsys.readouterr().err)
    import torch

    if torch.cuda.device_count() >= 64:  # pragma: no cover - no such machine
        pytest.skip("this machine has cuda:63")
    path = write(tmp_path, training={"device": "cuda:63"})
    assert main(["validate", str(path), "--no-data"]) == 0  # elsewhere: a warning
    assert "warning" in capsys.readouterr().err
    assert main(["swarm", str(path), "--out", str(tmp_path / "run")]) == 2  # here: an error
    assert f"{path}: training.device: 'cuda:63'" in flat(capsys.readouterr().err)


def test_a_node_file_with_a_bad_broker_is_named_even_under_broker(tmp_path, capsys):
    path = write(tmp_path)
    node_file = tmp_path / "a.yaml"
    node_file.write_text("id: a\nbroker: nohost\n")
    code = main(["node", str(path), "--node-config", str(node_file), "--broker", "h:1"])
    assert_clean(code, capsys.readouterr().err, node_file, "broker:", "'nohost'")
