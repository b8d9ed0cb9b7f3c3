#!/usr/bin/env python
"""Site daemon benchmark (docs/design.md, "The site daemon"), on one machine and one
Mosquitto:

1. **submit to first round** at ``--sites`` daemons (default 3, 8 and 50): the seconds from
   ``p2pfl submit`` to each site's first round record (the commit included: once every
   member voted, ``--deadline`` s at most), their median and spread (max - min) over the
   sites. With ``--warm-worker`` each daemon starts its warm worker at boot
   (``limits.warm_worker: true``) and is counted ready once it is: the first run then
   starts from a warm process, as a site's later runs do;
   At ``--agreement-sites`` (default 50), where one worker process each (about 560 MiB:
   torch) would not fit the machine, the run is made to abort (``min_accept`` above the
   site count) and the time is from submit to each site's ledger holding the commit
   (``agreement``): the propose, vote and commit path alone;
2. **idle daemon memory**: each daemon's resident memory with no run (before the first
   submit), and whether it holds torch (``libtorch`` mapped);
3. **submit against swarm**: the same run's wall time through ``p2pfl submit`` (submit to
   the last site's end) and through ``p2pfl swarm`` (start to exit) at 3 sites, interleaved,
   ``--repeats`` times.

Prints a table and writes ``--json``: ``first_round`` (per site count: ``median_s``,
``spread_s``, ``max_s``), ``idle_rss_mb`` (median), ``idle_holds_torch``, and ``wall``
(``submit_s``, ``swarm_s``: medians, ``ratio``).

    python scripts/bench_federation.py --sites 3 8 50 --repeats 3 --json results/federation.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pfl.launch.broker import make_broker  # noqa: E402
from p2pfl.sites.daemon.admin_socket import AdminError, call  # noqa: E402

HERE = Path(__file__).resolve().parents[1]
ENDED = {"finished", "failed", "aborted", "cancelled"}
BINDING = {
    "name": "synthetic",
    "partition": "dirichlet(0.5)",
    "num_classes": 4,
    "input_shape": [1, 8, 8],
    "synthetic_train": 1200,
    "synthetic_test": 600,
}


def run_body(name: str, rounds: int, deadline: float, min_accept: int) -> dict:
    return {
        "name": name,
        "rounds": rounds,
        "algorithm": {"name": "uapdfl", "params": {"mu": 0.1, "com": 2}},
        "model": {"name": "cnn"},
        "training": {"epochs": 1, "batch_size": 20, "lr": 0.05},
        "timing": {"round_timeout_s": 60, "startup_timeout_s": 120, "linger_s": 2},
        "edges": {"kind": "random-k", "k": 3} if min_accept > 4 else {"kind": "full"},
        "data": "local",
        "members": "any",
        "quorum": {"min_accept": min_accept},
        "vote_deadline_s": deadline,
    }


def spread(seconds: list[float]) -> dict[str, float]:
    """The median, the spread (max - min) and the max of per-site times."""
    return {
        "median_s": round(statistics.median(seconds), 2),
        "spread_s": round(max(seconds) - min(seconds), 2),
        "max_s": round(max(seconds), 2),
    }


class Federation:
    """``count`` site daemons on ``broker`` under ``root``."""

    def __init__(self, root: Path, count: int, broker: str, warm_worker: bool = False):
        self.root = root
        self.sites = [f"site{i}" for i in range(count)]
        self.procs: dict[str, subprocess.Popen] = {}
        for name in self.sites:
            folder = root / name
            folder.mkdir(parents=True)
            body = {
                "site": name,
                "swarm": f"bench-{root.name}",  # a federation of its own: no old retained runs
                "broker": broker,
                "state_dir": "state",
                "data": {"local": BINDING},
            }
            if warm_worker:  # started with the daemon, not at the site's first vote
                body["limits"] = {"warm_worker": True}
            (folder / "site.yaml").write_text(yaml.safe_dump(body))
        for name in self.sites:
            with open(root / name / "daemon.log", "ab") as log:
                self.procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "p2pfl", "daemon", "--site", str(self.path(name))],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
        deadline = time.monotonic() + 120 + 2 * count
        for name in self.sites:
            while not self._connected(name) or (warm_worker and not self._warm(name)):
                if time.monotonic() > deadline:
                    raise SystemExit(f"{name}'s daemon did not connect (or warm up)")
                time.sleep(0.2)

    def _warm(self, name: str) -> bool:
        return "warm worker ready" in (self.root / name / "daemon.log").read_text(errors="replace")

    def path(self, name: str) -> Path:
        return self.root / name / "site.yaml"

    def state(self, name: str) -> Path:
        return self.root / name / "state"

    def _connected(self, name: str) -> bool:
        if self.procs[name].poll() is not None:
            raise SystemExit(f"{name}'s daemon exited: see {self.root / name / 'daemon.log'}")
        try:
            return bool(call(self.state(name), "status", timeout=5)["connected"])
        except AdminError:
            return False

    def idle_memory(self) -> tuple[list[float], bool]:
        """Each daemon's resident MiB, and whether any maps libtorch."""
        rss, torch = [], False
        for proc in self.procs.values():
            status = Path(f"/proc/{proc.pid}/status").read_text()
            kb = next(
                int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS")
            )
            rss.append(kb / 1024)
            torch |= "libtorch" in Path(f"/proc/{proc.pid}/maps").read_text()
        return rss, torch

    def submit(self, body: dict) -> tuple[str, float]:
        spec = self.root / f"{body['name']}.yaml"
        spec.write_text(yaml.safe_dump(body))
        t0 = time.time()
        subprocess.run(
            [sys.executable, "-m", "p2pfl", "submit", str(spec), "--site", str(self.path("site0"))],
            check=True,
            capture_output=True,
        )
        rid = call(self.state("site0"), "runs")["runs"][-1]["run_id"]
        return rid, t0

    def wait_ended(self, rid: str, timeout: float, allow_abort: bool = False) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            statuses = []
            for name in self.sites:
                runs = {r["run_id"]: r for r in call(self.state(name), "runs")["runs"]}
                statuses.append(runs.get(rid, {}).get("status"))
            if all(s in ENDED for s in statuses):
                bad = [s for s in statuses if s != "finished"]
                if bad and not allow_abort:
                    raise SystemExit(f"run {rid} ended {bad}")
                return time.time()
            time.sleep(0.5)
        raise SystemExit(f"run {rid} did not end in {timeout:g} s")

    def first_rounds(self, rid: str) -> dict[str, float]:
        """Each site's first round record's time."""
        out = {}
        for name in self.sites:
            path = self.state(name) / "runs" / rid / "nodes" / f"{name}.jsonl"
            out[name] = json.loads(path.read_text().splitlines()[0])["t"]
        return out

    def ended_at(self, rid: str) -> dict[str, float]:
        """When each site's ledger moved the run to its final status."""
        import sqlite3

        out = {}
        for name in self.sites:
            db = sqlite3.connect(str(self.state(name) / "ledger.sqlite"))
            try:
                row = db.execute("SELECT updated_at FROM runs WHERE run_id = ?", (rid,)).fetchone()
            finally:
                db.close()
            out[name] = row[0]
        return out

    def close(self) -> None:
        for name in self.sites:
            try:
                call(self.state(name), "drain", timeout=5)
            except AdminError:
                pass
        for proc in self.procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def swarm_wall(root: Path, body: dict, broker: str) -> float:
    """The same run through ``p2pfl swarm``: 3 nodes on the same binding and broker."""
    topo = {
        k: v for k, v in body.items() if k not in ("data", "members", "quorum", "vote_deadline_s")
    }
    topo.update({"name": "bench-swarm", "nodes": 3, "dataset": BINDING})
    root.mkdir(parents=True, exist_ok=True)
    path = root / "swarm.yaml"
    path.write_text(yaml.safe_dump(topo))
    t0 = time.time()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "p2pfl",
            "swarm",
            str(path),
            "--broker",
            broker,
            "--out",
            str(root / "swarm-run"),
            "--no-progress",
        ],
        check=True,
        capture_output=True,
    )
    return time.time() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sites", type=int, nargs="+", default=[3, 8, 50])
    ap.add_argument("--agreement-sites", type=int, nargs="*", default=[50])
    ap.add_argument("--deadline", type=float, default=3.0, help="each run's vote_deadline_s")
    ap.add_argument("--repeats", type=int, default=3, help="submit/swarm pairs at 3 sites")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the submit/swarm run")
    ap.add_argument(
        "--warm-worker",
        action="store_true",
        help="sites start their warm worker with the daemon (limits.warm_worker: true)",
    )
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (its logs)")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="p2pfl-bench-fed-"))
    broker = make_broker("mosquitto", workdir=work / "broker").start()
    result: dict = {"first_round": {}, "deadline_s": args.deadline, "warm_worker": args.warm_worker}
    idle_rss: list[float] = []
    holds_torch = False
    try:
        for count in args.sites:
            fed = Federation(work / f"n{count}", count, broker.address, args.warm_worker)
            try:
                rss, torch = fed.idle_memory()
                idle_rss += rss
                holds_torch |= torch
                rid, t0 = fed.submit(run_body(f"first-{count}", 1, args.deadline, count))
                fed.wait_ended(rid, 600 + 10 * count)
                firsts = [t - t0 for t in fed.first_rounds(rid).values()]
            finally:
                fed.close()
            result["first_round"][str(count)] = spread(firsts)
            print(f"{count} sites: submit to first round {result['first_round'][str(count)]}")
        result["agreement"] = {}
        for count in args.agreement_sites:
            fed = Federation(work / f"a{count}", count, broker.address)
            try:
                rss, torch = fed.idle_memory()
                idle_rss += rss
                holds_torch |= torch
                rid, t0 = fed.submit(run_body(f"agree-{count}", 1, args.deadline, count + 1))
                fed.wait_ended(rid, 300, allow_abort=True)
                done = [t - t0 for t in fed.ended_at(rid).values()]
            finally:
                fed.close()
            result["agreement"][str(count)] = spread(done)
            print(f"{count} sites: submit to commit {result['agreement'][str(count)]}")
        result["idle_rss_mb"] = round(statistics.median(idle_rss), 1)
        result["idle_holds_torch"] = holds_torch
        submit_s, swarm_s = [], []
        fed = Federation(work / "wall", 3, broker.address)
        try:
            for i in range(args.repeats):
                body = run_body(f"wall-{i}", args.rounds, args.deadline, 3)
                rid, t0 = fed.submit(body)
                submit_s.append(fed.wait_ended(rid, 600) - t0)
                swarm_s.append(swarm_wall(work / f"swarm{i}", body, broker.address))
                print(f"repeat {i}: submit {submit_s[-1]:.1f} s, swarm {swarm_s[-1]:.1f} s")
        finally:
            fed.close()
        result["wall"] = {
            "submit_s": round(statistics.median(submit_s), 2),
            "swarm_s": round(statistics.median(swarm_s), 2),
            "ratio": round(
                statistics.median(a / b for a, b in zip(submit_s, swarm_s, strict=True)), 3
            ),
            "runs": {"submit_s": submit_s, "swarm_s": swarm_s},
            "rounds": args.rounds,
        }
    finally:
        broker.stop()
        if args.keep:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print("\n| measure | value |\n|---|---|")
    for count, fr in result["first_round"].items():
        print(
            f"| submit → first round, {count} sites (median / spread) | {fr['median_s']} s / {fr['spread_s']} s |"
        )
    for count, fr in result["agreement"].items():
        print(
            f"| submit → commit heard, {count} sites (median / spread) | "
            f"{fr['median_s']} s / {fr['spread_s']} s |"
        )
    print(f"| idle daemon RSS (median) | {result['idle_rss_mb']} MiB (torch: {holds_torch}) |")
    w = result["wall"]
    print(
        f"| {w['rounds']}-round run, submit / swarm (median) | {w['submit_s']} s / {w['swarm_s']} s (ratio {w['ratio']}) |"
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
