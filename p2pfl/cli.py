"""What each ``p2pfl`` command does (its grammar: :mod:`p2pfl.cli_parser`) and the entry point."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from p2pfl.check.load import load_node_overrides, load_topology
from p2pfl.cli_parser import build_parser
from p2pfl.config.schema import BrokerAddress
from p2pfl.errors import ConfigError, P2PFLError
from p2pfl.sites.commands import site_commands

if TYPE_CHECKING:
    from p2pfl.check.checked import CheckedTopology

console = Console(stderr=True)


def _setup_logging(verbose: bool, rich: bool = True) -> None:
    level = logging.DEBUG if verbose else logging.INFO
    if rich:
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(console=console, show_path=False)
        fmt = "%(message)s"
    else:
        handler = logging.StreamHandler(sys.stderr)
        fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level, format=fmt, handlers=[handler], force=True)
    for noisy in ("aiomqtt", "asyncio", "matplotlib", "PIL"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _print_config_error(exc: ConfigError) -> None:
    for loc, msg in exc.errors:
        where = f"{exc.source}: {loc}" if loc else exc.source
        console.print(f"[red]error[/] {where}: {msg}", highlight=False, soft_wrap=True)


def _overrides(args: argparse.Namespace, extra: list[str] | None = None) -> list[str]:
    """The ``--set``-style overrides of a command: ``--method``, the command's own flags
    (``extra``), then ``--set``."""
    method = getattr(args, "method", None)
    # --method swaps the algorithm and starts from its default knobs; --set may then tune them
    swap = [f"algorithm.name={method}", "algorithm.params={}"] if method else []
    return [*swap, *(extra or []), *(args.set or [])]


def _load(args: argparse.Namespace, extra: list[str] | None = None, **checks) -> CheckedTopology:
    """The command's topology through the one path every command takes
    (:func:`p2pfl.check.checked.load_checked`, ``checks`` its options)."""
    from p2pfl.check.checked import load_checked  # the topology commands' (networkx)

    return load_checked(args.topology, _overrides(args, extra), **checks)


def _run_async(coro) -> int:
    """Run a daemon's coroutine on the standard asyncio loop. Not uvloop: there, a socket the
    broker closes can leave paho's pending ``add_writer`` failing on a closed handle
    (MagicStack/uvloop#552), and the client then learns of the lost connection only at its
    keepalive, ~25 s later (1 transport in 32 in a broker-restart drill; 0 in 48 on asyncio)."""
    return asyncio.run(coro)


# ----------------------------------------------------------------------------- commands


def cmd_validate(args: argparse.Namespace) -> int:
    if args.site is not None:
        from p2pfl.sites.commands import cmd_validate_site

        return cmd_validate_site(args)
    if args.topology is None:
        raise SystemExit("p2pfl validate: give a topology file, or --site site.yaml")
    # with the data: it opens, the partition fits it, the model takes it
    checked = _load(args, inputs=not args.no_data, data_root=args.data_root)
    cfg, graph, model = checked.cfg, checked.graph, checked.model
    console.print(
        f"[green]ok[/] {args.topology}: swarm {cfg.name!r}, {len(cfg.node_ids)} nodes, "
        f"{graph.number_of_edges()} edges, {cfg.rounds} rounds of {cfg.algorithm.name} "
        f"on {cfg.dataset.name} ({cfg.dataset.partition}), model {cfg.model.name}",
        highlight=False,
        soft_wrap=True,
    )
    if model is not None:  # what the methods share (g) and what each node keeps (h)
        from p2pfl.check.preflight import split_summary

        for part, label in (("g", "shared"), ("h", "personal")):
            modules = split_summary(model)[part]
            console.print(
                f"  {part} ({label}): {', '.join(modules) or '—'}", highlight=False, soft_wrap=True
            )
    warnings = list(checked.warnings)
    if not args.no_data:  # what each node trains on, and its steps a round
        from p2pfl.check.sizes import describe_sizes, node_sizes, size_warnings

        sizes = node_sizes(cfg, source=args.topology, data_root=args.data_root)
        for line in describe_sizes(cfg, sizes):
            console.print(f"  {line}", highlight=False, soft_wrap=True)
        warnings += size_warnings(cfg, sizes)
    for w in warnings:
        console.print(f"[yellow]warning[/] {args.topology}: {w}", highlight=False, soft_wrap=True)
    _print_notes(args, checked)
    return 0


def _print_notes(args: argparse.Namespace, checked: CheckedTopology) -> None:
    """The defaults the switches chose for fields left unset, once, at start."""
    for note in checked.notes:
        console.print(f"[cyan]note[/] {args.topology}: {note}", highlight=False, soft_wrap=True)


def cmd_swarm(args: argparse.Namespace) -> int:
    from p2pfl.launch.swarm import run_swarm

    extra = []
    if args.data_root:
        extra.append(f"dataset.root={args.data_root}")
    if args.rounds:
        extra.append(f"rounds={args.rounds}")
    # every check of validate (the data, the model, the bounds), before anything starts
    checked = _load(args, extra, runs_here=True, keep_data=False)
    _print_notes(args, checked)
    cfg = checked.cfg
    out = Path(args.out or f"runs/{cfg.name}")

    def on_term(signum, frame):  # SIGTERM behaves like Ctrl-C: stop everything we started
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    # also when started with SIGINT ignored (a background job of a script): Ctrl-C, or a
    # SIGINT from a supervisor, must still stop everything this launcher started
    signal.signal(signal.SIGINT, on_term)
    dash = _swarm_dashboard(args, out)  # --dashboard: run_swarm's on_start starts it
    code, _ = run_swarm(
        cfg,
        out,
        nodes_per_process=args.nodes_per_process,
        broker=args.broker,
        broker_kind=args.broker_kind,
        progress=not args.no_progress,
        verbose=args.verbose,
        console=console,
        timeout_s=args.timeout,
        tracker=args.tracker,
        on_start=dash.start if dash is not None else None,
        source=str(args.topology),
        checked=True,
    )
    if dash is not None:
        dash.finish(code)  # stops it; --dashboard-keep: serves until Ctrl-C first
    return code


def _swarm_dashboard(args: argparse.Namespace, out: Path):
    """The dashboard ``p2pfl swarm --dashboard`` asks for (None without the flag)."""
    if not (args.dashboard or args.dashboard_keep):
        return None
    from p2pfl.dashboard.server import SwarmDashboard

    return SwarmDashboard(
        out, args.dashboard_host, args.dashboard_port, keep=args.dashboard_keep, console=console
    )


def cmd_dashboard(args: argparse.Namespace) -> int:
    """Serve a run directory's live dashboard until Ctrl-C."""
    from p2pfl.dashboard.server import AUTO, run_dashboard

    run = Path(args.run_dir)
    if not run.is_dir():
        console.print(f"[red]error[/] {run}: not a directory", highlight=False)
        return 2
    if args.certs is not None and not Path(args.certs).is_dir():
        console.print(f"[red]error[/] --certs {args.certs}: not a directory", highlight=False)
        return 2
    return run_dashboard(
        run,
        host=args.host,
        port=args.port,
        broker=None if args.no_broker else (args.broker or AUTO),
        certs=args.certs,
        announce=lambda url: console.print(f"dashboard {url} (Ctrl-C to stop)", highlight=False),
    )


def cmd_node(args: argparse.Namespace) -> int:
    from p2pfl.check.checked import check_topology, device_problem
    from p2pfl.node.daemon import Node, NodeOptions, run_all

    extra = []
    ids = list(args.id or [])
    broker = args.broker
    data_root, device, certs, host = args.data_root, args.device, args.certs, args.host
    notes: dict[str, str] = {}  # where the node file's relative data_root resolved from
    if args.node_config:
        over = load_node_overrides(args.node_config)  # its paths: against its folder
        if over.id and not ids:
            ids = [over.id]
        if over.broker:  # checked even where --broker overrides it
            try:
                from_file = BrokerAddress.parse(over.broker)
            except ValueError as exc:
                raise ConfigError(args.node_config, [("broker", str(exc))]) from None
            broker = broker or from_file
        if over.device:
            problem = device_problem(over.device, runs_here=True)
            if problem is not None:
                raise ConfigError(args.node_config, [("device", problem[1])])
        if not data_root and over.data_root:
            data_root = over.data_root
            notes = (
                {"data_root": over.path_note("data_root")} if over.path_note("data_root") else {}
            )
        device = device or over.device
        certs = certs or over.certs
        host = host or over.host
        if over.threads:
            extra.append(f"training.threads={over.threads}")
    source = args.source or str(args.topology)  # p2pfl swarm's nodes: the user's file
    cfg = load_topology(args.topology, _overrides(args, extra))
    cfg.note_paths(notes)
    if not ids:  # the nodes the topology pins to this host
        import socket

        host = host or socket.gethostname()
        ids = cfg.nodes_on(host)
        if not ids:
            console.print(
                f"[red]error[/] {args.topology}: nodes: no node pinned to host {host!r} "
                "(give --id, an id in --node-config, or --host NAME)",
                highlight=False,
            )
            return 2
        console.print(f"host {host}: nodes {', '.join(ids)}", highlight=False)
    unknown = [i for i in ids if i not in cfg.node_ids]
    if unknown:
        console.print(f"[red]error[/] {args.topology}: nodes: no node with id {unknown}")
        return 2
    # every check of validate for the nodes hosted here, before any of them connects;
    # without the data and model where the launcher checked this very file (p2pfl swarm)
    trusted = _launcher_checked(args, extra)
    if trusted:
        logging.getLogger("p2pfl").info(
            "%d node(s) from %s: inputs checked by the launcher (config digest %s)",
            len(ids),
            ids[0],
            args.checked[:12],
        )
    checked = check_topology(
        cfg,
        source,
        inputs=not trusted,
        data_root=data_root,
        node_ids=ids,
        device=device,
        device_field="--device" if args.device else "training.device",
        runs_here=True,
    )
    _print_notes(args, checked)  # none from p2pfl swarm's config.yaml: it sets every field
    import torch

    torch.set_num_threads(cfg.training.threads)
    opts = NodeOptions(
        broker=broker,
        data_root=data_root,
        device=device,
        out_dir=Path(args.out) if args.out else Path(f"runs/{cfg.name}"),
        certs=certs,
        fresh=args.fresh,
        source=source,
    )

    nodes = [Node(cfg, nid, opts) for nid in ids]
    for node in nodes:  # a missing or bad certificate is reported before anything starts
        node.security_context()

    async def main() -> int:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        try:
            failed = await run_all(nodes)
        except asyncio.CancelledError:
            logging.getLogger("p2pfl").warning("stopped by signal")
            return 130
        return 1 if failed else 0

    return _run_async(main())


def _launcher_checked(args: argparse.Namespace, extra: list[str]) -> bool:
    """Whether this node process may trust its launcher's check: ``--checked`` names the
    digest of the very config file it reads (:func:`~p2pfl.check.checked.config_digest`)
    and nothing on its command line changes what was checked (no ``--set``, ``--method``,
    node config, data root or device)."""
    if not args.checked or extra or args.set or args.method:
        return False
    if args.node_config or args.data_root or args.device:
        return False
    from p2pfl.check.checked import config_digest

    try:
        return config_digest(args.topology) == args.checked
    except OSError:
        return False


def cmd_track(args: argparse.Namespace) -> int:
    """Export a run directory's records to a tracker."""
    from p2pfl.launch.tracker import export_run

    export_run(Path(args.run_dir), args.tracker, console)
    return 0


def cmd_summarize(args: argparse.Namespace) -> int:
    from p2pfl.check.load import load_topology
    from p2pfl.launch.swarm import finish_run, summary_table

    run = Path(args.run_dir)
    cfg = load_topology(run / "config.yaml")
    summary = finish_run(cfg, run, None)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        Console().print(summary_table(summary))
    return 0


def cmd_broker(args: argparse.Namespace) -> int:
    """Run a broker for a swarm on this host (Mosquitto, or the embedded one where Mosquitto
    is missing) and announce it by mDNS until stopped."""
    from p2pfl.launch.bridge import bridges_from_flags, watch_bridges
    from p2pfl.launch.broker import BrokerTLS, follow_trust, make_broker
    from p2pfl.wire.discovery import Announcer

    async def main() -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        workdir = Path(args.workdir) if args.workdir else None
        swarm = None if args.swarm == "*" else args.swarm
        tls = BrokerTLS(Path(args.certs), swarm) if args.certs else None
        bridges = bridges_from_flags(args.bridge, swarm, args.topology)
        made = make_broker(
            args.broker_kind, args.host, args.port, workdir=workdir, tls=tls, bridges=bridges
        )
        with made as broker:
            certs = Path(args.certs) if args.certs else None
            async with (
                Announcer.broker(args.swarm, args.host, broker.port),
                watch_bridges(bridges, broker.host, broker.port, certs, log_path=broker.log_path),
            ):
                print(
                    f"broker {broker.name} on {broker.address} announced for swarm {args.swarm}"
                    + (" (TLS, client certificates, per-node ACL)" if tls else ""),
                    flush=True,
                )
                follow = asyncio.create_task(follow_trust(broker, certs)) if certs else None
                await stop.wait()
                if follow is not None:
                    follow.cancel()
        print("broker stopped", flush=True)
        return 0

    return _run_async(main())


def cmd_certs(args: argparse.Namespace) -> int:
    """Create (or extend) a swarm's CA, broker certificate and per-node identities."""
    from p2pfl.security.certs import BRIDGE_CN, OBSERVER_CN, make_swarm_certs, revoke

    cfg = _load(args, inputs=False).cfg  # the file, the schema and the graph: no data here
    out = Path(args.out or cfg.security.certs or f"certs/{cfg.name}")
    ids = args.node or cfg.node_ids
    unknown = [i for i in ids if i not in cfg.node_ids]
    if unknown:
        console.print(f"[red]error[/] {args.topology}: nodes: no node with id {unknown}")
        return 2
    if args.revoke:
        services = (BRIDGE_CN, OBSERVER_CN)
        unknown = [i for i in args.revoke if i not in cfg.node_ids and i not in services]
        if unknown:
            console.print(
                f"[red]error[/] {args.topology}: nodes: no node with id {unknown} "
                f"(--revoke takes node ids, {BRIDGE_CN} or {OBSERVER_CN})",
                highlight=False,
                soft_wrap=True,
            )
            return 2
        paths = revoke(out, args.revoke, days=args.days)
        console.print(
            f"[green]ok[/] {paths.crl}: revoked {', '.join(args.revoke)} (and {paths.acl} "
            "denies them). Site daemons: `p2pfl trust publish --certs "
            f"{paths.root} --site site.yaml` spreads it, no restart; the broker: copy "
            "crl.pem and acl to it and send it SIGHUP (Mosquitto reloads the ACL then; its "
            "CRL at a restart)",
            highlight=False,
            soft_wrap=True,
        )
        for name in (n for n in services if n in args.revoke):
            console.print(
                f"to issue a new {name} identity: delete {paths.identity_files(name)} in "
                f"{paths.root} and run p2pfl certs again",
                highlight=False,
                soft_wrap=True,
            )
        return 0
    hosts = list(args.broker_host or [])
    if not cfg.broker.mdns and cfg.broker.host not in hosts:
        hosts.append(cfg.broker.host)
    paths = make_swarm_certs(out, cfg.name, ids, hosts, days=args.days, overwrite=args.force)
    console.print(
        f"[green]ok[/] {out}: swarm CA, broker certificate for {', '.join(hosts) or '-'} "
        f"(+127.0.0.1, localhost), {len(ids)} node identities (Ed25519), a read-only "
        "observer identity for the dashboard, Mosquitto ACL",
        highlight=False,
        soft_wrap=True,
    )
    console.print(
        f"each device needs {paths.ca_cert.name} and its own nodes/<id>.crt + nodes/<id>.key; "
        f"keep {paths.ca_key} off the devices; a dashboard needs {paths.ca_cert.name} and "
        f"{paths.observer_cert.name} + {paths.observer_key.name}",
        highlight=False,
        soft_wrap=True,
    )
    return 0


def cmd_enroll(args: argparse.Namespace) -> int:
    """``p2pfl enroll request|approve``: a certificate whose key never leaves the device."""
    from p2pfl.sites.trust.enroll_command import enroll

    return enroll(args)


def cmd_discover(args: argparse.Namespace) -> int:
    """List the brokers and nodes announced over mDNS, then exit."""
    from rich.table import Table

    from p2pfl.wire.discovery import discover

    found = asyncio.run(discover(args.seconds, args.interface or None))
    table = Table(title=f"p2pfl services seen by mDNS in {args.seconds:g} s")
    for col in ("role", "swarm", "node", "algorithm", "address", "protocol"):
        table.add_column(col)
    for s in found:
        address = f"{s.host}:{s.port}" if s.role == "broker" else s.host
        table.add_row(s.role, s.swarm, s.node or "", s.algorithm or "", address, str(s.protocol))
    Console().print(table)
    swarms = sorted({s.swarm for s in found})
    Console().print(
        f"{sum(s.role == 'broker' for s in found)} broker(s), "
        f"{sum(s.role == 'node' for s in found)} node(s), swarms: {', '.join(swarms) or '—'}"
    )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Write a run's trained models as safetensors, ONNX or TorchScript files."""
    from p2pfl.export import ExportError, export_filename, export_model, nodes_with_models

    run = Path(args.run_dir)
    if not run.is_dir():
        raise ExportError(f"{run}: no such run directory")
    ids = [args.node] if args.node else nodes_with_models(run)
    if not ids:
        raise ExportError(f"{run}: no node has a trained model (nodes/<id>.safetensors)")
    for nid in ids:
        out = Path(args.out) / export_filename(nid, args.format) if args.out else None
        print(export_model(run, nid, args.format, out), flush=True)
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    """Classify a CSV file or an image folder with a node's trained model, or with the
    model a site serves (``--site``: its model store's served entry)."""
    from p2pfl.export import classify

    if args.site is not None:
        from p2pfl.sites.daemon.site_file import load_site
        from p2pfl.sites.models.store import ModelStore

        given = [p for p in (args.run_dir, args.input) if p is not None]
        if len(given) != 1 or args.node is not None:
            raise SystemExit("p2pfl predict --site site.yaml INPUT: one input, no run or --node")
        site = load_site(args.site)
        store = ModelStore(site.state_dir, site.site)
        entry = store.served()
        if entry is None:
            raise SystemExit(
                f"p2pfl predict: site {site.site} serves no model yet (p2pfl models list)"
            )
        print(f"site {site.site}: model {entry.id} (run {entry.run_id})", flush=True)
        run_dir, node, source = store.path(entry.id), site.site, given[0]
    else:
        if args.run_dir is None or args.input is None or args.node is None:
            raise SystemExit(
                "p2pfl predict: give RUN_DIR --node NODE INPUT, or --site site.yaml INPUT"
            )
        run_dir, node, source = args.run_dir, args.node, args.input
    result = classify(run_dir, node, source, args.out)
    line = f"{result.rows} predictions written to {result.path}"
    if result.accuracy is not None:
        line += f"; accuracy {result.accuracy:.4f} on {result.labelled} labelled inputs"
    print(line, flush=True)
    return 0


def cmd_methods(args: argparse.Namespace) -> int:
    """List the installed methods (built-in and from ``p2pfl.methods`` entry points) with
    their kind, origin and knobs with defaults."""
    from rich.table import Table

    from p2pfl.algorithms import get_algorithm, known_algorithms, method_source

    table = Table(title="p2pfl methods")
    for col in ("method", "kind", "from", "knobs (default)"):
        table.add_column(col, overflow="fold")
    for name in known_algorithms():
        cls = get_algorithm(name)
        knobs = []
        for knob, info in cls.Params.model_fields.items():
            default = info.get_default(call_default_factory=True)
            knobs.append(f"{knob}={default!r}")
        table.add_row(name, cls.kind, method_source(name), ", ".join(knobs) or "—")
    Console(width=max(100, console.width)).print(table)
    return 0


# ----------------------------------------------------------------------------- parser


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "swarm": cmd_swarm,
    "node": cmd_node,
    "validate": cmd_validate,
    "broker": cmd_broker,
    "certs": cmd_certs,
    "enroll": cmd_enroll,
    "discover": cmd_discover,
    "track": cmd_track,
    "dashboard": cmd_dashboard,
    "summarize": cmd_summarize,
    "export": cmd_export,
    "predict": cmd_predict,
    "methods": cmd_methods,
    **site_commands(),
}


def main(argv: list[str] | None = None) -> int:
    from p2pfl.wire.sysopt import raise_fd_limit, tune_malloc

    tune_malloc()  # before the first large allocation (see p2pfl.wire.sysopt)
    raise_fd_limit()  # packed nodes and the broker hold sockets by the hundred
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose, rich=not getattr(args, "no_rich", False))
    try:
        return int(COMMANDS[args.command](args) or 0)
    except ConfigError as exc:
        _print_config_error(exc)
        if args.verbose:
            console.print_exception()
        return 2
    except P2PFLError as exc:  # a certificate, the broker, the wire: a message, not a trace
        console.print(f"[red]error[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        if args.verbose:
            console.print_exception()
        return 2


if __name__ == "__main__":
    sys.exit(main())
