"""The shape of the package (docs/architecture.md, "Dependencies"): no import circle among
``p2pfl`` modules, counting every import (top-level, deferred inside a function, or only
for type checking), and no module importing another module's underscore names."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "p2pfl"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module ``name`` refers to: itself, or the package or module that defines it."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(path: Path, known: dict[str, Path]) -> list[tuple[str, str, int]]:
    """(imported module, imported name or "", line) for every p2pfl import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    me = module_name(path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("p2pfl"):
                    found.append((resolve(alias.name, known), "", node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package
                pkg = me if path.name == "__init__.py" else me.rpartition(".")[0]
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                base = f"{pkg}.{base}" if base else pkg
            if not base.startswith("p2pfl"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:  # ``from p2pfl.x import y`` where y is a module
                    found.append((sub, "", node.lineno))
                else:
                    found.append((resolve(base, known), alias.name, node.lineno))
    return [(m, n, line) for m, n, line in found if m is not None]


def import_graph() -> nx.DiGraph:
    known = modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(known)
    for name, path in known.items():
        for target, _, _ in imports(path, known):
            if target != name and not name.startswith(target + "."):  # a package's own parent
                graph.add_edge(name, target)
    return graph


def test_the_scan_sees_the_package():
    graph = import_graph()
    assert {"p2pfl.node.daemon", "p2pfl.wire.transport", "p2pfl.config.schema"} <= set(graph)
    assert graph.has_edge("p2pfl.node.daemon", "p2pfl.node.services")


def test_no_import_circles():
    cycles = sorted(sorted(c) for c in nx.simple_cycles(import_graph()))
    assert cycles == [], f"import circles: {cycles}"


def test_a_circle_would_be_found(tmp_path):
    """The scan itself: a deferred import inside a function closes a circle."""
    graph = import_graph()
    graph.add_edge("p2pfl.config.schema", "p2pfl.algorithms")  # as a deferred import would
    assert list(nx.simple_cycles(graph))


def test_no_module_imports_another_modules_private_names():
    known = modules()
    offenders = []
    for name, path in known.items():
        for target, imported, line in imports(path, known):
            if imported.startswith("_") and target != name:
                offenders.append(f"{path.relative_to(ROOT)}:{line} imports {target}.{imported}")
    assert offenders == []


def test_every_driver_implements_the_driver_interface():
    """The daemon routes the transport's callbacks to whichever driver the method's kind
    picks: each must have every method of the interface."""
    import inspect

    from p2pfl.node.daemon import DRIVERS
    from p2pfl.node.services import RoundDriver

    wanted = {
        n for n, v in vars(RoundDriver).items() if inspect.isfunction(v) and not n.startswith("_")
    }
    assert wanted == {"run", "on_gossip", "on_inbox", "serve_pull", "on_peer_online"}
    for kind, driver in DRIVERS.items():
        missing = {n for n in wanted if not callable(getattr(driver, n, None))}
        assert not missing, (kind, missing)
        for name in ("run", "serve_pull"):
            assert inspect.iscoroutinefunction(getattr(driver, name)), (kind, name)
