"""The ``network:`` and ``devices:`` sections: presets, who a setting names, paths."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from p2pfl.config.emulation import PRESETS, access_links, device_of, path_between
from p2pfl.config.schema import TopologyConfig


def _cfg(**kw) -> TopologyConfig:
    return TopologyConfig(name="t", nodes=6, **kw)


def test_a_path_is_both_access_links_in_series() -> None:
    cfg = _cfg(
        network={
            "default": "lte",
            "links": [{"nodes": ["n0"], "preset": "wan", "latency_ms": 150, "bandwidth_mbps": 5}],
        }
    )
    acc = access_links(cfg.network, cfg.seed, cfg.node_hosts)
    p = path_between("n0", "n1", acc, cfg.network)
    assert p.latency_ms == 150 + PRESETS["lte"].latency_ms
    assert p.bandwidth_mbps == 5
    assert p.loss == pytest.approx(1 - (1 - 0.001) * (1 - 0.005))
    assert p.jitter_ms == pytest.approx((5.0**2 + 10.0**2) ** 0.5)


def test_an_edge_entry_overrides_the_access_links_both_ways() -> None:
    cfg = _cfg(network={"default": "lan", "links": [{"edge": ["n1", "n2"], "latency_ms": 42}]})
    acc = access_links(cfg.network, cfg.seed, cfg.node_hosts)
    assert path_between("n2", "n1", acc, cfg.network).latency_ms == 42
    assert path_between("n1", "n3", acc, cfg.network).latency_ms == 1.0


def test_no_network_section_means_no_emulation() -> None:
    cfg = _cfg()
    assert not cfg.network.active
    assert (
        path_between("n0", "n1", access_links(cfg.network, 0, cfg.node_hosts), cfg.network) is None
    )


def test_a_fraction_is_drawn_with_the_seed() -> None:
    spec = {"devices": [{"fraction": 0.5, "speed": 0.25}]}

    def slow(seed: int) -> list[str]:
        cfg = _cfg(seed=seed, **spec)
        return [n for n in cfg.node_ids if device_of(cfg.devices, n, seed, cfg.node_hosts)[0] < 1]

    assert len(slow(0)) == 3 and slow(0) == slow(0)
    assert any(slow(s) != slow(0) for s in range(1, 6))


def test_hosts_name_the_nodes_pinned_to_them() -> None:
    cfg = TopologyConfig(
        name="t",
        nodes=[{"id": "a", "host": "jetson"}, {"id": "b", "host": "laptop"}],
        devices=[{"hosts": ["jetson"], "speed": 0.5, "offline": [[10, 20]]}],
    )
    assert device_of(cfg.devices, "a", 0, cfg.node_hosts) == (0.5, [(10.0, 20.0)])
    assert device_of(cfg.devices, "b", 0, cfg.node_hosts) == (1.0, [])


@pytest.mark.parametrize(
    "bad, where",
    [
        ({"network": {"links": [{"nodes": ["zz"], "preset": "lte"}]}}, "unknown node ids"),
        ({"network": {"links": [{"preset": "lte"}]}}, "one of"),
        ({"network": {"default": "5g"}}, "default"),
        ({"devices": [{"nodes": ["n0"], "speed": 0}]}, "speed"),
        ({"devices": [{"nodes": ["n0"], "offline": [[5, 1]]}]}, "start < end"),
        ({"devices": [{"nodes": ["nx"]}]}, "unknown node ids"),
        ({"transfer": {"compress": "topk(2)"}}, "compress"),
        ({"timing": {"mode": "later"}}, "mode"),
    ],
)
def test_bad_sections_are_refused_with_the_field(bad, where) -> None:
    with pytest.raises(ValidationError, match=where):
        _cfg(**bad)
