#!/usr/bin/env python
"""A site daemon's own boundary, measured (docs/design.md, "Site policy"): three
daemons on one Mosquitto, one small run proposed, and for each daemon

- ``idle_rss_mib``: its resident memory before any proposal;
- ``vote_s``: the seconds from ``p2pfl submit`` to its vote being in its own ledger (the
  spec checked, the policy decided, the vote published and heard back);
- ``after_rss_mib`` and ``holds_torch``: its memory once the run has ended at every site,
  and whether torch is mapped into it (``/proc/PID/maps``);

and for ``p2pfl submit`` itself its wall time and peak memory (``max_rss_mib``), and for
``p2pfl policy check`` the same. It reads the daemons through ``p2pfl runs --json`` and
their ledgers' admin socket only, so one copy of this script measures any version of p2pfl
(``PYTHONPATH=<other checkout>``).

    python scripts/bench_site_boundary.py --repeats 3 --json results/site_boundary.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from site_fixtures import SYNTHETIC_BINDING  # noqa: E402

from p2pfl.launch.broker import make_broker

try:  # the admin socket's client, where this version keeps it
    from p2pfl.sites.daemon.admin_socket import AdminError, call
except ImportError:  # before the site wing was in rooms
    from p2pfl.sites.admin import AdminError, call  # type: ignore[no-redef]

ENDED = {"finished", "failed", "aborted", "cancelled"}
SITES = ("s1", "s2", "s3")
# smaller than the soak's: a vote and a round, measured, not a long run
BINDING = {**SYNTHETIC_BINDING, "synthetic_train": 300, "synthetic_test": 100}


def spec(name: str) -> dict:
    return {
        "name": name,
        "rounds": 1,
        "algorithm": {"name": "uapdfl", "params": {"mu": 0.1, "com": 2}},
        "model": {"name": "cnn"},
        "training": {"epochs": 1, "batch_size": 20, "lr": 0.05},
        "timing": {"round_timeout_s": 60, "startup_timeout_s": 120, "linger_s": 1},
        "data": "syn",
        "members": "any",
        "quorum": {"min_accept": 3},
        "vote_deadline_s": 20,
    }


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def timed(args: list[str], cwd: Path) -> tuple[float, float, subprocess.CompletedProcess]:
    """(wall s, peak RSS MiB, the result) of ``python -m p2pfl ARGS``, its peak measured
    by ``/usr/bin/time`` (the last line of its stderr)."""
    t0 = time.perf_counter()
    done = subprocess.run(
        ["/usr/bin/time", "-f", "%M", sys.executable, "-m", "p2pfl", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    peak_kib = int(done.stderr.strip().splitlines()[-1])
    return wall, peak_kib / 1024, done


def one(root: Path) -> dict:
    broker = make_broker("mosquitto", workdir=root / "broker").start()
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name in SITES:
            folder = root / name
            folder.mkdir(parents=True)
            body = {
                "site": name,
                "swarm": "bench",
                "broker": broker.address,
                "state_dir": "state",
                "data": {"syn": BINDING},
                "policy": {},
                "promote": {"offer": False},
            }
            (folder / "site.yaml").write_text(yaml.safe_dump(body))
            log = open(folder / "daemon.log", "ab")  # noqa: SIM115 - the child holds it
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "p2pfl", "daemon", "--site", str(folder / "site.yaml")],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
            log.close()
        for name in SITES:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if call(root / name / "state", "status", timeout=5)["connected"]:
                        break
                except AdminError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit(f"{name}'s daemon did not connect")
                time.sleep(0.1)
        idle = {n: rss_mib(p.pid) for n, p in procs.items()}
        run = root / "run.yaml"
        run.write_text(yaml.safe_dump(spec(f"bench{int(time.time())}")))
        site1 = str(root / "s1" / "site.yaml")
        check_s, check_mib, _ = timed(["policy", "check", str(run), "--site", site1], root)
        t0 = time.perf_counter()
        submit_s, submit_mib, done = timed(["submit", str(run), "--site", site1, "--json"], root)
        if done.returncode != 0:
            raise SystemExit(f"submit failed: {done.stderr}")
        rid = json.loads(done.stdout)["run_id"]
        voted: dict[str, float] = {}
        ended: set[str] = set()
        deadline = time.monotonic() + 600
        while len(ended) < len(SITES) and time.monotonic() < deadline:
            for name in SITES:
                runs = {r["run_id"]: r for r in call(root / name / "state", "runs")["runs"]}
                r = runs.get(rid)
                if r is None:
                    continue
                if name not in voted and name in r["votes"]:
                    voted[name] = time.perf_counter() - t0
                if r["status"] in ENDED:
                    ended.add(name)
            time.sleep(0.05)
        after = {n: rss_mib(p.pid) for n, p in procs.items()}
        torch = {n: "libtorch" in Path(f"/proc/{p.pid}/maps").read_text() for n, p in procs.items()}
        return {
            "idle_rss_mib": idle,
            "vote_s": voted,
            "after_rss_mib": after,
            "holds_torch": torch,
            "submit_s": submit_s,
            "submit_max_rss_mib": submit_mib,
            "policy_check_s": check_s,
            "policy_check_max_rss_mib": check_mib,
        }
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        broker.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    results = []
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="p2pfl-boundary-") as tmp:
            results.append(one(Path(tmp)))
        print(f"repeat {i + 1}: {json.dumps(results[-1])}", flush=True)

    def med(key: str) -> float:
        values = []
        for r in results:
            v = r[key]
            values += list(v.values()) if isinstance(v, dict) else [v]
        return round(statistics.median(values), 3)

    summary = {
        "version_from": os.environ.get("PYTHONPATH") or "this checkout",
        "repeats": args.repeats,
        "idle_rss_mib": med("idle_rss_mib"),
        "vote_s": med("vote_s"),
        "after_rss_mib": med("after_rss_mib"),
        "holds_torch_after": any(any(r["holds_torch"].values()) for r in results),
        "submit_s": med("submit_s"),
        "submit_max_rss_mib": med("submit_max_rss_mib"),
        "policy_check_s": med("policy_check_s"),
        "policy_check_max_rss_mib": med("policy_check_max_rss_mib"),
        "runs": results,
    }
    print("| measure (median) | value |\n|---|---|")
    for key, value in summary.items():
        if key not in ("runs", "version_from", "repeats"):
            print(f"| {key} | {value} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
