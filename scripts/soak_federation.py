"""A soak test of the standing federation (README.md, "A standing federation"): a broker and
three site daemons (``p2pfl daemon --site``) on this machine, N short runs proposed back to
back (each proposed by the next site in turn, the next one once the last has ended at every
site), and faults injected at moments drawn from a seeded RNG:

- ``daemon``: a site daemon SIGKILLed (at a moment of the run's vote, commit or training)
  and started again after a short, random pause;
- ``worker``: a site's worker process (``p2pfl node``) SIGKILLed while it trains;
- ``serving``: the serving process (``p2pfl serve --site``) of the site that serves its
  model SIGKILLed; its daemon starts it again;
- ``broker``: the broker SIGKILLed and started again on the same port (with no persistence:
  its retained messages are lost);
- ``outage``: a site daemon SIGKILLed during the vote and the broker SIGKILLed and started
  again while it is down: the daemon comes back to a broker that lost the run's messages.

At the end it checks that every run reached a final status (finished, failed, aborted,
cancelled) at every site that heard it, with nothing left proposed, committed or running;
that the sites' ledgers agree on every run's commit (the standing committer and its
members); that no ``p2pfl node``, ``serve``, ``models offer`` or ``daemon`` process naming
the soak's folder is left once the daemons stop; and that each site's ``state_dir`` stays
under a bound. It prints a table and writes JSON (``--json``). Exit status 0 when every
check passed.

    python scripts/soak_federation.py [--runs 30] [--seed 0] [--out runs/soak]
        [--json results/soak_federation.json] [--broker auto]

Everything waits on what the daemons' admin sockets answer, with a bound and a message
that says what it waited for; only the fault moments are drawn delays.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import traceback
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from site_fixtures import SYNTHETIC_BINDING as SYNTHETIC  # noqa: E402

from p2pfl.launch.broker import ChildBroker, free_port, make_broker
from p2pfl.sites.consent.agreement import winning_commit
from p2pfl.sites.consent.ledger import FINAL
from p2pfl.sites.daemon.admin_socket import AdminError, call

HERE = Path(__file__).resolve().parents[1]
FAULTS = ("daemon", "worker", "serving", "broker", "outage")
STATUSES = ("finished", "failed", "aborted", "cancelled")
HELPERS = ("node", "serve", "models", "daemon")  # the p2pfl subcommands a site runs


class SoakError(RuntimeError):
    """The soak cannot go on: a daemon that does not come back, a broker that does not
    start. Its words say what was waited for and what was seen."""


@dataclass
class SoakConfig:
    """One soak: ``runs`` runs on ``sites`` site daemons, faults on about ``fault_rate`` of
    the runs (each kind at least once when there are enough runs), drawn from ``seed``."""

    out: Path
    runs: int = 30
    seed: int = 0
    sites: int = 3
    broker: str = "auto"
    fault_rate: float = 0.6
    vote_deadline_s: float = 4.0
    startup_timeout_s: float = 30.0  # how long a run's nodes wait for a missing peer
    worker_window_s: float = 6.0  # a worker is killed this long at most after it started
    run_timeout_s: float = 240.0
    settle_timeout_s: float = 180.0
    max_state_mb: float = 64.0  # the most a site's state_dir may hold at the end
    max_run_mb: float = 4.0  # the most it may grow by in one run


@dataclass
class Fault:
    """One fault: what it hits and when (drawn), then what happened."""

    run: int  # the index of the run it hits (0: the first)
    kind: str  # one of FAULTS
    site: str  # the site hit ("" for the broker)
    delay_s: float  # after the submit; for a worker, after it was seen training
    pause_s: float  # how long a killed daemon or broker stays down
    fired: bool = False
    missed: str = ""  # why it hit nothing
    at_s: float | None = None  # seconds after the submit
    phase: str = ""  # the run's status at the site hit, when it fired
    pid: int | None = None
    back_s: float | None = None  # from the kill until the process was back and answering
    survivors: list[dict[str, Any]] = field(default_factory=list)  # a killed daemon's children

    @property
    def done(self) -> bool:
        return self.fired or bool(self.missed)


@dataclass
class RunRecord:
    """One run of the soak: what was proposed, and where it ended."""

    index: int
    run_id: str
    name: str
    proposer: str
    rounds: int
    fault: str | None
    hit: bool = False  # a fault fired during it
    seconds: float = 0.0
    status: dict[str, str] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)
    state_bytes: dict[str, int] = field(default_factory=dict)  # each state_dir after it


# ---------------------------------------------------------------------------- processes
def proc_table() -> list[tuple[int, int, list[str]]]:
    """(pid, parent pid, arguments) of every process readable in ``/proc``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/cmdline").read_bytes()
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if not raw:  # a zombie or a kernel thread
            continue
        ppid = int(stat[stat.rfind(")") + 2 :].split()[1])
        out.append((int(entry), ppid, raw.rstrip(b"\0").decode(errors="replace").split("\0")))
    return out


def helper_kind(argv: list[str]) -> str | None:
    """Which p2pfl subcommand ``argv`` runs (``node``, ``serve``, ``models offer``,
    ``daemon``), or None when it is no p2pfl process of a site."""
    for i, arg in enumerate(argv[:-2]):
        if arg == "-m" and argv[i + 1] == "p2pfl" and argv[i + 2] in HELPERS:
            sub = argv[i + 2]
            return "models offer" if sub == "models" and "offer" in argv[i + 3 : i + 4] else sub
    if argv and Path(argv[0]).name == "p2pfl" and len(argv) > 1 and argv[1] in HELPERS:
        return argv[1]
    return None


def site_processes(folder: Path) -> list[dict[str, Any]]:
    """The p2pfl processes (daemon, node, serve, models offer) whose arguments name
    ``folder``: what a soak in ``folder`` started, however deep."""
    mark = str(folder).rstrip(os.sep) + os.sep  # not a sibling whose name starts alike
    found = []
    for pid, ppid, argv in proc_table():
        if pid == os.getpid():
            continue
        kind = helper_kind(argv)
        if kind is not None and any(mark in a for a in argv):
            found.append({"pid": pid, "ppid": ppid, "kind": kind, "cmdline": " ".join(argv)})
    return found


def children_of(pid: int) -> list[dict[str, Any]]:
    """The p2pfl processes whose parent is ``pid``."""
    return [
        {"pid": p, "kind": helper_kind(argv), "cmdline": " ".join(argv)}
        for p, ppid, argv in proc_table()
        if ppid == pid and helper_kind(argv) is not None
    ]


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (not a zombie)."""
    try:
        return bool(Path(f"/proc/{pid}/cmdline").read_bytes())
    except OSError:
        return False


def wait_for(pred: Callable[[], Any], timeout: float, what: str, detail=None) -> Any:
    """Poll ``pred`` every 0.25 s until it is truthy (its value), or raise :class:`SoakError`
    naming ``what`` after ``timeout`` s (with ``detail()``'s words when given)."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise SoakError(
                f"timed out after {timeout:g} s waiting for {what}"
                + (f"\n{detail()}" if detail else "")
            )
        time.sleep(0.25)


def http_status(url: str) -> int | None:
    """The HTTP status of GET ``url``; None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return None


def tree_bytes(path: Path) -> int:
    """The bytes of the file ``path``, or of every file under the folder ``path``."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


# ---------------------------------------------------------------------------- a site
class SoakSite:
    """One site: its file, its daemon (started, killed, stopped) and its admin socket."""

    def __init__(self, root: Path, name: str, broker: str, env: dict[str, str], **extra: Any):
        self.name = name
        self.dir = root / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.state_dir = self.dir / "state"
        self.path = self.dir / "site.yaml"
        self.log_path = self.dir / "daemon.log"
        self.env = env
        body = {
            "site": name,
            "swarm": "soak",
            "broker": broker,
            "state_dir": "state",
            "data": {"syn": SYNTHETIC},
            "policy": {},
            "limits": {"max_concurrent_runs": 1},
            "promote": {"offer": False},
            **extra,
        }
        self.path.write_text(yaml.safe_dump(body))
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, timeout: float = 120.0) -> None:
        """Start the daemon and wait until it answers connected to the broker."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "p2pfl", "daemon", "--site", str(self.path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
            )
        self.starts += 1
        self.wait_connected(timeout)

    def wait_connected(self, timeout: float) -> None:
        def connected() -> bool:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise SoakError(f"{self.name}'s daemon exited with {code}:\n{self.tail()}")
            status = self.ask("status")
            return bool(status and status.get("connected"))

        wait_for(connected, timeout, f"{self.name}'s daemon to connect", self.tail)

    @property
    def up(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ask(self, cmd: str, **fields: Any) -> dict[str, Any] | None:
        """The daemon's answer to ``cmd``; None when it does not answer."""
        if not self.up:
            return None
        try:
            return call(self.state_dir, cmd, timeout=20, **fields)
        except AdminError:
            return None

    def runs(self) -> dict[str, dict[str, Any]] | None:
        """Every run the daemon holds by id; None when it does not answer."""
        answer = self.ask("runs")
        return None if answer is None else {r["run_id"]: r for r in answer["runs"]}

    def kill(self) -> list[dict[str, Any]]:
        """SIGKILL the daemon; the p2pfl processes it had started, as they were."""
        assert self.proc is not None
        children = children_of(self.proc.pid)
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        return children

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM the daemon (it stops its workers and serving) and wait; its exit status
        (None: it was not running; killed after ``timeout`` s otherwise)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def serving_pid(self) -> int | None:
        """The pid of the serving process the daemon runs now (None: none)."""
        if not self.up:
            return None
        assert self.proc is not None
        pids = [c["pid"] for c in children_of(self.proc.pid) if c["kind"] == "serve"]
        return pids[0] if pids else None

    def tail(self, chars: int = 3000) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""
        return f"--- {self.log_path} (end) ---\n{text[-chars:]}"


# ---------------------------------------------------------------------------- the soak
def plan_faults(cfg: SoakConfig, rng: random.Random, names: list[str]) -> dict[int, Fault]:
    """Which runs a fault hits, and its kind, site and moments, from ``rng`` alone: about
    ``fault_rate`` of the runs, at most one a run, the first run spared (the serving site
    has no model yet), and every kind at least once when the other runs are as many as the
    kinds. A worker is killed within ``worker_window_s`` of its start, an outage begins
    within the first three quarters of the vote, the other faults within the vote and 8 s
    after it."""
    candidates = list(range(1, cfg.runs)) or [0]
    count = min(len(candidates), max(round(cfg.runs * cfg.fault_rate), len(FAULTS)))
    kinds = [FAULTS[i % len(FAULTS)] for i in range(count)]
    rng.shuffle(kinds)
    plan = {}
    for run, kind in zip(sorted(rng.sample(candidates, count)), kinds, strict=True):
        site = {"broker": "", "serving": names[0]}.get(kind, rng.choice(names))
        window = {"worker": cfg.worker_window_s, "outage": cfg.vote_deadline_s * 0.75}.get(
            kind, cfg.vote_deadline_s + 8.0
        )
        plan[run] = Fault(
            run, kind, site, round(rng.uniform(0, window), 2), round(rng.uniform(0.2, 3.0), 2)
        )
    return plan


def run_spec(index: int, rounds: int, cfg: SoakConfig) -> dict[str, Any]:
    """A tiny run: FedAvg of an MLP on the synthetic binding, ``rounds`` rounds."""
    return {
        "name": f"soak-{index:03d}",
        "rounds": rounds,
        "algorithm": {"name": "fedavg", "params": {}},
        "model": {"name": "mlp"},
        "training": {"epochs": 1, "batch_size": 20, "lr": 0.05},
        "timing": {
            "round_timeout_s": 20,
            "startup_timeout_s": cfg.startup_timeout_s,
            "linger_s": 2,
        },
        "data": "syn",
        "members": "any",
        "quorum": {"min_accept": 2},
        "vote_deadline_s": cfg.vote_deadline_s,
    }


class Soak:
    """A soak of ``cfg`` in ``cfg.out``: :meth:`run` drives it and returns the report."""

    def __init__(self, cfg: SoakConfig, say: Callable[[str], None] = print):
        self.cfg = cfg
        self.say = say
        self.rng = random.Random(cfg.seed)
        self.out = cfg.out.resolve()
        self.broker: ChildBroker | None = None
        self.sites: list[SoakSite] = []
        self.records: list[RunRecord] = []
        self.faults: list[Fault] = []
        self.problems: list[str] = []
        self.serving_port = 0
        self.env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(
                [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        }

    # ------------------------------------------------------------------ the whole soak
    def run(self) -> dict[str, Any]:
        """Start everything, drive the runs with their faults, stop everything, check; the
        report (``problems`` empty when every check passed)."""
        started = time.monotonic()
        shutil.rmtree(self.out, ignore_errors=True)
        self.out.mkdir(parents=True)
        names = [f"site{i + 1}" for i in range(self.cfg.sites)]
        plan = plan_faults(self.cfg, self.rng, names)
        self.faults = [plan[k] for k in sorted(plan)]
        served: dict[str, Any] = {}
        exits: dict[str, int | None] = {}
        try:
            self.broker = make_broker(self.cfg.broker, workdir=self.out / "broker", warn=self.say)
            self.broker.start()
            self.serving_port = free_port()
            for i, name in enumerate(names):
                extra: dict[str, Any] = {}
                if i == 0:  # the serving site: it keeps its finished runs' models and serves
                    extra = {
                        "promote": {"offer": True},
                        "serving": {"listen": f"127.0.0.1:{self.serving_port}"},
                    }
                self.sites.append(SoakSite(self.out, name, self.broker.address, self.env, **extra))
            for site in self.sites:
                site.start()
            self.say(
                f"{len(self.sites)} site daemons on {self.broker.name} {self.broker.address}; "
                f"{self.cfg.runs} runs, {len(self.faults)} faults (seed {self.cfg.seed})"
            )
            for index in range(self.cfg.runs):
                self._one_run(index, plan.get(index))
            self._settle()
            served = self._serving_answer()
        except SoakError as exc:
            self.problems.append(f"the soak stopped early: {exc}")
        except Exception as exc:  # noqa: BLE001 - said in the report, and nothing left running
            self.problems.append(
                f"the soak failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            )
        finally:
            for site in self.sites:
                exits[site.name] = site.stop()
            if self.broker is not None:
                self.broker.stop()
        return self._report(time.monotonic() - started, served, exits)

    def _one_run(self, index: int, fault: Fault | None) -> None:
        """Propose run ``index`` at the next site in turn, inject its fault, and wait until
        it has ended at every site (or ``run_timeout_s``, noted as a problem)."""
        self._revive()
        proposer = self.sites[index % len(self.sites)]
        rounds = self.rng.choice((1, 2))
        spec = run_spec(index, rounds, self.cfg)
        answer = proposer.ask("submit", spec=spec)
        if answer is None:
            raise SoakError(f"{proposer.name} did not take run {index}:\n{proposer.tail()}")
        rid = answer["run_id"]
        rec = RunRecord(index, rid, spec["name"], proposer.name, rounds, fault and fault.kind)
        self.records.append(rec)
        t0 = time.monotonic()
        seen_running: dict[str, float] = {}
        while True:
            views = {s.name: (s.runs() or {}).get(rid) for s in self.sites}
            for name, view in views.items():
                if view and view["status"] == "running" and name not in seen_running:
                    seen_running[name] = time.monotonic()
            if time.monotonic() - t0 > self.cfg.run_timeout_s:
                left = {n: v["status"] if v else "unknown" for n, v in views.items()}
                self.problems.append(
                    f"run {index + 1} ({rid}) did not end in {self.cfg.run_timeout_s:g} s: {left}"
                )
                if fault is not None and not fault.done:
                    fault.missed = "the run did not end in time"
                break
            if fault is not None and not fault.done:
                self._maybe_fire(fault, rid, views, t0, seen_running)
                continue  # the views are stale after a fault
            if self._ended(views, fault):
                break
            time.sleep(0.5)
        rec.seconds = round(time.monotonic() - t0, 1)
        rec.hit = fault is not None and fault.fired
        rec.state_bytes = {s.name: tree_bytes(s.state_dir) for s in self.sites}
        shown = " ".join(f"{n}:{(v or {}).get('status', '?')}" for n, v in views.items())
        hit = ""
        if fault is not None:
            where = f" at {fault.site}" if fault.site else ""
            hit = f" [{fault.kind}{where}: {'missed, ' + fault.missed if fault.missed else 'hit'}]"
        self.say(
            f"run {index + 1:>3}/{self.cfg.runs} {rid} by {proposer.name}, {rounds} round(s): "
            f"{shown} in {rec.seconds:.0f} s{hit}"
        )

    def _ended(self, views: dict[str, dict | None], fault: Fault | None) -> bool:
        """Whether the run has ended at every site: final everywhere, or, after the broker
        lost its retained messages, final at every site that heard it."""
        known = [v for v in views.values() if v is not None]
        if not known or any(v["status"] not in FINAL for v in known):
            return False
        if len(known) == len(views):
            return True
        lost = fault is not None and fault.kind in ("broker", "outage")
        return lost and all(s.up for s in self.sites)

    def _revive(self) -> None:
        """A daemon that died without being killed by the soak is a problem: say so with
        its log, and start it again."""
        for site in self.sites:
            if site.proc is not None and site.proc.poll() is not None:
                self.problems.append(
                    f"{site.name}'s daemon exited by itself with {site.proc.returncode}"
                    f"\n{site.tail(1500)}"
                )
                site.start()

    # ------------------------------------------------------------------ faults
    def _maybe_fire(
        self,
        fault: Fault,
        rid: str,
        views: dict[str, dict | None],
        t0: float,
        seen_running: dict[str, float],
    ) -> None:
        now = time.monotonic()
        if fault.kind == "worker":
            view = views.get(fault.site)
            if fault.site not in seen_running:
                if view is not None and view["status"] in FINAL:
                    fault.missed = f"the run was {view['status']} at {fault.site} before it trained"
                time.sleep(0.25)
                return
            if now < seen_running[fault.site] + fault.delay_s:
                time.sleep(0.1)
                return
            self._kill_worker(fault, rid, t0)
            return
        if now < t0 + fault.delay_s:
            time.sleep(0.1)
            return
        fault.at_s = round(now - t0, 2)
        if fault.kind == "daemon":
            self._kill_daemon(fault, rid, views)
        elif fault.kind == "outage":
            self._kill_daemon(fault, rid, views, lambda: self._restart_broker(fault.pause_s))
        elif fault.kind == "serving":
            self._kill_serving(fault)
        else:
            self._kill_broker(fault, views)

    def _kill_worker(self, fault: Fault, rid: str, t0: float) -> None:
        site = self._site(fault.site)
        view = (site.runs() or {}).get(rid)
        if view is None or view["status"] != "running" or "worker pid" not in view["why"]:
            fault.missed = f"the run was {view and view['status']} at {site.name}, no worker"
            return
        pid = int(view["why"].rsplit(" ", 1)[-1])
        fault.at_s, fault.phase, fault.pid = round(time.monotonic() - t0, 2), "running", pid
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            fault.missed = f"worker {pid} had exited"
            return
        fault.fired = True
        wait_for(
            lambda: ((site.runs() or {}).get(rid) or {}).get("status") in FINAL,
            60,
            f"run {rid} to end at {site.name} after its worker {pid} was killed",
            site.tail,
        )

    def _kill_daemon(
        self,
        fault: Fault,
        rid: str,
        views: dict[str, dict | None],
        while_down: Callable[[], None] | None = None,
    ) -> None:
        """SIGKILL the fault's site daemon, run ``while_down``, start it again after
        ``pause_s``; note its children still alive once it is back."""
        site = self._site(fault.site)
        view = views.get(site.name)
        fault.phase = view["status"] if view else "unheard"
        assert site.proc is not None
        fault.pid = site.proc.pid
        children = site.kill()
        fault.fired = True
        killed = time.monotonic()
        if while_down is not None:
            while_down()
        time.sleep(fault.pause_s)
        site.start()
        fault.back_s = round(time.monotonic() - killed, 2)
        # its children die with it (parent-death signal) or at the next start: note any
        # still alive once the new daemon is up, after a bounded wait
        deadline = time.monotonic() + 15
        while any(alive(c["pid"]) for c in children) and time.monotonic() < deadline:
            time.sleep(0.25)
        fault.survivors = [c for c in children if alive(c["pid"])]

    def _kill_serving(self, fault: Fault) -> None:
        site = self._site(fault.site)
        pid = site.serving_pid()
        if pid is None:
            fault.missed = f"{site.name} ran no serving process then"
            return
        fault.pid, fault.phase = pid, "serving"
        os.kill(pid, signal.SIGKILL)
        fault.fired = True
        killed = time.monotonic()
        url = f"http://127.0.0.1:{self.serving_port}/v1/model"
        wait_for(
            lambda: site.serving_pid() not in (None, pid) and http_status(url) in (200, 503),
            120,
            f"{site.name}'s daemon to serve again after its serving process {pid} was killed",
            lambda: site.tail() + "\n" + self._file_tail(site.state_dir / "serving.log"),
        )
        fault.back_s = round(time.monotonic() - killed, 2)

    def _kill_broker(self, fault: Fault, views: dict[str, dict | None]) -> None:
        assert self.broker is not None and self.broker.proc is not None
        phases = sorted({v["status"] for v in views.values() if v})
        fault.phase = ",".join(phases) or "unheard"
        fault.pid = self.broker.proc.pid
        fault.fired = True
        killed = time.monotonic()
        self._restart_broker(fault.pause_s)
        fault.back_s = round(time.monotonic() - killed, 2)

    def _restart_broker(self, pause_s: float) -> None:
        """SIGKILL the broker, start it again on its port ``pause_s`` after every running
        daemon noticed, and wait until they are connected again."""
        assert self.broker is not None and self.broker.proc is not None
        self.broker.proc.kill()
        self.broker.proc.wait(30)
        running = [s for s in self.sites if s.up]
        wait_for(
            lambda: all(not (s.ask("status") or {}).get("connected") for s in running),
            30,
            "every daemon to notice the broker is gone",
        )
        time.sleep(pause_s)
        self.broker.stop()  # closes its log; the port and work directory stay
        self.broker.start(timeout=30)
        for site in running:
            site.wait_connected(60)

    def _site(self, name: str) -> SoakSite:
        return next(s for s in self.sites if s.name == name)

    @staticmethod
    def _file_tail(path: Path, chars: int = 1500) -> str:
        text = path.read_text(errors="replace") if path.is_file() else "(none)"
        return f"--- {path} (end) ---\n{text[-chars:]}"

    # ------------------------------------------------------------------ the end
    def _settle(self) -> None:
        """Wait until no site holds a run that is not final (bounded): a run a site
        rebuilt after a restart may still be ending."""
        self._revive()

        def settled() -> bool:
            for site in self.sites:
                runs = site.runs()
                if runs is None or any(r["status"] not in FINAL for r in runs.values()):
                    return False
            return True

        try:
            wait_for(settled, self.cfg.settle_timeout_s, "every run to be final at every site")
        except SoakError:
            pass  # the checks below name what is not final, from the ledgers

    def _serving_answer(self) -> dict[str, Any]:
        """What the serving site answers at ``GET /v1/model`` (waiting, bounded, for its
        serving process to answer at all)."""
        url = f"http://127.0.0.1:{self.serving_port}/v1/model"
        try:
            wait_for(lambda: http_status(url) in (200, 503), 90, f"{url} to answer")
        except SoakError as exc:
            self.problems.append(str(exc))
            return {"status": None}
        try:
            with urllib.request.urlopen(url, timeout=10) as answer:
                model = json.loads(answer.read()).get("model", {})
                return {"status": answer.status, "run_id": model.get("run_id")}
        except urllib.error.HTTPError as err:
            return {"status": err.code, "run_id": None}

    def _report(
        self, wall_s: float, served: dict[str, Any], exits: dict[str, int | None]
    ) -> dict[str, Any]:
        leftovers = site_processes(self.out)
        for proc in leftovers:  # said below, then ended: the soak leaves nothing running
            try:
                os.kill(proc["pid"], signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        problems = list(self.problems)
        ledgers = {s.name: read_ledger(s.state_dir / "ledger.sqlite") for s in self.sites}
        runs_ids = {r.run_id: r for r in self.records}
        per_site: dict[str, Counter[str]] = {}
        stuck = []
        for site, ledger in ledgers.items():
            counts: Counter[str] = Counter()
            for rid, rec in runs_ids.items():
                entry = ledger.get(rid)
                status = entry["status"] if entry else "unheard"
                rec.status[site] = status
                rec.why[site] = entry["why"] if entry else ""
                counts[status if status in FINAL or status == "unheard" else "stuck"] += 1
                if entry is not None and status not in FINAL:
                    stuck.append({"run_id": rid, "site": site, "status": status})
            per_site[site] = counts
        for s in stuck:
            problems.append(f"run {s['run_id']} is still {s['status']} at {s['site']}")
        for rec in self.records:  # a run no fault hit finishes everywhere
            if not rec.hit and any(v != "finished" for v in rec.status.values()):
                problems.append(
                    f"run {rec.index + 1} ({rec.run_id}), hit by no fault, did not finish "
                    f"everywhere: {rec.status} {rec.why}"
                )
        disagree, no_commit = ledger_agreement(ledgers, list(runs_ids))
        for d in disagree:
            problems.append(f"the ledgers disagree on run {d['run_id']}: {d['commits']}")
        for proc in leftovers:
            problems.append(
                f"left behind after the daemons stopped: pid {proc['pid']} ({proc['kind']}, "
                f"parent {proc['ppid']}): {proc['cmdline']}"
            )
        for f in self.faults:
            for c in f.survivors:
                problems.append(
                    f"{f.site}'s daemon (pid {f.pid}) was killed during run {f.run + 1}: its "
                    f"{c['kind']} process {c['pid']} was still alive after the restart "
                    f"({c['cmdline']})"
                )
        for name, code in exits.items():
            if code not in (0, None):
                problems.append(f"{name}'s daemon exited with {code} when stopped")
        sizes = {}
        for site in self.sites:
            total = tree_bytes(site.state_dir)
            after = [0] + [r.state_bytes.get(site.name, 0) for r in self.records]
            growth = max((b - a for a, b in zip(after, after[1:], strict=False)), default=0)
            sizes[site.name] = {
                "bytes": total,
                "ledger_bytes": sum(tree_bytes(p) for p in site.state_dir.glob("ledger.sqlite*")),
                "runs_bytes": tree_bytes(site.state_dir / "runs"),
                "models_bytes": tree_bytes(site.state_dir / "models"),
                "per_run_bytes": total // max(1, len(self.records)),
                "max_run_growth_bytes": growth,
            }
            if total > self.cfg.max_state_mb * 2**20:
                problems.append(
                    f"{site.name}'s state_dir holds {total / 2**20:.1f} MiB after "
                    f"{len(self.records)} runs, over the bound of {self.cfg.max_state_mb:g} MiB"
                )
            if growth > self.cfg.max_run_mb * 2**20:
                problems.append(
                    f"{site.name}'s state_dir grew by {growth / 2**20:.1f} MiB in one run, "
                    f"over the bound of {self.cfg.max_run_mb:g} MiB"
                )
        fired = Counter(f.kind for f in self.faults if f.fired)
        missed = Counter(f.kind for f in self.faults if f.missed)
        return {
            "config": {**asdict(self.cfg), "out": str(self.out)},
            "broker": self.broker.name if self.broker else None,
            "wall_s": round(wall_s, 1),
            "runs": [asdict(r) for r in self.records],
            "faults": [asdict(f) for f in self.faults],
            "faults_injected": {k: fired[k] for k in FAULTS},
            "faults_missed": {k: missed[k] for k in FAULTS},
            "per_site": {
                s: {k: c[k] for k in (*STATUSES, "stuck", "unheard")} for s, c in per_site.items()
            },
            "stuck": stuck,
            "ledgers_agree": not disagree,
            "disagreements": disagree,
            "no_commit": no_commit,
            "leftovers": leftovers,
            "daemon_exits": exits,
            "daemon_starts": {s.name: s.starts for s in self.sites},
            "state_dir": sizes,
            "serving": served,
            "problems": problems,
        }


# ---------------------------------------------------------------------------- ledgers
def read_ledger(path: Path) -> dict[str, dict[str, Any]]:
    """A site's ledger, read-only (``p2pfl/sites/consent/ledger.py``'s tables): run id → status,
    why, proposer and commits (committer → members)."""
    if not path.is_file():
        return {}
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        runs = {
            rid: {"status": status, "why": why, "proposer": proposer, "commits": {}}
            for rid, status, why, proposer in db.execute(
                "SELECT run_id, status, why, proposer FROM runs"
            )
        }
        for rid, committer, members in db.execute("SELECT run_id, committer, members FROM commits"):
            if rid in runs:
                runs[rid]["commits"][committer] = json.loads(members)
    finally:
        db.close()
    return runs


def ledger_agreement(
    ledgers: dict[str, dict[str, dict[str, Any]]], run_ids: list[str]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the runs whose standing commit, its committer and members, differs between the
    sites that hold one; the sites that hold a run with no commit)."""
    disagree, no_commit = [], []
    for rid in run_ids:
        standing: dict[str, tuple[str, tuple[str, ...]]] = {}
        for site, ledger in ledgers.items():
            entry = ledger.get(rid)
            if entry is None:
                continue
            commits = {c: tuple(m) for c, m in entry["commits"].items()}
            if not commits:
                no_commit.append({"run_id": rid, "site": site, "status": entry["status"]})
                continue
            winner = winning_commit(rid, entry["proposer"], commits)
            standing[site] = (winner, commits[winner])
        if len(set(standing.values())) > 1:
            disagree.append(
                {
                    "run_id": rid,
                    "commits": {
                        s: {"committer": c, "members": list(m)} for s, (c, m) in standing.items()
                    },
                }
            )
    return disagree, no_commit


# ---------------------------------------------------------------------------- the table
def table(report: dict[str, Any]) -> str:
    """The report as the README shows it."""
    cfg = report["config"]
    inj, miss = report["faults_injected"], report["faults_missed"]
    lines = [
        f"runs: {len(report['runs'])} on {cfg['sites']} sites ({report['broker']}), "
        f"seed {cfg['seed']}, wall time {report['wall_s'] / 60:.1f} min",
        "faults injected: "
        + ", ".join(f"{k} {inj[k]}" + (f" (+{miss[k]} missed)" if miss[k] else "") for k in FAULTS),
        "",
        "| site | finished | failed | aborted | cancelled | not final | unheard | state_dir "
        "| per run | most in one run |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for site, counts in report["per_site"].items():
        size = report["state_dir"][site]
        lines.append(
            f"| {site} | {counts['finished']} | {counts['failed']} | {counts['aborted']} | "
            f"{counts['cancelled']} | {counts['stuck']} | {counts['unheard']} | "
            f"{size['bytes'] / 2**20:.2f} MiB | {size['per_run_bytes'] / 2**10:.0f} KiB | "
            f"{size['max_run_growth_bytes'] / 2**10:.0f} KiB |"
        )
    lines += [
        "",
        f"ledgers agree on every run's commit: {'yes' if report['ledgers_agree'] else 'NO'}"
        f" ({len(report['disagreements'])} disagreements)",
        f"processes left behind: {len(report['leftovers'])}",
        f"serving at the end: {report['serving'].get('status')}",
        f"problems: {len(report['problems'])}",
    ]
    lines += [f"  - {p.splitlines()[0]}" for p in report["problems"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sites", type=int, default=3)
    ap.add_argument("--out", default="runs/soak", help="the soak's folder (emptied first)")
    ap.add_argument("--json", default="results/soak_federation.json")
    ap.add_argument("--broker", default="auto", choices=("auto", "mosquitto", "embedded"))
    ap.add_argument("--fault-rate", type=float, default=0.6)
    ap.add_argument("--vote-deadline", type=float, default=4.0)
    ap.add_argument("--startup-timeout", type=float, default=30.0)
    ap.add_argument("--max-state-mb", type=float, default=64.0)
    ap.add_argument("--max-run-mb", type=float, default=4.0)
    args = ap.parse_args(argv)
    cfg = SoakConfig(
        out=Path(args.out),
        runs=args.runs,
        seed=args.seed,
        sites=args.sites,
        broker=args.broker,
        fault_rate=args.fault_rate,
        vote_deadline_s=args.vote_deadline,
        startup_timeout_s=args.startup_timeout,
        max_state_mb=args.max_state_mb,
        max_run_mb=args.max_run_mb,
    )
    report = Soak(cfg, say=lambda s: print(s, flush=True)).run()
    print()
    print(table(report))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")
        print(f"\nwritten: {path}")
    return 0 if not report["problems"] else 1


if __name__ == "__main__":
    sys.exit(main())
