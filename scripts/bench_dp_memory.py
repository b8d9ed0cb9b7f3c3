"""What a DP-SGD swarm holds in memory: peak PSS per node process and in all, next to a
memory ballast (docs/algorithms.md, "Differential privacy": its paragraph on memory).

    python scripts/bench_dp_memory.py --data-root /work/shared/data --rounds 3 \\
        --label after --json results/bench_dp_memory.json --resume
    # the same swarm on other code (a worktree of an older commit): launcher and nodes run it
    python scripts/bench_dp_memory.py --code /work/base-dp --label before ... --resume
    python scripts/bench_dp_memory.py --from-json results/bench_dp_memory.json   # the table

**The run.** One swarm of ``--suite`` (default ``uapdfl-fmnist-a0.5``: 20 nodes of the
Fashion-MNIST CNN, Dirichlet(0.5), UA-PDFL) under ``privacy.dp: {target_epsilon: ε, delta,
max_grad_norm}`` (``--epsilon`` 8, as ``scripts/bench_privacy.py`` sets it), packed
``--nodes-per-process`` (5) nodes a process, for ``--rounds`` rounds (default: the suite's;
memory peaks in the first rounds, so a few rounds measure it). The swarm runs as ``python -m
p2pfl.cli swarm`` in the folder ``--code`` with ``PYTHONPATH`` set to it, so launcher and
node processes run that folder's code: ``--code`` of another worktree measures its commit
beside this one's.

**The ballast.** Before the swarm starts, a Python process takes ``--ballast-mb`` (1024) of
memory in one ``bytearray`` and writes every page of it, and holds it until the swarm ends:
a 1 GB job beside the swarm, as a shared machine has.

**What is measured.** Every ``--period`` (0.5 s) the PSS (``/proc/<pid>/smaps_rollup``) of
each node process (the launcher's descendants running ``p2pfl.cli node``) and of the
ballast; the table gives each node process's peak, the peak of their sum (one instant), the
peak of the sum with the ballast, and the lowest ``MemAvailable`` of the machine seen. A node
killed (by the kernel's OOM killer or anything else) shows as a node that did not reach the
last round and a swarm that exits non-zero: ``nodes_completed`` and ``exit_code``. Guard: when
``MemAvailable`` falls below ``--guard-mb`` (1000) the bench kills its own node processes
(by pid) and marks the run ``aborted``, so that a swarm that does not fit cannot take the
machine's other work down with it.

Writes ``--json`` (``--resume`` keeps the runs of other labels of an earlier file and its
``meta.notes``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from proc_memory import descendants, pss_mb
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]

BALLAST = (
    "import sys, time\n"
    "n = int(sys.argv[1]) << 20\n"
    "b = bytearray(n)\n"
    "b[::4096] = b'\\x01' * len(range(0, n, 4096))  # every page written: resident\n"
    "print('ready', flush=True)\n"
    "time.sleep(1e9)\n"
)


def node_ids_of(pid: int) -> str | None:
    """``first-last`` of the node ids a ``p2pfl.cli node`` process hosts; None for any
    other process."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    if b"p2pfl.cli" not in argv or b"node" not in argv:
        return None
    ids = [argv[i + 1].decode() for i, a in enumerate(argv[:-1]) if a == b"--id"]
    return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else (ids[0] if ids else str(pid))


def mem_available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Sampler(threading.Thread):
    """Samples the PSS of the node processes under ``root`` and of ``ballast``; kills the
    node processes (its own, by pid) when MemAvailable falls below ``guard_mb``."""

    def __init__(self, root: int, ballast: int, period: float, guard_mb: float):
        super().__init__(daemon=True)
        self.root, self.ballast, self.period, self.guard_mb = root, ballast, period, guard_mb
        self.per_process: dict[str, float] = {}
        self.nodes_peak = self.all_peak = self.ballast_peak = 0.0
        self.min_available = float("inf")
        self.aborted: str | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            nodes = {p: node_ids_of(p) for p in descendants(self.root)}
            nodes = {p: ids for p, ids in nodes.items() if ids is not None}
            sizes = {ids: pss_mb(p) for p, ids in nodes.items()}
            ballast = pss_mb(self.ballast)
            for ids, mb in sizes.items():
                self.per_process[ids] = max(self.per_process.get(ids, 0.0), mb)
            total = sum(sizes.values())
            self.nodes_peak = max(self.nodes_peak, total)
            self.all_peak = max(self.all_peak, total + ballast)
            self.ballast_peak = max(self.ballast_peak, ballast)
            available = mem_available_mb()
            self.min_available = min(self.min_available, available)
            if available < self.guard_mb and self.aborted is None:
                self.aborted = f"MemAvailable {available:.0f} MB < guard {self.guard_mb:.0f} MB"
                for p in nodes:
                    try:
                        os.kill(p, signal.SIGKILL)
                    except OSError:
                        pass
            self._halt.wait(self.period)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def git_commit(code: Path) -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(code), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
        dirty = subprocess.run(
            ["git", "-C", str(code), "status", "--porcelain", "--", "p2pfl"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")  # p2pfl/ changed since
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def suite_overrides(suite: str) -> tuple[str, list[str]]:
    """The topology file and ``set`` overrides of ``suite`` in topologies/suites.yaml."""
    import yaml

    spec = yaml.safe_load((ROOT / "topologies" / "suites.yaml").read_text())[suite]
    return str(ROOT / spec["topology"]), list(spec.get("set", []))


def read_records(out: Path) -> dict[str, list[dict[str, Any]]]:
    """Each node's round records (``nodes/<id>.jsonl``)."""
    recs: dict[str, list[dict[str, Any]]] = {}
    for f in sorted((out / "nodes").glob("*.jsonl")):
        rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        recs[f.stem] = [r for r in rows if "round" in r and "test_acc" in r]
    return recs


def records_digest(recs: dict[str, list[dict[str, Any]]]) -> str:
    """A digest of every node's per-round test accuracy, test loss and training loss: equal
    digests, the same training bit for bit (as far as the records show)."""
    rows = [
        (n, r["round"], r["test_acc"], r["test_loss"], r.get("train_loss"))
        for n, rs in sorted(recs.items())
        for r in rs
    ]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def one_run(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """The swarm next to its ballast, sampled; its row of the table."""
    code = Path(args.code).resolve()
    topology, sets = suite_overrides(args.suite)
    dp = {"target_epsilon": args.epsilon, "delta": args.delta, "max_grad_norm": args.max_grad_norm}
    out = Path(args.out).resolve() / args.label
    cmd = [sys.executable, "-m", "p2pfl.cli", "swarm", topology, "--no-progress"]
    for s in [*sets, f"privacy={json.dumps({'dp': dp})}", *args.set]:
        cmd += ["--set", s]
    cmd += ["--nodes-per-process", str(args.nodes_per_process), "--out", str(out)]
    if args.rounds:
        cmd += ["--rounds", str(args.rounds)]
    if args.data_root:
        cmd += ["--data-root", args.data_root]
    env = {**os.environ, "PYTHONPATH": str(code)}
    ballast = subprocess.Popen(
        [sys.executable, "-c", BALLAST, str(args.ballast_mb)], stdout=subprocess.PIPE, text=True
    )
    assert ballast.stdout is not None
    ballast.stdout.readline()  # "ready": the ballast is resident
    commit = git_commit(code)  # the code as the swarm starts
    console.print(f"[bold]{args.label}[/] ({commit}): {shlex.join(cmd)}")
    t0 = time.time()
    out.parent.mkdir(parents=True, exist_ok=True)
    log = open(out.parent / f"{args.label}.log", "w")  # the swarm's own output
    swarm = subprocess.Popen(cmd, cwd=code, env=env, stdout=log, stderr=subprocess.STDOUT)
    sampler = Sampler(swarm.pid, ballast.pid, args.period, args.guard_mb)
    sampler.start()
    try:
        exit_code = swarm.wait()
    finally:
        sampler.stop()
        ballast.terminate()
        ballast.wait()
        log.close()
    wall = time.time() - t0
    recs = read_records(out)
    rounds = max((r["round"] for rs in recs.values() for r in rs), default=0)
    last = [rs[-1] for rs in recs.values() if rs and rs[-1]["round"] == rounds]
    eps = [r.get("epsilon") for rs in recs.values() for r in rs if r.get("epsilon") is not None]
    return {
        "label": args.label,
        "code": commit,
        "suite": args.suite,
        "epsilon_target": args.epsilon,
        "nodes": len(recs),
        "rounds": rounds,
        "nodes_per_process": args.nodes_per_process,
        "set": args.set,
        "ballast_mb": args.ballast_mb,
        "exit_code": exit_code,
        "aborted": sampler.aborted,
        "nodes_completed": len(last),
        "acc_mean": round(100 * sum(r["test_acc"] for r in last) / len(last), 2) if last else None,
        "epsilon_max": round(max(eps), 4) if eps else None,
        "records_digest": records_digest(recs),
        "peak_pss_mb_per_process": {k: round(v, 1) for k, v in sorted(sampler.per_process.items())},
        "peak_pss_mb_nodes": round(sampler.nodes_peak, 1),
        "peak_pss_mb_with_ballast": round(sampler.all_peak, 1),
        "ballast_pss_mb": round(sampler.ballast_peak, 1),
        "min_mem_available_mb": round(sampler.min_available, 1),
        "wall_s": round(wall, 1),
        "run_dir": str(out),
    }


def render(runs: list[dict[str, Any]]) -> Table:
    procs = sorted({p for r in runs for p in r["peak_pss_mb_per_process"]}, key=_node_order)
    t = Table(title="DP-SGD swarm memory: peak PSS (MB) per node process and in all")
    for col in ["run", "code", "rounds", "exit", "completed", *procs, "nodes", "+ ballast"]:
        t.add_column(col, justify="left" if col in ("run", "code") else "right")
    t.add_column("min avail.", justify="right")
    t.add_column("acc", justify="right")
    t.add_column("wall s", justify="right")
    for r in runs:
        per = r["peak_pss_mb_per_process"]
        t.add_row(
            r["label"],
            r["code"],
            str(r["rounds"]),
            str(r["exit_code"]) + (" (aborted)" if r.get("aborted") else ""),
            f"{r['nodes_completed']}/{r['nodes']}",
            *[f"{per[p]:.0f}" if p in per else "-" for p in procs],
            f"{r['peak_pss_mb_nodes']:.0f}",
            f"{r['peak_pss_mb_with_ballast']:.0f}",
            f"{r['min_mem_available_mb']:.0f}",
            "-" if r["acc_mean"] is None else f"{r['acc_mean']:.2f}",
            f"{r['wall_s']:.0f}",
        )
    return t


def _node_order(ids: str) -> tuple[int, str]:
    head = ids.split("-")[0].lstrip("n")
    return (int(head) if head.isdigit() else 1 << 30, ids)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default="uapdfl-fmnist-a0.5", help="a suite of suites.yaml")
    ap.add_argument("--epsilon", type=float, default=8.0, help="privacy.dp.target_epsilon")
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, help="rounds (default: the suite's)")
    ap.add_argument("--nodes-per-process", type=int, default=5)
    ap.add_argument("--data-root", help="sets dataset.root")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--code", default=str(ROOT), help="the code folder the swarm runs")
    ap.add_argument("--label", default="run", help="the run's name in the table and JSON")
    ap.add_argument("--ballast-mb", type=int, default=1024)
    ap.add_argument("--period", type=float, default=0.5, help="seconds between samples")
    ap.add_argument("--guard-mb", type=float, default=1000.0)
    ap.add_argument("--out", default="runs/bench_dp_memory")
    ap.add_argument("--json", help="result file")
    ap.add_argument("--resume", action="store_true", help="keep --json's runs of other labels")
    ap.add_argument("--from-json", help="only render the table of a result file")
    args = ap.parse_args(argv)
    console = Console(width=200)
    if args.from_json:
        console.print(render(json.loads(Path(args.from_json).read_text())["runs"]))
        return 0
    old: dict[str, Any] = {}
    if args.resume and args.json and Path(args.json).exists():
        old = json.loads(Path(args.json).read_text())
    row = one_run(args, console)
    runs = [r for r in old.get("runs", []) if r["label"] != args.label] + [row]
    console.print(render(runs))
    if args.json:
        meta = dict(old.get("meta", {}))
        meta["commands"] = [*meta.get("commands", []), shlex.join(["python", *sys.argv])]
        meta["machine"] = f"{platform.machine()}, {os.cpu_count()} cores"
        Path(args.json).write_text(json.dumps({"meta": meta, "runs": runs}, indent=2) + "\n")
    ok = row["exit_code"] == 0 and row["nodes_completed"] == row["nodes"] and not row["aborted"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
