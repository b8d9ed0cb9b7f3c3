"""A standing federation on one machine (``./run federation``): a broker (Mosquitto, or the
embedded one where it is missing), three site daemons (``p2pfl daemon --site``) written from
``federation/site.yaml.in``, the README's run (``federation/run.yaml``) submitted through
the first site, and ``p2pfl runs`` shown until the run has ended at every site. The daemons
then drain and stop; their state stays in ``--out`` (default ``runs/federation``).

    python scripts/federation.py [--out DIR] [--sites 3] [--spec federation/run.yaml]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from p2pfl.launch.broker import free_port, make_broker
from p2pfl.sites.daemon.admin_socket import AdminError, call

HERE = Path(__file__).resolve().parents[1]
ENDED = {"finished", "failed", "aborted", "cancelled"}


def write_sites(out: Path, count: int, broker: str) -> list[Path]:
    template = (HERE / "federation" / "site.yaml.in").read_text()
    paths = []
    for i in range(1, count + 1):
        folder = out / f"site{i}"
        folder.mkdir(parents=True, exist_ok=True)
        text = (
            template.replace("@SITE@", f"site{i}")
            .replace("@BROKER@", broker)
            .replace("@LISTEN@", f"127.0.0.1:{free_port()}")
        )
        path = folder / "site.yaml"
        path.write_text(text)
        paths.append(path)
    return paths


def wait_connected(state_dir: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"a site daemon exited with {proc.returncode}: see its daemon.log")
        try:
            if call(state_dir, "status", timeout=5)["connected"]:
                return
        except AdminError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"the daemon of {state_dir} did not connect in {timeout:g} s")


def final_line(state_dir: Path, site: str, run_id: str) -> str:
    """One site's end of the run: its status, why, and its node's last test accuracy."""
    runs = {r["run_id"]: r for r in call(state_dir, "runs")["runs"]}
    run = runs.get(run_id, {})
    line = f"{site}: {run.get('status', 'unknown')}"
    records = state_dir / "runs" / run_id / "nodes" / f"{site}.jsonl"
    rounds = []
    if records.is_file():
        rounds = [json.loads(x) for x in records.read_text().splitlines() if x.strip()]
    accs = [r for r in rounds if isinstance(r.get("test_acc"), (int, float))]
    if accs:
        line += f", accuracy {accs[-1]['test_acc']:.3f} after round {accs[-1].get('round')}"
    if run.get("why"):
        line += f" ({run['why']})"
    return line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/federation")
    ap.add_argument("--sites", type=int, default=3)
    ap.add_argument("--spec", default=str(HERE / "federation" / "run.yaml"))
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    broker = make_broker("auto", workdir=out / "broker", warn=print).start()
    procs: list[tuple[Path, subprocess.Popen]] = []
    try:
        sites = write_sites(out, args.sites, broker.address)
        for path in sites:
            with open(path.parent / "daemon.log", "ab") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "p2pfl", "daemon", "--site", str(path)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            procs.append((path, proc))
        for path, proc in procs:
            wait_connected(path.parent / "state", proc)
        print(f"{len(sites)} site daemons up on broker {broker.address} (state in {out})")
        first = sites[0]
        subprocess.run(
            [sys.executable, "-m", "p2pfl", "submit", args.spec, "--site", str(first)], check=True
        )
        run_id = call(first.parent / "state", "runs")["runs"][-1]["run_id"]
        deadline = time.monotonic() + args.timeout
        shown = ""
        while time.monotonic() < deadline:
            statuses = []
            for path in sites:
                runs = {r["run_id"]: r for r in call(path.parent / "state", "runs")["runs"]}
                statuses.append(runs.get(run_id, {}).get("status", "unknown"))
            now = " ".join(f"{p.parent.name}:{s}" for p, s in zip(sites, statuses, strict=True))
            if now != shown:
                print(f"run {run_id}: {now}", flush=True)  # each site's status, as it moves
                shown = now
            if all(s in ENDED for s in statuses):
                break
            time.sleep(1.0)
        else:
            print(f"run {run_id} did not end in {args.timeout:g} s", file=sys.stderr)
            return 1
        subprocess.run([sys.executable, "-m", "p2pfl", "runs", "--site", str(first)], check=True)
        for path in sites:
            print(final_line(path.parent / "state", path.parent.name, run_id))
        return 0 if all(s == "finished" for s in statuses) else 1
    finally:
        for path, _ in procs:
            try:
                call(path.parent / "state", "drain", timeout=5)
            except AdminError:
                pass
        for _, proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.terminate()
                proc.wait(30)
        broker.stop()


if __name__ == "__main__":
    sys.exit(main())
