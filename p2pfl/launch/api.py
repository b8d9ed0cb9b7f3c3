"""The Python API for notebooks and scripts: ``p2pfl.load_topology``, ``p2pfl.run_swarm``
(a :class:`Run` whose records are rows), ``p2pfl.load_model`` and ``p2pfl.register_method``.

A swarm's nodes are processes, so what they run must be importable there: a model class or
factory and a data function live in the user's own module (a ``.py`` file beside the
notebook, the current directory being importable), named by ``package.module:name`` or
passed as the objects themselves, which :func:`import_path` turns into that name.

    import p2pfl
    from mymodels import Net, hospital_data   # the user's own module

    run = p2pfl.run_swarm("topology.yaml", model=Net, data=hospital_data, rounds=10)
    run.records[-1]             # {"node": "a", "round": 10, "test_acc": ..., "method": {...}}
    model = run.load_model("a")  # the user's Net with its trained weights
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from p2pfl.check.load import (
    apply_overrides,
    load_yaml,
    resolve_file_paths,
    resolve_override_paths,
    topology_from_dict,
)
from p2pfl.config.schema import TopologyConfig
from p2pfl.errors import ConfigError
from p2pfl.metrics import METHOD_KEY, node_log_path, read_records


def import_path(obj: Any, what: str) -> str:
    """``package.module:qualname`` of a class or function, so node processes can import it;
    ``ValueError`` for one defined in ``__main__`` (a notebook cell, a script) or nested in
    a function, which no other process can import."""
    if isinstance(obj, str):
        return obj
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not (callable(obj) and module and qualname):
        raise TypeError(f"{what}: expected a class or function, or 'package.module:name'")
    if module == "__main__" or "<locals>" in qualname:
        raise ValueError(
            f"{what} {qualname!r} is defined in {'the notebook or script' if module == '__main__' else 'a function'}: "
            "node processes cannot import it. Put it in a module file (e.g. mymodels.py beside "
            "the notebook) and import it from there"
        )
    if inspect.getmodule(obj) is None:  # pragma: no cover - a class built at run time
        raise ValueError(f"{what} {qualname!r}: its module {module!r} cannot be found")
    return f"{module}:{qualname}"


def load_topology(
    source: str | Path | Mapping[str, Any] | TopologyConfig,
    overrides: list[str] | None = None,
    **fields: Any,
) -> TopologyConfig:
    """A validated topology from a YAML file, a mapping or a config, with ``--set``-style
    ``overrides`` (``["rounds=3"]``) and top-level ``fields`` (``rounds=3``) applied;
    :class:`~p2pfl.errors.ConfigError` naming the source and field otherwise. A file's
    paths resolve against its folder; a mapping's, and those ``overrides`` and ``fields``
    set, against the current directory."""
    file_notes = None
    if isinstance(source, TopologyConfig):
        data: dict[str, Any] = source.model_dump(mode="json")
        data["broker"] = str(source.broker)
        name = f"topology {source.name!r}"
    elif isinstance(source, Mapping):
        data, name = dict(source), "topology"
    else:
        data, name = load_yaml(source), str(source)
        file_notes = resolve_file_paths(data, source)
    data.update(fields)
    try:
        apply_overrides(data, list(overrides or []))
    except ValueError as exc:
        raise ConfigError(name, [("", str(exc))]) from None
    notes = resolve_override_paths(data, file_notes)
    cfg = topology_from_dict(data, source=name)
    cfg.note_paths(notes)
    return cfg


@dataclass
class Run:
    """A finished swarm run: its directory, exit code, summary and config. ``records`` are
    its round records as rows (one dict per node and round, with a ``node`` field)."""

    out_dir: Path
    code: int
    summary: dict[str, Any]
    config: TopologyConfig
    _records: list[dict[str, Any]] | None = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        """Whether every node ran every round and exited cleanly."""
        return self.code == 0

    @property
    def records(self) -> list[dict[str, Any]]:
        """Every node's round records, as rows ordered by round then node."""
        if self._records is None:
            rows = []
            for nid in self.config.node_ids:
                for rec in read_records(node_log_path(self.out_dir, nid)):
                    rows.append({"node": nid, **rec})
            rows.sort(key=lambda r: (r.get("round", 0), self.config.node_ids.index(r["node"])))
            self._records = rows
        return self._records

    def to_dataframe(self):
        """:attr:`records` as a pandas DataFrame, one column per field; the method's facts
        (each record's ``method`` map) as columns ``method.<fact>``."""
        import pandas as pd

        rows = []
        for row in self.records:
            facts = row.get(METHOD_KEY)
            flat = {k: v for k, v in row.items() if k != METHOD_KEY or not isinstance(facts, dict)}
            if isinstance(facts, dict):
                flat.update({f"{METHOD_KEY}.{k}": v for k, v in facts.items()})
            rows.append(flat)
        return pd.DataFrame(rows)

    def final(self) -> dict[str, dict[str, Any]]:
        """Each node's last record."""
        out: dict[str, dict[str, Any]] = {}
        for row in self.records:
            out[row["node"]] = row
        return out

    def load_model(self, node_id: str):
        """Node ``node_id``'s trained model (:func:`p2pfl.export.load_model`)."""
        from p2pfl.export import load_model

        return load_model(self.out_dir, node_id)


def run_swarm(
    topology: str | Path | Mapping[str, Any] | TopologyConfig,
    out_dir: str | Path | None = None,
    *,
    model: str | Callable[..., Any] | None = None,
    data: str | Callable[..., Any] | None = None,
    method: str | type | None = None,
    overrides: list[str] | None = None,
    nodes_per_process: int | None = None,
    progress: bool = False,
    quiet: bool = False,
    console: Console | None = None,
    **fields: Any,
) -> Run:
    """Run a local swarm (a private broker and node processes) to completion and return the
    :class:`Run`. ``model`` / ``data`` / ``method`` set ``model.name`` / ``dataset.name`` /
    ``algorithm.name`` (objects from the user's own module, or their import paths);
    ``overrides`` are ``--set`` strings and ``fields`` top-level fields (``rounds=5``).
    ``out_dir`` defaults to ``runs/<swarm name>``. The swarm is checked first, as by
    ``p2pfl swarm`` (:func:`p2pfl.check.checked.check_topology`: the data, the model, the
    device): a bad input raises :class:`~p2pfl.errors.ConfigError` before anything
    starts."""
    from p2pfl.launch.swarm import run_swarm as launch

    extra = list(overrides or [])
    if model is not None:
        extra.append(f"model.name={import_path(model, 'model')}")
    if data is not None:
        extra.append(f"dataset.name={import_path(data, 'data function')}")
    if method is not None:
        extra += [f"algorithm.name={import_path(method, 'method')}", "algorithm.params={}"]
    cfg = load_topology(topology, extra, **fields)
    out = Path(out_dir) if out_dir is not None else Path("runs") / cfg.name
    from p2pfl.check.checked import check_topology

    source = str(topology) if isinstance(topology, str | Path) else "topology"
    # as p2pfl swarm: every check of validate, before any process starts
    checked = check_topology(cfg, source, runs_here=True, keep_data=False)
    if console is None:
        console = Console(quiet=quiet)
    for note in checked.notes:  # a default the switches chose, said once
        console.print(f"note {source}: {note}", highlight=False, markup=False)
    code, summary = launch(
        cfg,
        out,
        nodes_per_process=nodes_per_process,
        progress=progress,
        console=console,
        source=source if source != "topology" else None,
        checked=True,
    )
    return Run(out_dir=out, code=code, summary=summary, config=cfg)
