#!/usr/bin/env python
"""Start-up share, wall time and memory of a local swarm, by how nodes are packed into
processes.

For each ``--per-process`` value (``1``: one OS process per node; ``auto``: about one
process per core, the launcher's default; or a number), runs ``p2pfl swarm`` on the topology
and measures:

- ``wall_s``: launch to exit of the launcher;
- ``startup_s``: launch until every node has started its first round (the earliest round-1
  start over the nodes' records, ``t - round_s``, taken at its latest: the slowest node);
- ``startup_share``: ``startup_s / wall_s``;
- ``peak_pss_mb``: the peak over time of the summed proportional set size (PSS, shared
  pages split between processes) of every node process, sampled every 0.2 s.

Runs are interleaved (``1, auto, 1, auto, …``) and the table shows medians of
``--repeats``. Writes ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from p2pfl.check.load import load_topology  # noqa: E402
from p2pfl.launch.swarm import auto_per_process, run_swarm  # noqa: E402
from p2pfl.metrics import read_run  # noqa: E402


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc/<pid>/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def _pss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _is_node(pid: int) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return False
    return b"p2pfl.cli node" in cmd


class PssSampler(threading.Thread):
    def __init__(self, period: float = 0.2):
        super().__init__(daemon=True)
        self.period, self.peak, self._halt = period, 0.0, threading.Event()

    def run(self) -> None:
        me = os.getpid()
        while not self._halt.is_set():
            total = sum(_pss_mb(p) for p in _children(me) if _is_node(p))
            self.peak = max(self.peak, total)
            self._halt.wait(self.period)

    def stop(self) -> float:
        self._halt.set()
        self.join()
        return self.peak


def one_run(cfg, per_process: int | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="p2pfl-startup-") as tmp:
        out = Path(tmp) / "run"
        sampler = PssSampler()
        sampler.start()
        t0 = time.time()
        code, summary = run_swarm(
            cfg, out, nodes_per_process=per_process, progress=False, console=Console(quiet=True)
        )
        wall = time.time() - t0
        peak = sampler.stop()
        logs = read_run(out)
        starts = [recs[0]["t"] - recs[0]["round_s"] for recs in logs.values() if recs]
        startup = max(starts) - t0 if starts else float("nan")
        return {
            "exit": code,
            "processes": -(-len(cfg.node_ids) // (per_process or 1)),
            "wall_s": round(wall, 2),
            "startup_s": round(startup, 2),
            "startup_share": round(startup / wall, 3),
            "peak_pss_mb": round(peak, 1),
            "final_acc_mean": summary["final"]["acc_mean"],
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("topology", nargs="?", default="topologies/ring-8.yaml")
    ap.add_argument("--per-process", default="1,auto", help="comma list of K or auto")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], help="topology overrides")
    ap.add_argument("--json", default="results/bench_startup.json")
    args = ap.parse_args()
    cfg = load_topology(args.topology, args.set)
    modes = [None if m == "auto" else int(m) for m in args.per_process.split(",")]
    runs: dict[str, list[dict]] = {str(m or "auto"): [] for m in modes}
    for _ in range(args.repeats):
        for m in modes:  # interleaved
            runs[str(m or "auto")].append(one_run(cfg, m))
    n = len(cfg.node_ids)
    table = Table(
        title=f"{args.topology}: {n} nodes, {cfg.rounds} rounds (median of {args.repeats})"
    )
    for col in (
        "nodes/process",
        "processes",
        "wall s",
        "start-up s",
        "start-up share",
        "peak PSS MB",
    ):
        table.add_column(col, justify="right")
    out = {"topology": args.topology, "overrides": args.set, "nodes": n, "modes": {}}
    for key, rs in runs.items():
        k = auto_per_process(n) if key == "auto" else int(key)
        med = {
            f: statistics.median(r[f] for r in rs)
            for f in ("wall_s", "startup_s", "startup_share", "peak_pss_mb")
        }
        out["modes"][key] = {"nodes_per_process": k, "median": med, "runs": rs}
        table.add_row(
            f"{key} ({k})" if key == "auto" else key,
            str(-(-n // k)),
            f"{med['wall_s']:.1f}",
            f"{med['startup_s']:.1f}",
            f"{100 * med['startup_share']:.0f}%",
            f"{med['peak_pss_mb']:.0f}",
        )
    Console().print(table)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
