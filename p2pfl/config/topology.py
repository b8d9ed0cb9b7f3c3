"""Who talks to whom: the swarm's undirected graph, from explicit edges or a generator.

Generators (``edges: {kind: ...}`` in a topology file):

- ``ring``: each node to the next, closing the loop (2 nodes: one edge; 1 node: none);
- ``full``: every pair;
- ``star``: every node to the hub (``center``, default the first node);
- ``line``: each node to the next, not closing the loop;
- ``random-k``: each node picks ``k`` distinct random peers; the union, undirected, is the
  graph (so degrees are at least ``k``; ``k >= n - 1`` is the full graph);
- ``erdos``: G(n, p), each pair independently with probability ``p``.

Random graphs depend only on ``cfg.seed`` (and the node ids' order), through a numpy
``Generator`` of their own, so every node of a swarm, on any host, builds the same graph.
"""

from __future__ import annotations

import zlib
from itertools import combinations

import networkx as nx
import numpy as np

from p2pfl.config.schema import GeneratedEdges, TopologyConfig

__all__ = ["build_graph", "graph_warnings", "neighbours", "topology_rng"]

# a seed tag, not an import: the module's name before it moved into config/, kept as it was
# so that every generated graph stays the same for a seed
_RNG_TAG = zlib.crc32(b"p2pfl.topology")


def topology_rng(seed: int) -> np.random.Generator:
    """The generator random topologies draw from: a function of ``seed`` only, and
    independent of the streams other modules derive from the same seed."""
    return np.random.default_rng(np.random.SeedSequence([seed % (1 << 64), _RNG_TAG]))


def _generated_edges(ids: list[str], spec: GeneratedEdges, seed: int) -> list[tuple[str, str]]:
    n = len(ids)
    kind = spec.kind
    if kind == "ring":
        if n < 3:
            return list(zip(ids, ids[1:], strict=False))  # 2 nodes: one edge; 1 node: none
        return [(ids[i], ids[(i + 1) % n]) for i in range(n)]
    if kind == "line":
        return list(zip(ids, ids[1:], strict=False))
    if kind == "full":
        return list(combinations(ids, 2))
    if kind == "star":
        hub = spec.center if spec.center is not None else ids[0]
        if hub not in ids:
            raise ValueError(f"edges.center: {hub!r} is not one of the nodes")
        return [(hub, x) for x in ids if x != hub]
    if kind == "random-k":
        k = spec.k
        if k is None or k < 1:
            raise ValueError(f"edges: random-k needs k >= 1, got {k!r}")
        if k >= n - 1:
            return list(combinations(ids, 2))
        rng = topology_rng(seed)
        edges = []
        for i, a in enumerate(ids):
            others = ids[:i] + ids[i + 1 :]
            for j in rng.choice(n - 1, size=k, replace=False):
                edges.append((a, others[int(j)]))
        return edges
    if kind == "erdos":
        p = spec.p
        if p is None or not 0 < p <= 1:
            raise ValueError(f"edges: erdos needs 0 < p <= 1, got {p!r}")
        pairs = list(combinations(ids, 2))
        keep = topology_rng(seed).random(len(pairs)) < p
        return [pair for pair, on in zip(pairs, keep, strict=True) if on]
    raise ValueError(f"edges: unknown kind {kind!r}")  # pragma: no cover - config forbids


def build_graph(cfg: TopologyConfig) -> nx.Graph:
    """The swarm's undirected graph; nodes are ``cfg.node_ids`` in order."""
    ids = cfg.node_ids
    if not ids:
        raise ValueError("nodes: the swarm has no nodes")
    if len(set(ids)) != len(ids):
        raise ValueError("nodes: duplicate ids")
    g = nx.Graph()
    g.add_nodes_from(ids)
    if isinstance(cfg.edges, GeneratedEdges):
        edges = _generated_edges(ids, cfg.edges, cfg.seed)
    else:
        known = set(ids)
        edges = []
        for i, pair in enumerate(cfg.edges):
            if len(pair) != 2:
                raise ValueError(f"edges[{i}]: an edge is two node ids, got {pair!r}")
            a, b = pair
            for x in (a, b):
                if x not in known:
                    raise ValueError(f"edges[{i}]: unknown node id {x!r} in edge [{a}, {b}]")
            if a == b:
                raise ValueError(f"edges[{i}]: self-loop on {a!r}")
            edges.append((a, b))
    g.add_edges_from(edges)
    return g


def neighbours(cfg: TopologyConfig, node_id: str) -> list[str]:
    """``node_id``'s neighbours, sorted."""
    g = build_graph(cfg)
    if node_id not in g:
        raise ValueError(f"node {node_id!r} is not in swarm {cfg.name!r}")
    return sorted(g.neighbors(node_id))


def graph_warnings(cfg: TopologyConfig) -> list[str]:
    """Things that are legal but probably not meant: isolated nodes, a disconnected graph,
    generator knobs that the chosen kind ignores, duplicate explicit edges."""
    g = build_graph(cfg)
    out: list[str] = []
    ids = cfg.node_ids
    if len(ids) == 1:
        out.append(f"only one node ({ids[0]}): it has no peers to learn from")
    else:
        isolated = [x for x in ids if g.degree(x) == 0]
        if isolated:
            out.append(f"isolated nodes (no neighbours): {', '.join(isolated)}")
        if not nx.is_connected(g):
            comps = sorted(
                (sorted(c, key=ids.index) for c in nx.connected_components(g)),
                key=lambda c: ids.index(c[0]),
            )
            shown = "; ".join("{" + ", ".join(c) + "}" for c in comps[:5])
            more = f"; ... ({len(comps) - 5} more)" if len(comps) > 5 else ""
            out.append(f"graph is disconnected: {len(comps)} components: {shown}{more}")
    spec = cfg.edges
    if isinstance(spec, GeneratedEdges):
        ignored = [
            name
            for name, value, used_by in (
                ("k", spec.k, "random-k"),
                ("p", spec.p, "erdos"),
                ("center", spec.center, "star"),
            )
            if value is not None and spec.kind != used_by
        ]
        if ignored:
            out.append(f"edges: {', '.join(ignored)} ignored for kind {spec.kind}")
        if spec.kind == "random-k" and spec.k is not None and spec.k >= len(ids) - 1 > 0:
            out.append(f"edges: random-k with k={spec.k} >= n-1={len(ids) - 1} is the full graph")
    else:
        seen: set[frozenset[str]] = set()
        dups = []
        for a, b in spec:
            key = frozenset((a, b))
            if key in seen:
                dups.append(f"[{a}, {b}]")
            seen.add(key)
        if dups:
            out.append(f"edges: duplicate edges (kept once): {', '.join(dups)}")
    return out
