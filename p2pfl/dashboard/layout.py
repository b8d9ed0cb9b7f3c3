"""Where the dashboard draws each node: a layout of the topology's graph computed once on
the server, normalized to the unit square."""

from __future__ import annotations

import math

import networkx as nx

from p2pfl.config.schema import GeneratedEdges, TopologyConfig
from p2pfl.config.topology import build_graph

MARGIN = 0.08  # of the unit square, kept free around the drawing


def _circle(ids: list[str]) -> dict[str, tuple[float, float]]:
    n = max(1, len(ids))
    # the first node at the top, going clockwise, as a ring is usually read
    return {
        nid: (math.sin(2 * math.pi * i / n), -math.cos(2 * math.pi * i / n))
        for i, nid in enumerate(ids)
    }


def positions(cfg: TopologyConfig) -> dict[str, tuple[float, float]]:
    """``{node id: (x, y)}`` with x and y in [MARGIN, 1 - MARGIN] (y grows downwards, as
    on screen). Rings and full graphs are circles in node order; a star has its hub in the
    middle; other graphs get a deterministic force layout (Kamada-Kawai, or a seeded spring
    layout for large or disconnected graphs)."""
    ids = cfg.node_ids
    if len(ids) == 1:
        return {ids[0]: (0.5, 0.5)}
    kind = cfg.edges.kind if isinstance(cfg.edges, GeneratedEdges) else None
    if kind in ("ring", "full"):
        raw = _circle(ids)
    elif kind == "star":
        hub = cfg.edges.center if cfg.edges.center is not None else ids[0]
        raw = {**_circle([i for i in ids if i != hub]), hub: (0.0, 0.0)}
    else:
        graph = build_graph(cfg)
        if len(ids) <= 150 and nx.is_connected(graph):
            pos = nx.kamada_kawai_layout(graph)
        else:
            pos = nx.spring_layout(graph, seed=cfg.seed % (1 << 32))
        raw = {nid: (float(pos[nid][0]), float(pos[nid][1])) for nid in ids}
    xs = [p[0] for p in raw.values()]
    ys = [p[1] for p in raw.values()]
    span = max(max(xs) - min(xs), max(ys) - min(ys)) or 1.0
    scale = (1 - 2 * MARGIN) / span
    cx, cy = (max(xs) + min(xs)) / 2, (max(ys) + min(ys)) / 2
    return {
        nid: (round(0.5 + (x - cx) * scale, 4), round(0.5 + (y - cy) * scale, 4))
        for nid, (x, y) in raw.items()
    }


def edges(cfg: TopologyConfig) -> list[tuple[str, str]]:
    """The topology's undirected edges, each once, in a stable order."""
    graph = build_graph(cfg)
    order = {nid: i for i, nid in enumerate(cfg.node_ids)}
    pairs = {tuple(sorted((a, b), key=order.__getitem__)) for a, b in graph.edges()}
    return sorted(pairs, key=lambda e: (order[e[0]], order[e[1]]))
