"""The local-swarm launcher: a private broker, node processes, live progress, a summary.

:func:`run_swarm` starts Mosquitto on a free loopback port, writes the resolved topology to
the run directory, starts the nodes as separate OS processes (``K`` asyncio nodes per
process with ``nodes_per_process``), shows the round each node reached and its latest
accuracy while they run (a live table on a terminal; where the console is not one, a pipe
or a file, one line a round: :class:`PlainProgress`), then writes ``summary.json``,
``label_histograms.json`` and ``accuracy.png`` and prints the summary. Every process it
started is stopped on the way out, also on Ctrl-C or an error.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from p2pfl.check.checked import CHECKED_FLAG, config_digest
from p2pfl.config.schema import BrokerAddress, TopologyConfig, dump_topology
from p2pfl.launch.broker import BrokerTLS, make_broker
from p2pfl.launch.tracker import RecordFollower, RoundMeans, open_tracking
from p2pfl.metrics import (
    defence_note,
    node_log_path,
    node_meta_path,
    plot_summary,
    read_records,
    skipped_note,
    summarize,
    write_json,
    write_text_atomic,
)
from p2pfl.security.certs import SwarmCerts, make_swarm_certs
from p2pfl.wire.sysopt import raise_fd_limit


@dataclass
class Worker:
    ids: list[str]
    proc: subprocess.Popen
    log_path: Path


def group_ids(ids: list[str], per_process: int) -> list[list[str]]:
    return [ids[i : i + per_process] for i in range(0, len(ids), per_process)]


def auto_per_process(n_nodes: int, cores: int | None = None) -> int:
    """Nodes per process for about one process per CPU core (``os.cpu_count()``): each
    process imports torch once (~0.5 GB, a few seconds) and its nodes share it, while
    training still spreads over every core."""
    cores = max(1, cores or os.cpu_count() or 1)
    return max(1, -(-n_nodes // cores))


def spawn_worker(
    config_path: Path,
    ids: list[str],
    broker: str,
    out_dir: Path,
    verbose: bool,
    source: str | None = None,
    checked: str | None = None,
) -> Worker:
    """Start one node process for ``ids`` on the run's ``config_path``; ``source`` is the
    user's topology file, which its error messages name (default: ``config_path``).
    ``checked``: the digest of ``config_path`` (:func:`~p2pfl.check.checked.config_digest`)
    when the launcher ran every check on it: the process then trusts that check for its
    nodes instead of repeating it (None: it checks them itself)."""
    log_path = out_dir / "logs" / f"{ids[0]}{'-' + ids[-1] if len(ids) > 1 else ''}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "p2pfl.cli",
        "node",
        str(config_path),
        "--broker",
        broker,
        "--out",
        str(out_dir),
        "--no-rich",
    ]
    for nid in ids:
        cmd += ["--id", nid]
    if source is not None:
        cmd += ["--source", source]
    if checked is not None:
        cmd += [CHECKED_FLAG, checked]
    if verbose:
        cmd.append("-v")
    f = open(log_path, "ab")
    proc = subprocess.Popen(
        cmd,
        stdout=f,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # Ctrl-C goes to the launcher, which stops them in order
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    f.close()
    return Worker(ids, proc, log_path)


def stop_workers(workers: list[Worker], grace: float = 10.0) -> None:
    """SIGTERM every live worker, then SIGKILL what is left after ``grace`` seconds."""
    for w in workers:
        if w.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for w in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            w.proc.wait(max(0.0, deadline - time.monotonic()))
        if w.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.proc.pid, signal.SIGKILL)
            w.proc.wait()


def progress_table(cfg: TopologyConfig, out_dir: Path, workers: list[Worker], t0: float) -> Table:
    table = Table(title=f"{cfg.name}: {cfg.algorithm.name}, {time.monotonic() - t0:.0f} s")
    for col in ("node", "round", "acc", "peers", "dropout", "state"):
        table.add_column(col)
    state_of = {}
    for w in workers:
        rc = w.proc.poll()
        for nid in w.ids:
            state_of[nid] = "running" if rc is None else ("exited" if rc == 0 else f"failed ({rc})")
    for nid in cfg.node_ids:
        recs = read_records(node_log_path(out_dir, nid))
        last = recs[-1] if recs else {}
        table.add_row(
            nid,
            f"{last.get('round', 0)}/{cfg.rounds}",
            f"{last['test_acc']:.4f}" if last else "-",
            ",".join(last.get("peers", [])) if last else "-",
            "yes" if last.get("dropout") else ("-" if not last else "no"),
            state_of.get(nid, "?"),
        )
    return table


class PlainProgress:
    """A swarm's progress as plain lines, for a console that is not a terminal: one line a
    round, ``round 3/5: 8/8 nodes, acc 0.712, 41.2 s`` (the nodes that reported the round,
    their mean ``test_acc``, the seconds since the launch), printed once every node still
    running has reported the round or passed it (a node that exited does not hold it back;
    :class:`~p2pfl.launch.tracker.RoundMeans`), in round order; :meth:`finish` prints the
    rounds left open at the end."""

    def __init__(self, cfg: TopologyConfig, out_dir: Path, console: Console, t0: float):
        self.expected = list(cfg.node_ids)
        self.rounds = cfg.rounds
        self.console = console
        self.t0 = t0
        self.follower = RecordFollower(out_dir)
        self.means = RoundMeans()

    def update(self, live: Collection[str]) -> None:
        """Print the rounds now complete; ``live``: the nodes still running, asked before
        the records are read (a node that writes its last record and exits in between is
        then still waited for, not skipped)."""
        self._read()
        for rnd, metrics, _ in self.means.ready(self.expected, live):
            self._say(rnd, metrics)

    def finish(self) -> None:
        """Print every round still open (the nodes have stopped)."""
        self._read()
        for rnd, metrics, _ in self.means.rest():
            self._say(rnd, metrics)

    def _read(self) -> None:
        for node, rec in self.follower.poll():
            self.means.add(node, rec)

    def _say(self, rnd: int, metrics: dict[str, float]) -> None:
        acc = metrics.get("mean/test_acc")
        nodes = int(metrics.get("swarm/nodes", 0))
        self.console.print(
            f"round {rnd}/{self.rounds}: {nodes}/{len(self.expected)} nodes, "
            f"acc {'-' if acc is None else f'{acc:.3f}'}, {time.monotonic() - self.t0:.1f} s",
            highlight=False,
            soft_wrap=True,
        )


def summary_table(summary: dict[str, Any]) -> Table:
    t = Table(title=f"summary: {summary['algorithm']}")
    t.add_column("metric")
    t.add_column("value", justify="right")
    f = summary["final"]
    metrics = summary.get("metrics") or {}
    accuracy = (
        []
        if metrics and math.isnan(f["acc_mean"])
        else [  # a task with no accuracy
            ("final acc mean ± std", f"{f['acc_mean']:.4f} ± {f['acc_std']:.4f}"),
            ("final acc min / max", f"{f['acc_min']:.4f} / {f['acc_max']:.4f}"),
            ("best acc mean", f"{summary['best_acc_mean']:.4f}"),
        ]
    )
    rows = [
        ("nodes (completed)", f"{summary['nodes']} ({summary['nodes_completed']})"),
        ("rounds", str(summary["rounds"])),
        ("wall time", f"{summary['wall_s']:.1f} s"),
        *accuracy,
        *(
            (
                f"final {name[5:]} mean (min / max)",
                f"{m['mean']:.4f} ({m['min']:.4f} / {m['max']:.4f})",
            )
            for name, m in metrics.items()
        ),
        ("bytes sent (all nodes)", f"{summary['bytes_sent_total'] / 1e6:.2f} MB"),
        ("dropout rounds", str(summary["dropout_rounds"])),
        *_skipped_rows(summary),
        *_privacy_rows(summary),
    ]
    for k, v in rows:
        t.add_row(k, v)
    return t


def finish_run(
    cfg: TopologyConfig, out_dir: Path, wall_s: float | None, console: Console | None = None
) -> dict[str, Any]:
    """Write ``label_histograms.json``, ``summary.json`` and the plot for a finished (or
    partial) run, and return the summary. Never raises for what the run left behind: a
    missing or unreadable node file is skipped, and a file that cannot be written (a full
    disk) is reported on ``console`` — the summary is still returned."""
    hists = {}
    for nid in cfg.node_ids:
        try:
            meta = json.loads(node_meta_path(out_dir, nid).read_text())
            hists[nid] = {"train": meta["train_hist"], "test": meta["test_hist"]}
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a node that never started, or a torn file
    summary = summarize(
        out_dir,
        algorithm=cfg.algorithm.name,
        expected_nodes=cfg.node_ids,
        rounds=cfg.rounds,
        wall_s=wall_s,
    )
    try:
        write_json(out_dir / "label_histograms.json", hists)
        write_json(out_dir / "summary.json", summary)
    except OSError as exc:
        (console or Console(stderr=True)).print(
            f"[red]could not write the summary in {out_dir}: {exc}[/]", highlight=False
        )
    with contextlib.suppress(Exception):  # a plot must never fail a run
        plot_summary(summary, out_dir / "accuracy.png")
    return summary


def ensure_certs(cfg: TopologyConfig, out_dir: Path, console: Console) -> TopologyConfig:
    """With ``security`` on, make sure the swarm has certificates for every node: create
    them (in ``security.certs``, or ``<run>/certs`` when it is not set) where the directory
    has no CA yet, and record the absolute path in the config the nodes read."""
    if not cfg.security.enabled:
        return cfg
    root = Path(cfg.security.certs or out_dir / "certs").absolute()
    paths = SwarmCerts(root)
    missing = [n for n in cfg.node_ids if not paths.node_cert(n).exists()]
    if not paths.ca_cert.exists() or missing:
        make_swarm_certs(root, cfg.name, cfg.node_ids)
        console.print(f"[bold]certs[/] swarm CA and {len(cfg.node_ids)} node identities in {root}")
    security = cfg.security.model_copy(update={"certs": str(root)})
    return cfg.model_copy(update={"security": security})


def run_swarm(
    cfg: TopologyConfig,
    out_dir: Path,
    *,
    nodes_per_process: int | None = None,
    broker: BrokerAddress | None = None,
    broker_kind: str = "auto",
    progress: bool = True,
    verbose: bool = False,
    console: Console | None = None,
    timeout_s: float | None = None,
    tracker: str | None = None,
    on_start: Callable[[TopologyConfig], None] | None = None,
    source: str | None = None,
    checked: bool = False,
) -> tuple[int, dict[str, Any]]:
    """Run a whole swarm to completion; returns (exit code, summary). Without ``broker`` it
    starts its own, of ``broker_kind`` (:func:`p2pfl.launch.broker.make_broker`).
    ``tracker``: feed the records to it as they come (:mod:`p2pfl.launch.tracker`).
    ``on_start`` is called with the resolved config once the run's ``config.yaml`` is
    written, before the nodes start (``--dashboard`` starts there). ``source``: the user's
    topology file, which the nodes' error messages name instead of the run's
    ``config.yaml``. The caller checks the config first
    (:func:`p2pfl.check.checked.check_topology`): nothing here reads the data.
    ``checked``: the caller ran every check, the data and the model included (``p2pfl
    swarm`` does): the node processes trust it (the run's ``config.yaml`` digest is handed
    to them) and build each node's model and method once, to run; False: each node process
    checks its nodes itself, as a standalone ``p2pfl node``."""
    console = console or Console()
    raise_fd_limit()  # the broker and the packed workers inherit it
    out_dir = Path(out_dir)
    tracking = open_tracking(tracker, cfg, out_dir, console)  # before anything starts
    out_dir.mkdir(parents=True, exist_ok=True)
    for pattern in ("*.jsonl", "*.ckpt"):  # a rerun into the same directory starts afresh
        for old in (out_dir / "nodes").glob(pattern):
            old.unlink()
    own_broker = None
    workers: list[Worker] = []
    t0 = time.monotonic()
    code = 1
    try:
        cfg = ensure_certs(cfg, out_dir, console)
        if broker is None:
            tls = BrokerTLS(Path(cfg.security.certs), cfg.name) if cfg.security.tls else None
            own_broker = make_broker(
                broker_kind,
                workdir=out_dir / "broker",
                max_packet_mb=cfg.max_message_mb * 2,
                tls=tls,
                warn=lambda note: console.print(f"[yellow]{escape(note)}[/]"),
            ).start()
            broker = BrokerAddress(host=own_broker.host, port=own_broker.port)
            console.print(
                f"[bold]broker[/] {own_broker.name} on {own_broker.address}"
                + (" (TLS, client certificates, per-node ACL)" if tls else "")
            )
        cfg = cfg.model_copy(update={"broker": broker})
        if cfg.dataset.root and not os.path.isabs(cfg.dataset.root):
            # the recorded config must not depend on where it is read from
            root = os.path.abspath(cfg.dataset.root)
            cfg = cfg.model_copy(update={"dataset": cfg.dataset.model_copy(update={"root": root})})
        config_path = out_dir / "config.yaml"
        write_text_atomic(config_path, dump_topology(cfg))
        digest = config_digest(config_path) if checked else None
        if on_start is not None:
            on_start(cfg)
        per_process = nodes_per_process or auto_per_process(len(cfg.node_ids))
        groups = group_ids(cfg.node_ids, max(1, per_process))
        workers = [
            spawn_worker(config_path, ids, str(broker), out_dir, verbose, source, digest)
            for ids in groups
        ]

        def running() -> set[str]:  # the nodes of the processes still running
            return {n for w in workers if w.proc.poll() is None for n in w.ids}

        tracking.follow(running)
        console.print(
            f"[bold]swarm[/] {cfg.name}: {len(cfg.node_ids)} nodes in {len(workers)} "
            f"processes, {cfg.rounds} rounds of {cfg.algorithm.name} → {out_dir}"
        )
        deadline = None if timeout_s is None else t0 + timeout_s
        # a terminal gets the live table; a pipe or a file one line a round
        plain = PlainProgress(cfg, out_dir, console, t0) if progress else None
        with (
            Live(
                progress_table(cfg, out_dir, workers, t0),
                console=console,
                refresh_per_second=2,
                transient=False,
            )
            if progress and console.is_terminal
            else contextlib.nullcontext() as live
        ):
            while any(w.proc.poll() is None for w in workers):
                if deadline is not None and time.monotonic() > deadline:
                    console.print(f"[red]swarm timed out after {timeout_s:.0f} s[/]")
                    break
                time.sleep(0.5)
                if live is not None:
                    live.update(progress_table(cfg, out_dir, workers, t0))
                elif plain is not None:
                    plain.update(running())
        if live is None and plain is not None:
            plain.finish()
        failed = [w for w in workers if w.proc.poll() not in (0, None)]
        for w in failed:
            console.print(
                f"[red]process for {','.join(w.ids)} exited with "
                f"{w.proc.returncode}; log: {w.log_path}[/]"
            )
        code = 0 if not failed and all(w.proc.poll() == 0 for w in workers) else 1
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping every node and the broker[/]")
        code = 130
    finally:
        stop_workers(workers)
        if own_broker is not None:
            own_broker.stop()
        tracking.finish(code)
    summary = finish_run(cfg, out_dir, time.monotonic() - t0, console)
    if summary["nodes_completed"] < summary["nodes"] and code == 0:
        code = 1
    console.print(summary_table(summary))
    for note in (skipped_note(summary), defence_note(summary)):
        if note is not None:
            console.print(f"[yellow]{escape(note)}[/]", highlight=False)
    console.print(f"results in {out_dir}")
    return code, summary


def _skipped_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary table's row of skipped node-rounds (none for an older run's summary)."""
    skipped = summary.get("rounds_skipped")
    if not isinstance(skipped, dict):
        return []
    return [("node-rounds skipped", str(skipped.get("total", 0)))]


def _privacy_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary table's ε rows, under ``privacy.dp`` only."""
    eps = summary.get("epsilon")
    if not isinstance(eps, dict):
        return []
    rows = [("ε (max / mean over nodes)", f"{eps['max']:.3f} / {eps['mean']:.3f}")]
    if eps.get("exhausted"):
        rows.append(("DP budget spent", ", ".join(eps["exhausted"])))
    return rows
