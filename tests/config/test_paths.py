"""Paths relative to the file that names them (``p2pfl/config/paths.py``): a topology's
``dataset.root``, ``dataset.stats``, ``security.certs`` and ``code_dir``, and a ``nodes/``
file's ``data_root`` and ``certs``, resolve against the file's folder whatever the current
directory; an absolute path is unchanged; the command line's values resolve against the
current directory; a missing path is reported as the absolute path looked at."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from p2pfl.check.load import load_node_overrides, load_topology
from p2pfl.cli import main
from p2pfl.config.paths import PathBase, field_value, is_relative, resolve_fields
from p2pfl.errors import ConfigError

CSV = "x1,x2,label\n" + "".join(f"{i % 7}.0,{(i * 3) % 5}.0,{i % 2}\n" for i in range(40))


def test_resolve_keeps_absolute_home_and_urls_and_joins_the_rest(tmp_path):
    base = PathBase(str(tmp_path / "proj"), "the folder of t.yaml")
    assert base.resolve("data/{id}.csv") == str(tmp_path / "proj" / "data" / "{id}.csv")
    assert base.resolve("../other/./data") == str(tmp_path / "other" / "data")
    for value in ("/srv/data", "~/data", "s3://bucket/x"):
        assert base.resolve(value) == value and not is_relative(value)
    assert not is_relative("") and not is_relative(None) and not is_relative(3)
    assert base.note == f"relative paths resolve against {tmp_path / 'proj'}, the folder of t.yaml"


def test_resolve_fields_rewrites_only_relative_strings_in_mappings(tmp_path):
    base = PathBase(str(tmp_path), "here")
    data = {"dataset": {"root": "d", "stats": "/abs.json"}, "security": "oops", "code_dir": "."}
    notes = resolve_fields(
        data, ("dataset.root", "dataset.stats", "security.certs", "code_dir"), base
    )
    assert data == {
        "dataset": {"root": str(tmp_path / "d"), "stats": "/abs.json"},
        "security": "oops",  # not a mapping: left for the schema to report
        "code_dir": str(tmp_path),
    }
    assert set(notes) == {"dataset.root", "code_dir"}
    assert field_value(data, "dataset.root") == str(tmp_path / "d")
    assert field_value(data, "security.certs") is None


@pytest.fixture
def project(tmp_path):
    """A topology in a subfolder, its own data beside it, and two other directories."""
    proj = tmp_path / "mine"
    (proj / "data").mkdir(parents=True)
    (proj / "data" / "lab-a.csv").write_text(CSV)
    (proj / "data" / "lab-b.csv").write_text(CSV)
    (proj / "stats.json").write_text('{"mean": {"x1": 0, "x2": 0}, "std": {"x1": 1, "x2": 1}}')
    (proj / "topology.yaml").write_text(
        "name: mine\nnodes: [lab-a, lab-b]\nedges: full\nalgorithm: {name: fedavg}\n"
        "dataset:\n  name: csv\n  root: data/{id}.csv\n  partition: none\n  classes: 2\n"
        "  stats: stats.json\nmodel: {name: mlp}\nsecurity: {certs: certs}\n"
    )
    (tmp_path / "elsewhere").mkdir()
    return proj


@pytest.mark.parametrize("cwd", [".", "mine", "elsewhere", "mine/data"])
def test_a_topology_in_a_subfolder_means_the_same_from_any_directory(project, monkeypatch, cwd):
    monkeypatch.chdir(project.parent / cwd)
    rel = os.path.relpath(project / "topology.yaml")
    cfg = load_topology(rel)
    assert cfg.dataset.root == str(project / "data" / "{id}.csv")
    assert cfg.dataset.stats == str(project / "stats.json")
    assert cfg.security.certs == str(project / "certs")
    assert cfg.code_dir == str(project)
    note = f"relative paths resolve against {project}, the folder of topology.yaml"
    assert cfg.path_note("dataset.root") == note
    assert main(["validate", rel]) == 0


def test_an_absolute_path_is_unchanged(project, monkeypatch):
    text = (project / "topology.yaml").read_text()
    absolute = str(project / "data" / "{id}.csv")
    (project / "abs.yaml").write_text(text.replace("root: data/{id}.csv", f"root: {absolute}"))
    monkeypatch.chdir(project.parent / "elsewhere")
    cfg = load_topology(project / "abs.yaml")
    assert cfg.dataset.root == absolute and cfg.path_note("dataset.root") == ""


def test_the_command_lines_paths_resolve_against_the_current_directory(project, monkeypatch):
    monkeypatch.chdir(project / "data")
    cfg = load_topology(
        project / "topology.yaml", ["dataset.root={id}.csv", "dataset.stats=s.json"]
    )
    assert cfg.dataset.root == str(project / "data" / "{id}.csv")
    assert cfg.dataset.stats == str(project / "data" / "s.json")
    assert cfg.path_note("dataset.root") == (
        f"relative paths resolve against {project / 'data'}, the current directory"
    )
    assert cfg.security.certs == str(project / "certs")  # not overridden: the file's folder


def test_a_nodes_file_resolves_against_its_own_folder(project, monkeypatch):
    (project / "nodes").mkdir()
    node_file = project / "nodes" / "lab-a.yaml"
    node_file.write_text("id: lab-a\ndata_root: ../data/lab-a.csv\ncerts: /etc/p2pfl\n")
    monkeypatch.chdir(project.parent / "elsewhere")
    over = load_node_overrides(os.path.relpath(node_file))
    assert over.data_root == str(project / "data" / "lab-a.csv")
    assert over.certs == "/etc/p2pfl"
    assert over.path_note("data_root").endswith(f"{project / 'nodes'}, the folder of lab-a.yaml")


def test_a_missing_root_names_the_path_it_resolved_to(project, monkeypatch, capsys):
    (project / "data" / "lab-b.csv").unlink()
    monkeypatch.chdir(project.parent)
    assert main(["validate", "mine/topology.yaml"]) == 2
    err = " ".join(capsys.readouterr().err.split())  # rich may wrap
    missing = project / "data" / "lab-b.csv"
    assert (
        f"mine/topology.yaml: dataset.root: node 'lab-b': {missing} does not exist (relative "
        f"paths resolve against {project}, the folder of topology.yaml)"
    ) in err
    # given on the command line: the current directory, named as such
    assert main(["validate", "mine/topology.yaml", "--data-root", "nowhere/{id}.csv"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{project.parent / 'nowhere' / 'lab-a.csv'} does not exist" in err
    assert f"against {project.parent}, the current directory" in err


def test_a_built_in_dataset_root_that_is_missing_is_shown_resolved(tmp_path, monkeypatch):
    (tmp_path / "t.yaml").write_text("name: x\nnodes: 2\ndataset: {name: mnist, root: gone}\n")
    monkeypatch.chdir(tmp_path.parent)
    from p2pfl.check.checked import load_checked

    with pytest.raises(ConfigError) as info:
        load_checked(tmp_path / "t.yaml")
    assert f"{tmp_path / 'gone'} does not exist (relative paths resolve against {tmp_path}" in str(
        info.value
    )


def test_user_code_is_imported_from_the_topologys_folder(project, monkeypatch):
    (project / "lab_model.py").write_text(
        "from torch import nn\n\n"
        "def make(num_classes, input_shape):\n"
        "    return nn.Sequential(nn.Linear(input_shape[0], 4), nn.ReLU(), nn.Linear(4, num_classes))\n"
    )
    monkeypatch.chdir(project.parent / "elsewhere")
    monkeypatch.setattr(sys, "path", list(sys.path))  # the loader's change stays in this test
    try:
        rel = os.path.relpath(project / "topology.yaml")
        cfg = load_topology(rel, ["model.name=lab_model:make"])
        assert cfg.dump()["code_dir"] == str(project)  # recorded: a run directory imports it too
        assert main(["validate", rel, "--set", "model.name=lab_model:make"]) == 0
    finally:
        sys.modules.pop("lab_model", None)
    # a built-in model records nothing new
    assert "code_dir" not in load_topology(rel).dump()


def test_a_missing_module_names_the_folders_looked_in(project, monkeypatch, capsys):
    monkeypatch.chdir(project.parent / "elsewhere")
    monkeypatch.setattr(sys, "path", list(sys.path))
    rel = os.path.relpath(project / "topology.yaml")
    assert main(["validate", rel, "--set", "model.name=nowhere_model:make"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "no module named 'nowhere_model'" in err
    assert f"looked in {project} (the topology's folder), the current directory" in err


def test_the_shipped_topologies_read_the_same_data_from_any_directory(monkeypatch, tmp_path):
    """``topologies/*.yaml`` name the data folder beside the repository two levels up from
    their own folder: what their one level up meant from the repository root before."""
    repo = Path(__file__).resolve().parents[2]
    want = str(repo.parent / "shared" / "data")
    for cwd in (repo, tmp_path):
        monkeypatch.chdir(cwd)
        for name in (
            "ring-8",
            "uapdfl-fmnist",
            "diversifed-fmnist",
            "centralized-cifar10",
            "uapdfl-paper",
            "lan-3hosts",
        ):
            assert load_topology(repo / "topologies" / f"{name}.yaml").dataset.root == want
        lan = load_topology(repo / "topologies" / "lan-3hosts.yaml")
        assert lan.security.certs == str(repo / "certs" / "lan-3hosts")  # as from the root
    assert load_node_overrides(repo / "nodes" / "laptop.yaml").data_root == want
