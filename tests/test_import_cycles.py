"""p2pfl's modules do not import each other in a circle (``scripts/import_cycles.py``),
and the topology schema is the ground floor (docs/design.md, "Configuration")."""

from __future__ import annotations


def test_schema_imports_no_p2pfl_module(load_script):
    graph = load_script("import_cycles").import_graph()
    assert list(graph.successors("p2pfl.config.schema")) == []


def test_no_cycle_outside_the_node_package(load_script):
    mod = load_script("import_cycles")
    graph = mod.import_graph(packages=True)
    # the node package's own circle (daemon <-> centralized) is left to its rewrite
    outside = [c for c in mod.cycles(graph) if not all(m.startswith("p2pfl.node.") for m in c)]
    assert outside == [], "\n".join(mod.describe(graph, c) for c in outside)
