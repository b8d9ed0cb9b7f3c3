"""A run spec (:mod:`p2pfl.sites.consent.run_spec`) and ``p2pfl policy check``: the run_id names
the spec however it is written, what a policy reads of it, and the dry run's decision."""

from __future__ import annotations

import json

import pytest

from p2pfl.check.load import topology_from_dict
from p2pfl.cli import main
from p2pfl.config.dataset_schema import DatasetConfig
from p2pfl.errors import ConfigError
from p2pfl.sites.consent.run_spec import canonical, load_run_spec, run_facts, run_id, spec_from_dict
from p2pfl.sites.runs.topology import worker_topology

SPEC = {"name": "ward-fedavg", "rounds": 3, "algorithm": {"name": "fedavg"}, "data": "ward"}


def test_the_run_id_names_the_spec_however_it_is_written():
    a = spec_from_dict(SPEC)
    b = spec_from_dict({**SPEC, "seed": 0, "members": "any", "quorum": {"min_accept": 2}})
    assert run_id(a) == run_id(b) and len(run_id(a)) == 16
    assert run_id(spec_from_dict({**SPEC, "rounds": 4})) != run_id(a)


def test_what_a_policy_reads_of_a_spec():
    spec = spec_from_dict(
        {
            **SPEC,
            "algorithm": {"name": "fedper"},
            "members": ["a", "b", "c"],
            "privacy": {"dp": {"target_epsilon": 4.0}, "secagg": True},
        }
    )
    facts = run_facts(spec, "a")
    assert facts.shares == {"shared_part"} and facts.members == ("a", "b", "c")
    assert (facts.dp_epsilon, facts.secagg, facts.plugins) == (4.0, True, False)
    assert run_facts(spec, "a", members=["a", "b"]).members == ("a", "b")  # the commit's
    user = spec_from_dict({**SPEC, "model": {"name": "mymodels:make"}})
    assert run_facts(user, "a").plugins


@pytest.mark.parametrize(
    "edges", ["ring", "full", {"kind": "random-k", "k": 2}, {"kind": "star", "center": "b"}]
)
def test_a_spec_takes_generated_edges_as_a_topology_does(edges):
    spec = spec_from_dict({**SPEC, "edges": edges})
    topology = topology_from_dict({"name": "t", "nodes": ["a", "b", "c"], "edges": edges})
    assert spec.edges == topology.edges
    body = worker_topology(
        spec,
        run_id=run_id(spec),
        site="a",
        members=["a", "b", "c"],
        binding=DatasetConfig(name="synthetic", num_classes=3),
        broker="127.0.0.1:1883",
        certs=None,
        epsilon=None,
    )
    assert topology_from_dict(body).edges == spec.edges  # what the worker trains over


def test_edges_full_keeps_the_run_id_of_a_spec_without_edges():
    """``edges: full`` is the default, written as a topology writes it: a spec that leaves
    edges out, one that writes ``{kind: full}`` and one that writes ``full`` have one
    canonical JSON (so one run_id), its edges as specs were first hashed."""
    texts = {canonical(spec_from_dict({**SPEC, **e})) for e in ({}, {"edges": "full"})}
    texts.add(canonical(spec_from_dict({**SPEC, "edges": {"kind": "full"}})))
    [text] = texts
    assert '"edges":{"center":null,"k":null,"kind":"full","p":null}' in text


@pytest.mark.parametrize(
    "change, words",
    [
        ({"dataset": {"name": "csv"}}, "dataset: unknown field"),
        ({"nodes": [{"id": "a"}]}, "nodes: unknown field"),
        ({"attacks": []}, "attacks: unknown field"),
        ({"members": ["a", "a"]}, "named twice"),
        ({"members": ["a"], "quorum": {"min_accept": 2}}, "2 of 1 members"),
        ({"algorithm": {"name": "fedavg", "params": {"fractoin": 0.1}}}, "fraction"),
        ({"edges": [["a", "b"]]}, "edges: a run spec's edges are generated"),
        ({"edges": "fulll"}, "did you mean 'full'"),
        ({"edges": {"kind": "random-k"}}, "edges: random-k needs k"),
        ({"members": ["a", "b"], "edges": {"kind": "star", "center": "c"}}, "edges.center"),
    ],
)
def test_a_spec_has_no_device_fields_and_checks_its_knobs(change, words):
    with pytest.raises(ConfigError) as err:
        spec_from_dict({**SPEC, **change}, "run.yaml")
    assert "run.yaml" in str(err.value) and words in str(err.value)


SITE = """
site: hospital-b
swarm: hospitals
state_dir: state
data:
  ward: {name: csv, root: ward.csv, label: outcome, classes: [good, bad]}
policy:
  methods: {allow: [uapdfl]}
  privacy: {require_dp: true, max_epsilon: 8}
"""


def test_policy_check_prints_the_decision_and_its_reasons(tmp_path, capsys):
    (tmp_path / "site.yaml").write_text(SITE)
    (tmp_path / "ward.csv").write_text("f1,f2,outcome\n1,2,good\n3,4,bad\n")
    (tmp_path / "run.yaml").write_text(json.dumps(SPEC))
    args = ["policy", "check", str(tmp_path / "run.yaml"), "--site", str(tmp_path / "site.yaml")]
    assert main([*args, "--proposer", "hospital-a"]) == 1
    out = capsys.readouterr().out
    assert "hospital-b: run" in out and "reject" in out
    assert "method_not_allowed: method 'fedavg' is not in methods.allow" in out
    (tmp_path / "run.yaml").write_text(json.dumps({**SPEC, "algorithm": {"name": "uapdfl"}}))
    assert main([*args, "--json"]) == 0
    decision = json.loads(capsys.readouterr().out)
    spec = load_run_spec(tmp_path / "run.yaml")
    assert decision["run_id"] == run_id(spec) and decision["vote"] == "accept"
    assert decision["dp_epsilon"] == 8  # the site's DP, though the run asked none


def test_policy_check_names_a_bad_file(tmp_path, capsys):
    (tmp_path / "site.yaml").write_text(SITE)
    (tmp_path / "run.yaml").write_text("name: x\ndata: ward\nround: 3\n")
    rc = main(
        ["policy", "check", str(tmp_path / "run.yaml"), "--site", str(tmp_path / "site.yaml")]
    )
    assert rc == 2
    out = capsys.readouterr()
    assert "run.yaml" in out.out + out.err and "round" in out.out + out.err
