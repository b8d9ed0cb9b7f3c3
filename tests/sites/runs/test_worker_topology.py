"""The topology a site's worker runs: the spec's fields and the site's own (binding, broker,
certificates, the ε its policy bounds), checked as any topology is."""

from __future__ import annotations

import pytest

from p2pfl.check.load import topology_from_dict
from p2pfl.config.dataset_schema import DatasetConfig
from p2pfl.sites.consent.run_spec import run_id, spec_from_dict
from p2pfl.sites.runs.topology import run_swarm_name, site_privacy, worker_topology


def _topology(epsilon=None, certs=None, **spec_fields):
    spec = spec_from_dict({"name": "t", "data": "d", "rounds": 2, **spec_fields})
    body = worker_topology(
        spec,
        run_id=run_id(spec),
        site="b",
        members=["c", "b", "a"],
        binding=DatasetConfig(name="synthetic", num_classes=3),
        broker="127.0.0.1:1999",
        certs=certs,
        epsilon=epsilon,
    )
    return spec, body, topology_from_dict(body)


def test_the_worker_topology_is_the_spec_on_the_sites_binding():
    spec, body, cfg = _topology()
    assert cfg.name == f"t-{run_id(spec)}" and cfg.node_ids == ["a", "b", "c"]
    assert cfg.dataset.num_classes == 3 and str(cfg.broker) == "127.0.0.1:1999"
    assert cfg.rounds == 2 and cfg.privacy is None and not cfg.security.sign
    assert not {"data", "members", "quorum", "vote_deadline_s"} & set(body)


def test_certs_turn_on_tls_and_signatures():
    _, _, cfg = _topology(certs="/etc/p2pfl/certs")
    assert cfg.security.tls and cfg.security.sign and cfg.security.certs == "/etc/p2pfl/certs"


def test_the_sites_epsilon_applies_whatever_the_spec_asks():
    _, _, cfg = _topology(epsilon=8.0)
    assert cfg.privacy.dp.target_epsilon == 8.0  # the spec asked no DP
    _, _, cfg = _topology(epsilon=8.0, privacy={"dp": {"target_epsilon": 20}})
    assert cfg.privacy.dp.target_epsilon == 8.0  # it asked more
    _, _, cfg = _topology(epsilon=8.0, privacy={"dp": {"target_epsilon": 2}})
    assert cfg.privacy.dp.target_epsilon == 2  # it asked less: its own
    _, _, cfg = _topology(epsilon=8.0, privacy={"dp": {"noise_multiplier": 1.1}})
    assert cfg.privacy.dp.target_epsilon == 8.0 and cfg.privacy.dp.noise_multiplier is None


def test_no_dp_asked_and_none_required_is_no_privacy_section():
    spec = spec_from_dict({"name": "t", "data": "d"})
    assert site_privacy(spec, None) is None


def test_a_site_outside_the_members_gets_no_topology():
    spec = spec_from_dict({"name": "t", "data": "d"})
    with pytest.raises(ValueError, match="not a committed member"):
        worker_topology(
            spec,
            run_id="0" * 16,
            site="z",
            members=["a", "b"],
            binding=DatasetConfig(),
            broker="h:1",
            certs=None,
            epsilon=None,
        )


def test_the_run_swarm_name_fits_an_id():
    spec = spec_from_dict({"name": "x" * 64, "data": "d"})
    name = run_swarm_name(spec, run_id(spec))
    assert len(name) == 64 and name.endswith(run_id(spec))
