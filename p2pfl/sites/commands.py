"""The command line of a standing federation: ``p2pfl daemon``, and the commands that talk
to a site's daemon through its admin socket (``submit``, ``vote``, ``runs``, ``logs``,
``cancel``, ``drain``). Each finds the socket in the site file's ``state_dir``; ``models``
reads and changes the site's model store there directly; ``policy check`` and
``validate --site`` judge a spec and check a site file as its daemon would, with no daemon."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from p2pfl.sites.daemon.admin_socket import call

log = logging.getLogger("p2pfl.sites")
out = Console(highlight=False, soft_wrap=True)  # a command's answer: on stdout
said = Console(
    stderr=True, highlight=False, soft_wrap=True
)  # what validate says, as for a topology


def _site(args: argparse.Namespace):
    from p2pfl.sites.daemon.site_file import load_site

    return load_site(args.site)


def cmd_daemon(args: argparse.Namespace) -> int:
    """Run the site's daemon in the foreground until drained (0) or stopped by a signal."""
    if args.print_systemd_unit:
        from p2pfl.sites.daemon.systemd import DEFAULT_USER, unit_text

        if not args.site:
            raise SystemExit("p2pfl daemon --print-systemd-unit: give --site site.yaml")
        site = _site(args)  # the unit names a site file that loads
        exe = shutil.which("p2pfl") or [sys.executable, "-m", "p2pfl"]
        unit = unit_text(
            Path(args.site).resolve(),
            executable=exe,
            state_dir=site.state_dir,
            user=args.user or DEFAULT_USER,
        )
        sys.stdout.write(unit)
        return 0
    if not args.site:
        raise SystemExit("p2pfl daemon: give --site site.yaml")
    site = _site(args)
    if site.observability.log_format == "json":
        from p2pfl.sites.daemon.json_log import use_json_logs

        use_json_logs(logging.DEBUG if args.verbose else logging.INFO)
    with _one_daemon(site, args.site):
        return asyncio.run(_serve(site))


@contextlib.contextmanager
def _one_daemon(site, source: str) -> Iterator[None]:
    """The daemon's start, before it binds or creates anything: the ``state_dir``'s lock
    (a second daemon stops here, touching nothing of the first), the end of what a killed
    predecessor left running, and its ports checked free; the record of its children is
    kept while it runs (:mod:`p2pfl.sites.daemon.state_lock`, :mod:`p2pfl.sites.daemon.process_guard`)."""
    from p2pfl.sites.daemon import process_guard
    from p2pfl.sites.daemon.observe import check_listen
    from p2pfl.sites.daemon.state_lock import StateLock

    with StateLock(site.state_dir):
        record = process_guard.ChildRecord(site.state_dir)
        record.end_leftovers()
        hosted = site.hosted_broker
        for field, listen in (
            ("observability.listen", site.observability.listen),
            ("serving.listen", site.serving.listen),
            ("broker.embedded.listen", hosted.listen if hosted else None),
        ):
            if listen is not None:
                check_listen(f"{source}: {field}", listen)
        process_guard.install(record)
        try:
            yield
        finally:
            process_guard.install(None)
            record.close()


async def _serve(site) -> int:
    from p2pfl.sites.daemon.site_daemon import SiteDaemon, install_signal_handlers

    broker = None
    address = site.broker_address
    hosted = site.hosted_broker
    if hosted is not None:  # this daemon hosts the federation's broker
        broker = _hosted_broker(site, hosted)
        broker.start(tied=True)  # a killed daemon leaves no broker holding its port
    elif address == "mdns":
        from p2pfl.wire.discovery import find_broker

        address = str(await find_broker(site.swarm, 60.0))
        log.info("%s: broker of swarm %s found at %s (mDNS)", site.site, site.swarm, address)
    try:
        daemon = SiteDaemon(site, broker=address)
        task = asyncio.current_task()
        assert task is not None
        install_signal_handlers(task)
        try:
            return await daemon.run()
        except asyncio.CancelledError:
            log.warning("%s: site daemon stopped by signal", site.site)
            return 0
    finally:
        if broker is not None:
            broker.stop()


def _hosted_broker(site, hosted):
    """The broker ``broker: embedded`` hosts, not started: Mosquitto with TLS, client
    certificates and the swarm's ACL where the site has ``certs`` (the embedded broker has
    no TLS), else the embedded pure-Python broker; on ``hosted.listen``. A broker that other
    hosts reach without TLS is logged as a warning: anyone who reaches it may publish."""
    from p2pfl.launch.broker import BrokerTLS, make_broker

    host, _, port = hosted.listen.rpartition(":")
    workdir = Path(site.state_dir) / "broker"
    if site.certs is not None:
        tls = BrokerTLS(Path(site.certs), site.swarm)
        return make_broker("mosquitto", host, int(port), tls=tls, workdir=workdir)
    if host not in ("127.0.0.1", "localhost", "::1"):
        log.warning(
            "%s: the hosted broker listens on %s without TLS (the site file has no certs): "
            "anyone who reaches it can connect and publish",
            site.site,
            hosted.listen,
        )
    return make_broker("embedded", host, int(port), workdir=workdir)


def cmd_submit(args: argparse.Namespace) -> int:
    from p2pfl.check.load import load_yaml
    from p2pfl.sites.consent.run_spec import load_run_spec

    if (args.spec is None) == (args.retry is None):
        raise SystemExit("p2pfl submit: give a run spec, or --retry RUN_ID (not both)")
    site = _site(args)
    if args.retry is not None:
        answer = call(site.state_dir, "retry", run_id=args.retry)
    else:
        load_run_spec(args.spec)  # its errors name the file, before the daemon is asked
        answer = call(site.state_dir, "submit", spec=load_yaml(args.spec), source=str(args.spec))
    if args.json:
        print(json.dumps({k: v for k, v in answer.items() if k != "ok"}))
    else:
        attempt = f", attempt {answer['attempt']} of {args.retry}" if args.retry else ""
        out.print(
            f"{site.site}: proposed run {answer['run_id']} ({answer['name']}{attempt}); the "
            f"sites vote within {answer['vote_deadline_s']:g} s (p2pfl runs --site {args.site})"
        )
    return 0


def cmd_vote(args: argparse.Namespace) -> int:
    site = _site(args)
    answer = call(site.state_dir, "vote", run_id=args.run_id, accept=bool(args.accept))
    out.print(f"{site.site}: run {args.run_id}: {answer['vote']}")
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    from p2pfl.sites.daemon.admin_socket import DaemonDown

    site = _site(args)
    offline = False
    try:
        runs = call(site.state_dir, "runs")["runs"]
    except DaemonDown:  # its ledger, as it last wrote it
        from p2pfl.sites.daemon.admin_commands import ledger_rows

        runs, offline = ledger_rows(Path(site.state_dir), site.site), True
    if args.json:
        print(json.dumps(runs, indent=1))
        return 0
    if offline:
        out.print(
            f"{site.site}: the daemon is not running; its ledger, read-only, as it last wrote it"
        )
    if not runs:
        out.print(f"{site.site}: no runs yet")
        return 0
    out.print(f"runs at site {site.site}:")
    for r in runs:
        why = f" ({escape(r['why'])})" if r["why"] else ""
        out.print(
            f"[bold]{r['run_id']}[/]  {escape(r['name'])}"
            + (f" cycle {r['cycle']}" if r.get("cycle") else "")
            + (f" attempt {r['attempt']} (retries {r['retry_of']})" if r.get("retry_of") else "")
            + f"  proposed by {r['proposer']}  "
            f"[bold]{r['status']}[/]{why}  round {r['round']}/{r['rounds']}"
        )
        if r["members"]:
            out.print(f"  members: {', '.join(r['members'])}")
        for voter, v in sorted(r["votes"].items()):
            reasons = "; ".join(f"{x['code']}: {x['detail']}" for x in v["reasons"])
            out.print(f"  {voter}: {v['vote']}" + (f" ({escape(reasons)})" if reasons else ""))
        for line in _site_lines(r):
            out.print(line)
    return 0


LEFT = {"failed", "cancelled", "aborted"}
"""A member's statuses that mean it did not see the run through."""


def _site_lines(row: dict) -> list[str]:
    """Each site's status of a run as it last told it (``p2pfl runs``): status, round and
    metrics; a member that left or failed is marked."""
    sites = row.get("sites") or {}
    if not sites:
        return []
    lines = ["  as each site tells it:"]
    for name, told in sorted(sites.items()):
        figures = ", ".join(
            f"{k.removeprefix('test_')} {v:.4g}" for k, v in sorted(told["metrics"].items())
        )
        mark = (
            " [bold red]left[/]"
            if told["status"] in LEFT and name in row["members"] and row["status"] not in LEFT
            else ""
        )
        why = f" ({escape(told['why'])})" if told["why"] else ""
        lines.append(
            f"    {name}: [bold]{told['status']}[/]{mark}{why}  round {told['round']}"
            + (f"  {figures}" if figures else "")
        )
    return lines


def cmd_logs(args: argparse.Namespace) -> int:
    site = _site(args)
    answer = call(site.state_dir, "logs", run_id=args.run_id, node=args.node, tail=args.tail)
    sys.stdout.write(answer["text"])
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    site = _site(args)
    answer = call(site.state_dir, "cancel", run_id=args.run_id)
    what = "cancelled it" if answer["cancelled"] == "run" else "left it"
    out.print(f"{site.site}: run {args.run_id}: {what}")
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    site = _site(args)
    call(site.state_dir, "drain")
    out.print(f"{site.site}: draining: no new runs; running ones leave after their round")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    """``p2pfl models list | promote | rollback``: the site's model store, read and changed
    in its ``state_dir`` (:mod:`p2pfl.sites.models.store`; no daemon needed)."""
    from p2pfl.sites.models.store import ModelStore

    site = _site(args)
    store = ModelStore(site.state_dir, site.site)
    if args.models_command == "promote":
        entry = store.promote(args.model)
        out.print(f"{site.site}: serving {entry.id} (run {entry.run_id}): {escape(entry.reason)}")
        return 0
    if args.models_command == "offer":
        from p2pfl.export.held_out import held_out_scorer
        from p2pfl.sites.runs.worker import RunWorker

        run_dir = Path(site.state_dir) / "runs" / args.run_id
        records = RunWorker(run_dir, args.run_id, site.site)  # the reader of its records
        records.new_records()
        facts = _run_facts(run_dir)
        entry = store.add(
            run_dir,
            args.run_id,
            round_no=records.last_round or None,
            cycle=facts.get("cycle"),
            data_version=facts.get("data_version"),
            series=facts.get("series"),
            parent=facts.get("warm_start"),
        )
        metric = site.promote.metric
        scorer = held_out_scorer(run_dir, site.site, metric)
        entry = store.judge(entry.id, scorer, site.promote.min_delta, metric)
        out.print(
            f"{site.site}: {entry.id}: held-out {metric} {entry.accuracy:.4f}: "
            f"[bold]{entry.status}[/] ({escape(entry.reason)})"
        )
        return 0
    if args.models_command == "rollback":
        entry = store.rollback()
        out.print(f"{site.site}: serving {entry.id} (run {entry.run_id}) again")
        return 0
    entries = store.entries()
    served = store.served()
    if args.json:
        from dataclasses import asdict

        print(
            json.dumps(
                {"served": served and served.id, "models": [asdict(e) for e in entries]}, indent=1
            )
        )
        return 0
    if not entries:
        out.print(f"{site.site}: no models yet")
        return 0
    out.print(f"models at site {site.site}:")
    for e in entries:
        mark = "*" if served is not None and e.id == served.id else " "
        acc = "–" if e.accuracy is None else f"{e.accuracy:.4f}"
        where = f"run {e.run_id}" + (f" cycle {e.cycle}" if e.cycle is not None else "")
        where += f" round {e.round}" if e.round is not None else ""
        why = f" ({escape(e.reason)})" if e.reason else ""
        out.print(f"{mark} [bold]{e.id}[/]  {where}  {e.metric} {acc}  [bold]{e.status}[/]{why}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """``p2pfl serve --site``: the site's served model over HTTP (:mod:`p2pfl.sites.models.serving`)
    until SIGTERM or Ctrl-C; the site daemon runs it when ``serving.listen`` is set."""
    from p2pfl.cpu_set import pin
    from p2pfl.sites.daemon.observe import parse_listen
    from p2pfl.sites.models.serving_pool import serve, usable_cores
    from p2pfl.sites.models.store import ModelStore

    site = _site(args)
    listen = args.listen or site.serving.listen
    if listen is None:
        raise SystemExit(f"p2pfl serve: {args.site}: serving.listen is not set (or give --listen)")
    if site.observability.log_format == "json":
        from p2pfl.sites.daemon.json_log import use_json_logs

        use_json_logs(logging.DEBUG if args.verbose else logging.INFO)
    try:
        address = parse_listen(listen)
    except ValueError as exc:
        raise SystemExit(f"p2pfl serve: --listen: {exc}") from None
    pin(site.serving.cpus)  # before the pool is sized: auto is one worker a CPU of the set
    workers = site.serving.workers
    serve(
        ModelStore(site.state_dir, site.site),
        address,
        site.serving.max_request_bytes,
        site.serving.missing,
        site.serving.runtime,
        usable_cores() if workers == "auto" else workers,
    )
    return 0


def cmd_trust(args: argparse.Namespace) -> int:
    """``p2pfl trust publish --certs CA_DIR --site``: the swarm's CRL (``CA_DIR/crl.pem``,
    made by ``p2pfl certs --revoke``) as a signed, retained trust message, through this
    site's broker and identity; every daemon applies it without a restart."""
    from p2pfl.security.certs import SwarmCerts, crl_number, load_certificate, load_crl
    from p2pfl.security.trust import crl_text
    from p2pfl.sites.consent import messages as M

    site = _site(args)
    if site.certs is None:
        raise SystemExit(f"p2pfl trust: {args.site}: no certs: an unsigned federation has no CRL")
    paths = SwarmCerts(Path(args.certs))
    paths.require(paths.ca_cert, paths.crl)
    crl = load_crl(paths, load_certificate(paths.ca_cert))
    assert crl is not None
    if crl_number(crl) < 1:
        raise SystemExit(f"p2pfl trust: {paths.crl}: no CRL number: run p2pfl certs --revoke again")
    body = {"crl": crl_text(crl)}
    identity = M.SiteIdentity.from_certs(site.certs, site.site)
    topic, payload = M.encode(site.swarm, "trust", M.TRUST_RUN, site.site, body, identity)
    asyncio.run(_publish_once(site, topic, payload))
    out.print(
        f"{site.site}: published CRL number {crl_number(crl)} ({len(list(crl))} revoked) "
        f"to swarm {site.swarm}"
    )
    return 0


async def _publish_once(site, topic: str, payload: bytes) -> None:
    import aiomqtt

    from p2pfl.security.signing import tls_context

    address = site.broker_address
    if address == "mdns":
        raise SystemExit("p2pfl trust: broker mdns: give the site's broker as host:port")
    host, _, port = address.rpartition(":")
    try:
        async with aiomqtt.Client(
            host, int(port), tls_context=tls_context(site.certs, site.site), timeout=30
        ) as client:
            await client.publish(topic, payload, qos=1, retain=True)
    except aiomqtt.MqttError as exc:
        raise SystemExit(f"p2pfl trust: broker {address}: {exc}") from None


def _run_facts(run_dir: Path) -> dict:
    """What the daemon recorded of a run it started (``run.json``); empty when absent."""
    try:
        facts = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return {}
    return facts if isinstance(facts, dict) else {}


def cmd_policy(args: argparse.Namespace) -> int:
    """``p2pfl policy check``: the site's decision on a run spec, with its reasons (the
    vote the site's daemon would give); exit 1 when it would reject the run."""
    from p2pfl.sites.consent.run_spec import load_run_spec, run_facts, run_id
    from p2pfl.sites.daemon.site_file import load_site
    from p2pfl.sites.policy.binding_check import check_binding
    from p2pfl.sites.policy.verdict import check_outside_code, judge

    site = load_site(args.site)
    spec = load_run_spec(args.spec)
    proposer = args.proposer or site.site
    problems = {}  # the run's binding checked as the daemon checks it at the vote
    if spec.data in site.data:
        check = check_binding(spec.data, site.data[spec.data], site.site)
        problems = {} if check.ok else {spec.data: check.text()}
    outside = asyncio.run(check_outside_code(spec, site.policy, None))
    decision = judge(
        spec, proposer, site.policy, site.data, outside=outside, binding_problems=problems
    )
    facts = run_facts(spec, proposer, outside=outside)
    rid = run_id(spec)
    if args.json:
        print(json.dumps({"run_id": rid, "site": site.site, **decision.as_record()}))
    else:  # the command's answer: on stdout
        out.print(
            f"{site.site}: run {rid} ({spec.name}, {spec.algorithm.name}): "
            f"[bold]{decision.vote}[/] under policy {decision.policy}"
        )
        for reason in decision.reasons:
            out.print(f"  {reason.code}: {escape(reason.detail)}")
        if decision.dp_epsilon is not None and decision.dp_epsilon != facts.dp_epsilon:
            out.print(f"  this site trains with DP at epsilon {decision.dp_epsilon:g}")
    return 1 if decision.vote == "reject" else 0


def cmd_validate_site(args: argparse.Namespace) -> int:
    """``p2pfl validate --site``: the site file loads and every check of
    :data:`~p2pfl.sites.policy.site_check.SITE_CHECKS` passes (its data bindings serve a run), else
    a :class:`ConfigError` naming the file and each field (exit 2). No torch on this path."""
    from p2pfl.errors import ConfigError
    from p2pfl.sites.daemon.site_file import load_site
    from p2pfl.sites.policy.site_check import check_site

    if args.topology is not None or args.set or args.method or args.data_root:
        raise SystemExit(
            "p2pfl validate --site: a topology, --set, --method and --data-root "
            "are a topology's: give --site alone"
        )
    site = load_site(args.site)
    report = check_site(site, [] if args.no_data else None)
    if report.problems:
        raise ConfigError(args.site, [(p.field, p.message) for p in report.problems])
    bindings = f"{len(site.data)} data binding{'s' if len(site.data) != 1 else ''}"
    said.print(
        f"[green]ok[/] {args.site}: site {site.site!r} of swarm {site.swarm!r}, {bindings}"
        + (" (not opened: --no-data)" if args.no_data else "")
    )
    for line in report.lines:
        said.print(f"  {escape(line)}")
    return 0


def site_commands() -> dict[str, Callable[[argparse.Namespace], int]]:
    return {
        "daemon": cmd_daemon,
        "submit": cmd_submit,
        "vote": cmd_vote,
        "runs": cmd_runs,
        "logs": cmd_logs,
        "cancel": cmd_cancel,
        "drain": cmd_drain,
        "models": cmd_models,
        "serve": cmd_serve,
        "trust": cmd_trust,
        "policy": cmd_policy,
    }
