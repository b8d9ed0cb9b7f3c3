"""The shape of the package (docs/architecture.md, "Dependencies"): every import between
layers is one the documented order allows, no import circle among ``p2pfl`` modules,
counting every import (top-level, deferred inside a function, or only for type checking),
and no module importing another module's underscore names."""

from __future__ import annotations

import ast
import re
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


def documented_layers() -> dict[str, set[str]]:
    """The "Dependencies" block of docs/architecture.md: layer -> the layers it may import."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Dependencies", 1)[1].split("```", 2)[1]
    allowed: dict[str, set[str]] = {}
    for line in block.splitlines():
        if "→" not in line:
            continue
        left, right = line.split("→", 1)
        right = re.sub(r"\([^)]*\)", "", right)
        targets = set() if "nothing" in right else {t.strip() for t in right.split(",")}
        for layer in left.split(","):
            allowed[layer.strip()] = targets - {""}
    return allowed


def layer_of(module: str, layers: dict[str, set[str]]) -> str:
    """The most specific documented layer ``module`` belongs to (``p2pfl.check.load`` →
    ``config.load``, ``p2pfl.wire.codec`` → ``wire``); the package itself is ``p2pfl``."""
    rest = module.removeprefix("p2pfl").lstrip(".")
    while rest and rest not in layers:
        rest = rest.rpartition(".")[0]
    return rest or "p2pfl"


def allows(targets: set[str], layer: str) -> bool:
    """Whether a layer allowed to import ``targets`` may import ``layer``: named itself, or
    by its folder (``config`` covers ``config.load``)."""
    return layer in targets or layer.split(".")[0] in targets


def test_imports_follow_the_documented_layers():
    layers = documented_layers()
    assert {"cli", "node", "wire", "learning", "config.schema"} <= set(layers)
    graph = import_graph()
    unknown = sorted({layer_of(m, layers) for m in graph} - set(layers) - {"p2pfl"})
    assert unknown == [], f"layers missing from docs/architecture.md: {unknown}"
    offenders = []
    for a, b in graph.edges():
        la, lb = layer_of(a, layers), layer_of(b, layers)
        same_folder = la.split(".")[0] == lb.split(".")[0] and "." not in la
        if (
            la != lb
            and la.split(".")[0] != lb
            and not same_folder
            and not allows(layers.get(la, set()), lb)
        ):
            offenders.append(f"{a} ({la}) imports {b} ({lb})")
    assert offenders == [], "imports against docs/architecture.md, Dependencies:\n" + "\n".join(
        sorted(offenders)
    )


def test_an_upward_import_would_be_found():
    layers = documented_layers()
    assert not allows(layers["learning"], layer_of("p2pfl.algorithms.base", layers))
    assert allows(layers["node"], layer_of("p2pfl.rounds.driver", layers))
    # whoever starts a node checks its inputs first: the node builds, it never checks
    assert not allows(layers["node"], layer_of("p2pfl.check.load", layers))


def test_the_scan_sees_the_package():
    graph = import_graph()
    assert {"p2pfl.node.daemon", "p2pfl.wire.transport", "p2pfl.config.schema"} <= set(graph)
    assert graph.has_edge("p2pfl.node.daemon", "p2pfl.services.bundle")


def folder_of(module: str) -> str:
    """The folder (or top-level module) of ``p2pfl`` a module lives in."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "p2pfl"


def test_no_import_circles_between_folders():
    graph = import_graph()
    folders = nx.DiGraph()
    for a, b in graph.edges():
        if folder_of(a) != folder_of(b):
            folders.add_edge(folder_of(a), folder_of(b))
    cycles = sorted(sorted(c) for c in nx.simple_cycles(folders))
    assert cycles == [], f"import circles between folders: {cycles}"


def test_round_code_never_reaches_the_transport():
    """Round code talks to its node only through the services' ports: it imports none of
    the wire but its types (docs/architecture.md, "Dependencies"), and never names a
    transport attribute."""
    allowed_wire = {"p2pfl.wire.envelope", "p2pfl.wire.errors"}
    graph = import_graph()
    reached = sorted(
        f"{a} imports {b}"
        for a, b in graph.edges()
        if a.startswith("p2pfl.rounds") and b.startswith("p2pfl.wire") and b not in allowed_wire
    )
    assert reached == []
    named = []
    for path in sorted((PACKAGE / "rounds").rglob("*.py")):
        if "wire.transport" in path.read_text():  # not even in a docstring's reference
            named.append(f"{path.relative_to(ROOT)}: names p2pfl.wire.transport")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("transport", "_transport"):
                named.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert named == []


def test_the_daemon_knows_no_driver_by_name():
    """The daemon asks :data:`~p2pfl.rounds.driver.DRIVERS` for the driver that selects its
    method: it imports no round protocol itself, and never tests a method's kind."""
    graph = import_graph()
    protocols = {m for m in graph.successors("p2pfl.node.daemon") if m.startswith("p2pfl.rounds.")}
    assert protocols == {"p2pfl.rounds.driver"}
    source = (PACKAGE / "node" / "daemon.py").read_text()
    assert ".kind" not in source and "isinstance(driver" not in source


def test_export_needs_no_node():
    """``p2pfl.load_model`` rebuilds a model without the transport or the round drivers."""
    graph = import_graph()
    reached = nx.descendants(graph, "p2pfl.export.model")
    assert not {m for m in reached if m.startswith(("p2pfl.node", "p2pfl.rounds", "p2pfl.wire"))}


MAX_LINES = 600


def test_no_module_is_over_600_lines_outside_the_methods():
    """One job per module: none is over 600 lines, except a method (``algorithms/``), which
    stays whole in its one file."""
    long = {
        str(p.relative_to(ROOT)): n
        for p in PACKAGE.rglob("*.py")
        if "algorithms" not in p.relative_to(PACKAGE).parts
        and (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_the_layout_table_lists_every_module():
    """docs/architecture.md's layout table names every module of each folder, and no module
    that is not there."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("## Layout", 1)[1].split("## Dependencies", 1)[0]
    listed: set[str] = set()
    for line in table.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) < 4 or not cells[1].startswith("`") or not cells[1].endswith("/`"):
            continue
        folder = cells[1].strip("`").rstrip("/")
        # a cell names modules, and sub-folders with their own modules in parentheses:
        # ``secagg/`` (`context.py`, ...)
        sub = ""
        for token in re.findall(r"`([^`]+)`|(\()|(\))", cells[2]):
            name, opening, closing = token
            if closing:
                sub = ""
            elif name.endswith("/"):
                sub = name
            elif name.endswith(".py"):
                listed.add(f"{folder}/{sub}{name}")
    actual = {
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if p.name != "__init__.py" and len(p.relative_to(PACKAGE).parts) > 1
    }
    assert sorted(actual - listed) == [], "modules missing from the layout table"
    assert sorted(listed - actual) == [], "the layout table names modules that do not exist"


def test_no_import_circles():
    cycles = sorted(sorted(c) for c in nx.simple_cycles(import_graph()))
    assert cycles == [], f"import circles: {cycles}"


def test_a_circle_would_be_found(tmp_path):
    """The scan itself: a deferred import inside a function closes a circle."""
    graph = import_graph()
    graph.add_edge("p2pfl.config.schema", "p2pfl.algorithms.base")  # as a deferred import would
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
    """The daemon routes the transport's callbacks to whichever driver selects the method,
    and asks the driver what it would otherwise branch on: each must have every member of
    the interface, and exactly one driver selects each built-in method in each mode."""
    import inspect

    from p2pfl.algorithms import get_algorithm, known_algorithms
    from p2pfl.config.schema import TopologyConfig
    from p2pfl.rounds.driver import DRIVERS, RoundDriver, driver_for

    wanted = {n for n, v in vars(RoundDriver).items() if not n.startswith("_") and callable(v)}
    declared = {"selects", "peers_of", "listens_to"}
    wanted |= {n for n, v in vars(RoundDriver).items() if isinstance(v, classmethod)}
    assert (
        wanted
        == {"run", "start", "on_gossip", "on_inbox", "serve_pull", "on_peer_online"} | declared
    )
    for kind, driver in DRIVERS.items():
        missing = {n for n in wanted if not callable(getattr(driver, n, None))}
        assert not missing, (kind, missing)
        for name in ("run", "start", "serve_pull"):
            assert inspect.iscoroutinefunction(getattr(driver, name)), (kind, name)
    for mode in ("sync", "async"):
        cfg = TopologyConfig(name="t", nodes=3, timing={"mode": mode})
        for name in known_algorithms():
            method = get_algorithm(name)
            driver = driver_for(method, cfg)
            assert driver.selects(method, cfg)


def test_the_site_daemon_is_made_of_objects_not_mixins():
    """The daemon and its parts derive from nothing of each other: each part receives the
    one SiteContext (and the parts it calls) in its constructor (docs/architecture.md,
    "The site wing")."""
    from p2pfl.sites.consent.run_agreement import RunAgreement
    from p2pfl.sites.daemon.admin_commands import AdminCommands
    from p2pfl.sites.daemon.site_daemon import SiteDaemon
    from p2pfl.sites.runs.series import SeriesCycles
    from p2pfl.sites.runs.slots import WorkerSlots
    from p2pfl.sites.trust.crl_updates import TrustUpdates

    for cls in (SiteDaemon, RunAgreement, AdminCommands, SeriesCycles, WorkerSlots, TrustUpdates):
        assert cls.__bases__ == (object,), cls
    import inspect

    for part in (RunAgreement, AdminCommands, SeriesCycles, WorkerSlots, TrustUpdates):
        assert "ctx" in inspect.signature(part).parameters, part
