"""Methods from outside the package: an installed distribution's ``p2pfl.methods`` entry
point (a real ``.dist-info`` on the path, as pip leaves it), a ``package.module:Class`` path
in a topology, and :func:`register_method`; ``p2pfl methods`` lists them with their knobs."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest
from cli_run import run_p2pfl

from p2pfl.algorithms import DecentralizedAlgorithm, get_algorithm, register_method
from p2pfl.algorithms.base import REGISTRY

PLUGIN = textwrap.dedent(
    '''
    """A user's method in one file: average the whole models of every live neighbour."""
    from p2pfl.algorithms import DecentralizedAlgorithm, register
    from p2pfl.algorithms.base import Params
    from p2pfl.learning.state import weighted_mean


    class PlainParams(Params):
        self_weight: float = 1.0


    class PlainAverage(DecentralizedAlgorithm):
        name = "plainavg"
        Params = PlainParams

        def plan(self, gossip):
            return {peer: "all" for peer in sorted(gossip)}, {}

        def merge(self, gossip, pulled):
            states = [self.model_state(), *(pulled[p] for p in sorted(pulled))]
            weights = [self.params.self_weight] + [1.0] * len(pulled)
            self.model.load_state_dict(weighted_mean(states, weights))
            return {"merged_from": sorted(pulled)}
    '''
)


@pytest.fixture
def plugin_path(tmp_path: Path) -> Path:
    """A directory holding the plugin module and the ``.dist-info`` pip would install."""
    (tmp_path / "plainavg_plugin.py").write_text(PLUGIN)
    dist = tmp_path / "plainavg_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: plainavg-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[p2pfl.methods]\nplainavg = plainavg_plugin:PlainAverage\n"
    )
    return tmp_path


def run_cli(args: list[str], path: Path, cwd: Path) -> subprocess.CompletedProcess:
    return run_p2pfl(*args, path=[path], cwd=cwd)


def test_p2pfl_methods_lists_an_entry_point_method(plugin_path, tmp_path):
    out = run_cli(["methods"], plugin_path, tmp_path)
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if "plainavg" in line)
    assert "decentralized" in row and "package plainavg-plugin" in row
    assert "self_weight=1.0" in row
    assert "uapdfl" in out.stdout and "built-in" in out.stdout


@pytest.mark.integration
def test_an_entry_point_method_runs_a_swarm(plugin_path, tmp_path):
    topology = Path(__file__).resolve().parents[2] / "topologies" / "synthetic.yaml"
    out = run_cli(
        [
            "swarm",
            str(topology),
            "--method",
            "plainavg",
            "--set",
            "nodes=[a, b, c]",
            "--set",
            "rounds=2",
            "--set",
            "timing.linger_s=5",
            "--out",
            str(tmp_path / "run"),
            "--no-progress",
        ],
        plugin_path,
        tmp_path,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = (tmp_path / "run" / "nodes" / "a.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == 2 and records[-1]["method"]["merged_from"] == ["b", "c"]


def test_a_method_by_import_path(plugin_path, monkeypatch):
    monkeypatch.syspath_prepend(str(plugin_path))
    try:
        cls = get_algorithm("plainavg_plugin:PlainAverage")
        assert cls.__name__ == "PlainAverage"
        assert get_algorithm("plainavg_plugin:PlainAverage") is cls
    finally:
        REGISTRY.pop("plainavg_plugin:PlainAverage", None)


def test_register_method_checks_the_contract():
    class Mine(DecentralizedAlgorithm):
        name = "mine-for-test"

        def plan(self, gossip):
            return {}, {}

        def merge(self, gossip, pulled):
            return {}

    try:
        assert register_method(Mine) is Mine and get_algorithm("mine-for-test") is Mine
        assert register_method(Mine) is Mine  # twice: harmless
        with pytest.raises(TypeError, match="not a method"):
            register_method(dict)
        with pytest.raises(ValueError, match="registered already"):
            register_method(type("Other", (Mine,), {}), name="mine-for-test")
        with pytest.raises(ValueError, match="unknown algorithm 'nope'"):
            get_algorithm("nope")
    finally:
        REGISTRY.pop("mine-for-test", None)
