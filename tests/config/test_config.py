"""Config loading: overrides, and errors that name the file and the field."""

from __future__ import annotations

import pytest

from p2pfl.check.load import (
    apply_overrides,
    load_node_overrides,
    load_topology,
    parse_override,
)
from p2pfl.errors import ConfigError

BASE = """
name: t
rounds: 2
algorithm: {name: uapdfl, params: {th_I: 0.2}}
dataset: {name: synthetic, partition: iid}
nodes: 3
edges: ring
"""


def write(tmp_path, text, name="topo.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_defaults_and_node_count(tmp_path):
    cfg = load_topology(write(tmp_path, BASE))
    assert cfg.node_ids == ["n0", "n1", "n2"]
    assert cfg.algorithm.params["th_I"] == 0.2
    assert cfg.algorithm.params["mu"] == 0.01  # default filled in
    assert cfg.broker.port == 1883


def test_shipped_topologies_validate():
    for name in ("ring-8", "uapdfl-paper", "synthetic"):
        cfg = load_topology(f"topologies/{name}.yaml")
        assert cfg.algorithm.name == "uapdfl"
    assert len(load_topology("topologies/uapdfl-paper.yaml").node_ids) == 30


def test_set_overrides_dotted_paths(tmp_path):
    cfg = load_topology(
        write(tmp_path, BASE),
        [
            "rounds=7",
            "algorithm.params.com=3",
            "training.lr=0.5",
            "edges.kind=full",
            "broker=10.0.0.1:1999",
            "dataset.partition=pathological(2)",
        ],
    )
    assert cfg.rounds == 7
    assert cfg.algorithm.params["com"] == 3
    assert cfg.training.lr == 0.5
    assert cfg.edges.kind == "full"
    assert (cfg.broker.host, cfg.broker.port) == ("10.0.0.1", 1999)
    assert cfg.dataset.partition == "pathological(2)"


def test_parse_override_types():
    assert parse_override("a.b=3") == (["a", "b"], 3)
    assert parse_override("x=[1, 2]") == (["x"], [1, 2])
    assert parse_override("x=hello") == (["x"], "hello")
    with pytest.raises(ValueError, match="key=value"):
        parse_override("novalue")
    with pytest.raises(ValueError, match="not a mapping"):
        apply_overrides({"rounds": 3}, ["rounds.x=1"])


@pytest.mark.parametrize(
    "patch, field, words",
    [
        ("rounds: 0", "rounds", "greater than or equal to 1"),
        ("roundz: 3", "roundz", "unknown field"),
        ("training: {lr: -1}", "training.lr", "greater than 0"),
        ("training: {optimiser: sgd}", "training.optimiser", "unknown field"),
        ("dataset: {name: imagenet}", "dataset.name", "unknown dataset 'imagenet'"),
        ("dataset: {partition: 'dirichlet(x)'}", "dataset.partition", "partition must be"),
        ("model: {name: gpt}", "model.name", "unknown model 'gpt'"),
        ("algorithm: {name: nope}", "algorithm", "unknown algorithm 'nope'"),
        ("algorithm: {name: uapdfl, params: {th_i: 1}}", "algorithm", "params.th_i: unknown field"),
        ("algorithm: {name: uapdfl, params: {com: 0}}", "algorithm", "params.com"),
        ("edges: [[n0, n9]]", "edges", "unknown node id 'n9'"),
        ("edges: {kind: random-k}", "edges", "random-k needs k"),
        ("broker: nowhere", "broker", "host:port"),
        ("nodes: [a, a]", "nodes", "duplicate ids"),
    ],
)
def test_errors_name_file_and_field(tmp_path, patch, field, words):
    path = write(tmp_path, BASE + patch + "\n")
    with pytest.raises(ConfigError) as info:
        load_topology(path)
    err = info.value
    assert err.source == str(path)
    text = str(err)
    assert str(path) in text
    locs = [loc for loc, _ in err.errors]
    assert any(loc == field or loc.startswith(field) for loc in locs), (locs, text)
    assert words in text, text


def test_invalid_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_topology(write(tmp_path, "name: [unclosed\n"))
    with pytest.raises(ConfigError, match="cannot read file"):
        load_topology(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_topology(write(tmp_path, "- a\n- b\n"))


def test_node_overrides_file(tmp_path):
    p = write(tmp_path, "id: n3\ndata_root: /data\ndevice: cpu\nbroker: 1.2.3.4:1883\n", "n3.yaml")
    over = load_node_overrides(p)
    assert over.id == "n3" and over.data_root == "/data"
    bad = write(tmp_path, "id: n3\ndata: /data\n", "bad.yaml")
    with pytest.raises(ConfigError, match="data: unknown field"):
        load_node_overrides(bad)


def test_attack_and_defence_sections_are_checked_by_field():
    from p2pfl.check.load import load_topology
    from p2pfl.errors import ConfigError

    cases = [
        ("attacks=[{kind: nan, nodes: [zz]}]", "attacks[0].nodes: unknown node ids ['zz']"),
        ("attacks=[{kind: nan}]", "attack nan: give nodes or fraction"),
        ("attacks=[{kind: melt, nodes: [a]}]", "attacks[0].kind: Input should be"),
        ("attacks=[{kind: label_flip, nodes: [a], source: 1}]", "source and target go together"),
        ("attacks=[{kind: nan, nodes: [a], from_round: 3, to_round: 2}]", "to_round before"),
        ("defence={rule: krum}", "defence.rule"),
        ("defence={rule: trimmed_mean, beta: 0.5}", "defence.beta"),
        ("defence={max_norm_ratio: 1}", "defence.max_norm_ratio"),
    ]
    for override, text in cases:
        try:
            load_topology("topologies/synthetic.yaml", [override])
        except ConfigError as exc:
            assert text in str(exc) and "synthetic.yaml" in str(exc), (override, str(exc))
        else:
            raise AssertionError(f"{override} was accepted")
    cfg = load_topology(
        "topologies/synthetic.yaml", ["attacks=[{kind: sign_flip, fraction: 0.5}]", "nodes=8"]
    )
    drawn = cfg.attackers()
    assert len(drawn) == 4 and drawn == cfg.attackers()  # the same set, every time
