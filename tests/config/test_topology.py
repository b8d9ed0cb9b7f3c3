"""p2pfl.config.topology: generators, determinism, explicit edges, warnings."""

from __future__ import annotations

import pytest

from p2pfl.check.load import topology_from_dict
from p2pfl.config.topology import build_graph, graph_warnings, neighbours
from p2pfl.errors import ConfigError


def cfg(nodes=6, edges="ring", seed=0, **extra):
    return topology_from_dict({"name": "t", "nodes": nodes, "edges": edges, "seed": seed, **extra})


def edge_set(g):
    return {frozenset(e) for e in g.edges()}


def degrees(g):
    return sorted(d for _, d in g.degree())


def test_nodes_in_config_order():
    c = cfg(nodes=["z", "a", "m"], edges="full")
    assert list(build_graph(c).nodes) == ["z", "a", "m"]


@pytest.mark.parametrize("n, expected", [(1, 0), (2, 1), (3, 3), (8, 8)])
def test_ring(n, expected):
    g = build_graph(cfg(n, "ring"))
    assert g.number_of_nodes() == n and g.number_of_edges() == expected
    if n >= 3:
        assert degrees(g) == [2] * n
        assert neighbours(cfg(n, "ring"), "n0") == sorted(["n1", f"n{n - 1}"])


@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_full(n):
    g = build_graph(cfg(n, "full"))
    assert g.number_of_edges() == n * (n - 1) // 2
    assert degrees(g) == [n - 1] * n


def test_star_default_hub_is_first_node():
    g = build_graph(cfg(5, "star"))
    assert g.number_of_edges() == 4
    assert g.degree("n0") == 4 and all(g.degree(f"n{i}") == 1 for i in range(1, 5))


def test_star_with_center():
    c = cfg(5, {"kind": "star", "center": "n3"})
    g = build_graph(c)
    assert g.degree("n3") == 4 and g.degree("n0") == 1
    assert neighbours(c, "n3") == ["n0", "n1", "n2", "n4"]
    assert neighbours(c, "n1") == ["n3"]


def test_star_unknown_center_rejected():
    with pytest.raises(ConfigError, match="center"):
        cfg(3, {"kind": "star", "center": "nope"})


@pytest.mark.parametrize("n", [1, 2, 6])
def test_line(n):
    g = build_graph(cfg(n, "line"))
    assert g.number_of_edges() == n - 1
    if n > 2:
        assert degrees(g) == [1, 1] + [2] * (n - 2)
        assert neighbours(cfg(n, "line"), "n0") == ["n1"]


def test_random_k_degrees_and_determinism():
    spec = {"kind": "random-k", "k": 2}
    g = build_graph(cfg(12, spec, seed=7))
    assert min(degrees(g)) >= 2
    assert edge_set(g) == edge_set(build_graph(cfg(12, spec, seed=7)))
    assert edge_set(g) != edge_set(build_graph(cfg(12, spec, seed=8)))


def test_random_k_large_k_is_full():
    c = cfg(5, {"kind": "random-k", "k": 10})
    assert build_graph(c).number_of_edges() == 10
    assert any("full graph" in w for w in graph_warnings(c))
    assert build_graph(cfg(5, {"kind": "random-k", "k": 4})).number_of_edges() == 10


def test_random_k_needs_k():
    with pytest.raises(ConfigError, match="random-k needs k"):
        cfg(5, {"kind": "random-k"})


def test_erdos_determinism_and_extremes():
    spec = {"kind": "erdos", "p": 0.3}
    g = build_graph(cfg(20, spec, seed=1))
    assert edge_set(g) == edge_set(build_graph(cfg(20, spec, seed=1)))
    assert edge_set(g) != edge_set(build_graph(cfg(20, spec, seed=2)))
    assert 0 < g.number_of_edges() < 190
    assert build_graph(cfg(6, {"kind": "erdos", "p": 1.0})).number_of_edges() == 15


def test_erdos_needs_p():
    with pytest.raises(ConfigError, match="erdos needs p"):
        cfg(5, {"kind": "erdos"})


def test_seed_is_bounded_to_what_every_seeding_api_takes():
    """A negative seed is refused naming ``seed`` (a node seeds NumPy with it, which takes
    none), and so is one of 2^32 or more (NumPy's legacy seeds stop below it); the largest
    accepted one still builds the same graph every time."""
    spec = {"kind": "erdos", "p": 0.5}
    for bad in (-3, 2**32):
        with pytest.raises(ConfigError, match="seed"):
            cfg(8, spec, seed=bad)
    top = 2**32 - 1
    assert edge_set(build_graph(cfg(8, spec, seed=top))) == edge_set(
        build_graph(cfg(8, spec, seed=top))
    )


def test_explicit_edges():
    c = cfg(["a", "b", "c", "d"], [["a", "b"], ["c", "b"], ["b", "a"]])
    g = build_graph(c)
    assert edge_set(g) == {frozenset("ab"), frozenset("bc")}
    assert neighbours(c, "b") == ["a", "c"]
    assert neighbours(c, "d") == []
    warnings = graph_warnings(c)
    assert any("isolated" in w and "d" in w for w in warnings)
    assert any("disconnected" in w for w in warnings)
    assert any("duplicate" in w for w in warnings)


def test_explicit_edges_unknown_node_rejected():
    with pytest.raises(ConfigError, match="unknown node"):
        cfg(["a", "b"], [["a", "x"]])


def test_neighbours_sorted_and_unknown_node():
    c = cfg(["d", "b", "a", "c"], "full")
    assert neighbours(c, "b") == ["a", "c", "d"]
    with pytest.raises(ValueError, match="not in swarm"):
        neighbours(c, "zz")


def test_warnings():
    assert graph_warnings(cfg(4, "ring")) == []
    assert any("one node" in w for w in graph_warnings(cfg(1, "ring")))
    c = cfg(30, {"kind": "erdos", "p": 0.01}, seed=0)
    assert any("isolated" in w for w in graph_warnings(c))
    assert any("ignored" in w for w in graph_warnings(cfg(4, {"kind": "ring", "k": 2})))
