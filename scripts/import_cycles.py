"""Print the import cycles between p2pfl's own modules.

Every module under ``p2pfl/`` is parsed with :mod:`ast`, and every import of a p2pfl module
is an edge: at the top of the file, under ``if TYPE_CHECKING:``, or deferred inside a
function (a deferred import still closes a circle, it only postpones it). ``from p2pfl.x
import y`` is an edge to ``p2pfl.x.y`` when that is a module, else to ``p2pfl.x``. Each edge
is labelled ``top``, ``typing`` or ``deferred``. With ``--packages`` an import also counts as
one of every package above the module it names (Python runs their ``__init__`` first).

    python scripts/import_cycles.py [--packages]

Exit status: 0 when there is no cycle, 1 otherwise.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "p2pfl"


def module_names(root: Path = ROOT) -> dict[str, Path]:
    """``{dotted name: file}`` for every module of the package (a package is its ``__init__``)."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module) -> list[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement with its kind: ``top``, ``typing`` or ``deferred``."""
    found: list[tuple[ast.Import | ast.ImportFrom, str]] = []

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child, kind))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, "deferred")
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), "typing")
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), kind)
            else:
                visit(child, kind)

    visit(tree, "top")
    return found


def _targets(
    node: ast.Import | ast.ImportFrom, name: str, is_pkg: bool, known: set[str]
) -> list[str]:
    """The p2pfl modules one import statement of module ``name`` names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == PACKAGE]
    if node.level:  # relative: resolve against the importing module's package
        base = name.split(".") if is_pkg else name.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        mod = ".".join(base + ([node.module] if node.module else []))
    else:
        mod = node.module or ""
    if mod.split(".")[0] != PACKAGE:
        return []
    out = []
    for alias in node.names:
        sub = f"{mod}.{alias.name}"
        out.append(sub if sub in known else mod)
    return out


def import_graph(packages: bool = False, root: Path = ROOT) -> nx.MultiDiGraph:
    """Modules as nodes; one edge per (importer, imported, kind) with the line numbers."""
    modules = module_names(root)
    known = set(modules)
    graph = nx.MultiDiGraph()
    graph.add_nodes_from(known)
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, kind in _imports(tree):
            for target in _targets(node, name, path.name == "__init__.py", known):
                hits = [target]
                if packages:
                    parts = target.split(".")
                    hits += [".".join(parts[:i]) for i in range(1, len(parts))]
                for hit in hits:
                    # the import of a submodule of yourself, or of your own package: no edge
                    if hit == name or name.startswith(hit + ".") or hit not in known:
                        continue
                    graph.add_edge(name, hit, key=kind, line=node.lineno)
    return graph


def cycles(graph: nx.MultiDiGraph) -> list[list[str]]:
    """Every elementary cycle, shortest first, each rotated to start at its smallest name."""
    out = []
    for cyc in nx.simple_cycles(nx.DiGraph(graph)):
        i = cyc.index(min(cyc))
        out.append(cyc[i:] + cyc[:i])
    return sorted(out, key=lambda c: (len(c), c))


def describe(graph: nx.MultiDiGraph, cycle: list[str]) -> str:
    hops = []
    for a, b in zip(cycle, cycle[1:] + cycle[:1], strict=True):
        kinds = ",".join(f"{k}:{d['line']}" for k, d in sorted(graph.get_edge_data(a, b).items()))
        hops.append(f"{a} -[{kinds}]->")
    return " ".join(hops) + f" {cycle[0]}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--packages", action="store_true", help="count the packages above each imported module"
    )
    args = ap.parse_args(argv)
    graph = import_graph(packages=args.packages)
    found = cycles(graph)
    for cyc in found:
        print(describe(graph, cyc))
    print(f"{len(found)} cycle(s) among {graph.number_of_nodes()} modules", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
