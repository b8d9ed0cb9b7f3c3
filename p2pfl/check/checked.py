"""The one way every command reads a topology: the file, the schema and its bounds, the
graph, the device, and (unless asked not to) the data and the model, all before anything
starts, each problem a :class:`~p2pfl.errors.ConfigError` naming the user's file and
the field (docs/design.md, "Configuration").

``p2pfl validate`` runs it and reports; ``p2pfl swarm`` runs it before the broker and the
node processes start, and hands each node process the digest of the config it wrote
(:data:`CHECKED_FLAG`, :func:`config_digest`): a process whose config file has that digest
trusts the launcher's check and runs only the checks without the data and model (the
graph, the device), then builds each node's model and method once, to run (errors still
name the user's file: the launcher passes it on); ``p2pfl node`` started any other way
runs it for the nodes this device hosts before any connects; ``p2pfl certs`` and ``p2pfl
broker --topology`` read the file through it without the data and model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from p2pfl.check.load import load_topology
from p2pfl.config.schema import TopologyConfig
from p2pfl.config.topology import build_graph, graph_warnings
from p2pfl.errors import ConfigError

if TYPE_CHECKING:
    import networkx as nx

    from p2pfl.learning.split_model import SplitModel

DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")

# the node command's flag by which a launcher says it checked the config file it hands on
CHECKED_FLAG = "--checked"


def config_digest(path: str | Path) -> str:
    """The SHA-256 (hex) of the config file at ``path``'s bytes: what a launcher that
    checked the file hands its node processes (:data:`CHECKED_FLAG`), and what a node
    process compares before trusting that check; any other file is checked anew."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@dataclass
class CheckedTopology:
    """A topology that passed every check asked for: its config, the file it came from,
    its graph, the model as the method adapts it (None when the inputs were not checked),
    what is legal but probably not meant (warnings to print), and the defaults the other
    switches chose for fields the user left unset (notes to print once, at start)."""

    cfg: TopologyConfig
    source: str
    graph: nx.Graph
    model: SplitModel | None = None
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def load_checked(
    path: str | Path,
    overrides: Sequence[str] = (),
    *,
    inputs: bool = True,
    data_root: str | None = None,
    node_ids: Sequence[str] | None = None,
    device: str | None = None,
    device_field: str = "training.device",
    runs_here: bool = False,
    cache_dir: str | None = None,
    keep_data: bool = True,
) -> CheckedTopology:
    """Read the topology at ``path`` with ``--set``-style ``overrides`` and run
    :func:`check_topology` on it; every error names ``path``."""
    cfg = load_topology(path, list(overrides))
    return check_topology(
        cfg,
        str(path),
        inputs=inputs,
        data_root=data_root,
        node_ids=node_ids,
        device=device,
        device_field=device_field,
        runs_here=runs_here,
        cache_dir=cache_dir,
        keep_data=keep_data,
    )


def check_topology(
    cfg: TopologyConfig,
    source: str,
    *,
    inputs: bool = True,
    data_root: str | None = None,
    node_ids: Sequence[str] | None = None,
    device: str | None = None,
    device_field: str = "training.device",
    runs_here: bool = False,
    cache_dir: str | None = None,
    keep_data: bool = True,
) -> CheckedTopology:
    """Check a loaded topology as every command does; raise :class:`ConfigError` naming
    ``source`` and the field. The graph builds; the torch device (``device``, else
    ``training.device``; reported on ``device_field``) is one torch knows, and where the run
    happens on this machine (``runs_here``) one this machine has (elsewhere, a warning).
    With ``inputs``, :func:`p2pfl.check.preflight.check_inputs`: the data (at
    ``data_root`` when given) opens, the partition fits it, the model takes it and the
    method works with the model. ``node_ids``: under ``dataset.partition: none``, only
    these nodes' own data is checked (the ones this device hosts; default every node).
    ``keep_data``: keep the dataset loaded in this process's cache (a node trains on it);
    false frees it (a launcher whose node processes load their own)."""
    try:
        graph = build_graph(cfg)
    except ValueError as exc:  # the schema checks the same: a defence in depth
        loc, _, msg = str(exc).partition(": ")
        raise ConfigError(source, [(loc, msg) if msg else ("edges", str(exc))]) from None
    warnings = graph_warnings(cfg)
    problem = device_problem(device or cfg.training.device, runs_here)
    if problem is not None:
        fatal, why = problem
        if fatal:
            raise ConfigError(source, [(device_field, why)])
        warnings.append(f"{device_field}: {why}")
    model = None
    if inputs:
        from p2pfl.check.preflight import check_inputs  # torch models and the datasets

        model = check_inputs(
            cfg, source=source, data_root=data_root, node_ids=node_ids, cache_dir=cache_dir
        )
        if not keep_data:
            from p2pfl.learning.data import clear_cache

            clear_cache()
    warnings += security_warnings(cfg)
    return CheckedTopology(cfg, source, graph, model, warnings, default_notes(cfg))


def default_notes(cfg: TopologyConfig) -> list[str]:
    """One line for each field left unset whose default the other switches chose
    (:attr:`~p2pfl.config.schema.TopologyConfig.defaulted_rule`)."""
    rule = cfg.defaulted_rule
    if rule is None:
        return []
    return [
        f"defence.rule: not set, so {rule}, the rule that works on the sum privacy.secagg "
        "gives the aggregator (the default clip reads individual uploads)"
    ]


def device_problem(spec: str, runs_here: bool) -> tuple[bool, str] | None:
    """What is wrong with the torch device ``spec``, as ``(fatal, why)``, or None: not a
    device string torch parses, or a type p2pfl does not train on, is always fatal; a
    CUDA or MPS device this machine lacks is fatal where the run happens here
    (``runs_here``), else only worth a warning (the topology may be for other devices)."""
    import torch

    try:
        dev = torch.device(spec)
    except (RuntimeError, TypeError, ValueError) as exc:
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return True, f"{spec!r} is not a torch device ({why}); e.g. cpu, cuda, cuda:0, mps"
    if dev.type not in DEVICE_TYPES:
        return True, f"{spec!r}: p2pfl trains on {', '.join(DEVICE_TYPES)}, not {dev.type}"
    missing = None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            missing = "this machine has no CUDA device"
        elif dev.index is not None and dev.index >= count:
            missing = f"this machine has {count} CUDA device(s): cuda:0..cuda:{count - 1}"
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        missing = "this machine has no MPS device"
    elif dev.type == "xpu" and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        missing = "this machine has no XPU device"
    if missing is None:
        return None
    return runs_here, f"{spec!r}: {missing}"


def security_warnings(cfg: TopologyConfig) -> list[str]:
    """``security``: switched on without a certificate directory yet (legal: each device
    may give its own, and ``p2pfl swarm`` makes one)."""
    sec = cfg.security
    if sec.enabled and sec.certs is None:
        return [
            "security.certs: not set: each device must give its own (certs: in its nodes/ "
            "file, or --certs); p2pfl swarm uses <run>/certs"
        ]
    if sec.enabled and not (Path(sec.certs) / "ca.crt").is_file():
        note = cfg.path_note("security.certs")
        return [
            f"security.certs: {Path(sec.certs).absolute() / 'ca.crt'} does not exist yet "
            f"({note + '; ' if note else ''}p2pfl certs creates it; p2pfl swarm does for a "
            "local swarm)"
        ]
    return []
