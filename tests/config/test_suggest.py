""" "Did you mean": the nearest valid names for a mistyped field (at any depth), method,
model, dataset or choice (``p2pfl/config/suggest.py``, ``p2pfl/check/load.py``)."""

from __future__ import annotations

import pytest

from p2pfl.check.load import fields_at, load_node_overrides, topology_from_dict
from p2pfl.config.schema import NodeOverrides, TopologyConfig
from p2pfl.config.suggest import did_you_mean, nearest, with_suggestion
from p2pfl.errors import ConfigError


def test_nearest_is_difflibs_closest_first_without_case():
    assert nearest("personnal", ["name", "personal", "kwargs", "head"]) == ["personal"]
    assert nearest("FedAvg", ["fedavg", "local"]) == ["fedavg"]
    assert nearest("resnet", ["cnn", "lenet", "mlp", "resnet18", "vgg11"]) == ["resnet18", "lenet"]
    assert nearest("zzz", ["swarm", "node"]) == []
    assert nearest("a", ["a", "b"]) == []  # never the name itself
    assert len(nearest("ab", ["abc", "abd", "abe", "abf"], n=3)) == 3


def test_did_you_mean_lists_one_two_or_three_names():
    assert did_you_mean("round", ["rounds", "seed"]) == "did you mean 'rounds'?"
    assert did_you_mean("resnet", ["resnet18", "lenet"]) == "did you mean 'resnet18' or 'lenet'?"
    assert did_you_mean("ab", ["abc", "abd", "abe"]) == "did you mean 'abc', 'abd' or 'abe'?"
    assert did_you_mean("zzz", ["swarm"]) == ""
    assert with_suggestion("unknown field", "zzz", ["swarm"]) == "unknown field"
    assert with_suggestion("unknown field", "swarn", ["swarm"]) == (
        "unknown field (did you mean 'swarm'?)"
    )


def test_fields_at_walks_sections_lists_and_union_branches():
    assert "rounds" in fields_at(TopologyConfig, ("round",))
    assert fields_at(TopologyConfig, ("model", "personnal")) == list(
        TopologyConfig.model_fields["model"].annotation.model_fields
    )
    assert "factor" in fields_at(TopologyConfig, ("attacks", 0, "factr"))
    assert "k" in fields_at(TopologyConfig, ("edges", "GeneratedEdges", "kk"))
    assert "noise_multiplier" in fields_at(TopologyConfig, ("privacy", "dp", "sigma"))
    assert fields_at(TopologyConfig, ("algorithm", "params", "x", "y")) == []  # free keys
    assert "data_root" in fields_at(NodeOverrides, ("data_rot",))


def _errors(data: dict) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        topology_from_dict({"name": "x", "nodes": 2, **data}, source="t.yaml")
    return dict(info.value.errors)


@pytest.mark.parametrize(
    ("data", "field", "message"),
    [
        ({"round": 3}, "round", "unknown field (did you mean 'rounds'?)"),
        (
            {"model": {"personnal": ["fc"]}},
            "model.personnal",
            "unknown field (did you mean 'personal'?)",
        ),
        (
            {"training": {"optimiser": "sgd"}},
            "training.optimiser",
            "unknown field (did you mean 'optimizer' or 'optimizer_state'?)",
        ),
        (
            {"privacy": {"dp": {"noise_multipler": 1}}},
            "privacy.dp.noise_multipler",
            "unknown field (did you mean 'noise_multiplier'?)",
        ),
        (
            {"attacks": [{"kind": "scale", "nodes": ["n0"], "factr": 3}]},
            "attacks[0].factr",
            "did you mean 'factor'",
        ),
        ({"edges": {"kind": "ring", "kk": 3}}, "edges.kk", "did you mean 'k'?"),
        ({"edges": {"kind": "rign"}}, "edges.kind", "(did you mean 'ring'?)"),
        ({"defence": {"rule": "medain"}}, "defence.rule", "did you mean 'median'"),
        (
            {"model": {"name": "resnet"}},
            "model.name",
            "unknown model 'resnet' (did you mean 'resnet18' or 'lenet'?): one of cnn",
        ),
        (
            {"dataset": {"name": "fashion-mnist"}},
            "dataset.name",
            "unknown dataset 'fashion-mnist' (did you mean 'fashionmnist'?): one of",
        ),
        (
            {"algorithm": {"name": "fedavgg"}},
            "algorithm",
            "unknown algorithm 'fedavgg' (did you mean 'fedavg'",
        ),
        (
            {"algorithm": {"name": "uapdfl", "params": {"kapa": 2}}},
            "algorithm",
            "params.kapa: unknown field (did you mean 'kappa'?)",
        ),
    ],
)
def test_a_typo_names_the_nearest_valid_names(data, field, message):
    errors = _errors(data)
    assert field in errors, errors
    assert message in errors[field], errors[field]


def test_nothing_near_suggests_nothing():
    assert _errors({"zzzzzz": 1})["zzzzzz"] == "unknown field"


def test_a_nodes_file_typo_is_suggested(tmp_path):
    path = tmp_path / "n.yaml"
    path.write_text("id: a\ndata_rot: x\n")
    with pytest.raises(
        ConfigError, match=r"data_rot: unknown field \(did you mean 'data_root'\?\)"
    ):
        load_node_overrides(path)
