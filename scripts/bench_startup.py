#!/usr/bin/env python
"""Start-up share, wall time and memory of a local swarm, by how nodes are packed into
processes, and what share of start-up goes to checking the inputs.

For each ``--per-process`` value (``1``: one OS process per node; ``auto``: about one
process per core, the launcher's default; or a number), launches the swarm as ``p2pfl
swarm`` does (:func:`~p2pfl.check.checked.check_topology` with the data and the model, then
:func:`~p2pfl.launch.swarm.run_swarm`, told the config was checked where the code knows
how) and measures:

- ``launch_to_round1_s``: from the launcher's start (before its check) until every node
  has started its first round (the earliest round-1 start over the nodes' records,
  ``t - round_s``, taken at its latest: the slowest node);
- ``check_s``: the checks on that path: the launcher's own (timed), plus a node process's
  (replayed here on its nodes, timed, the data already loaded as the process needs it
  anyway: the process-level check, and the per-node model and method check of a node
  that does not trust the launcher's; processes check side by side, so one counts);
- ``check_share``: ``check_s / launch_to_round1_s``;
- ``wall_s``: launch to exit of the launcher; ``startup_share``: start-up / wall;
- ``peak_pss_mb``: the peak over time of the summed proportional set size (PSS, shared
  pages split between processes) of every node process, sampled every 0.2 s.

``--scale N`` runs bench_scale's swarm of ``N`` nodes instead of the topology (synthetic
MLP, small shards, ring); ``--rounds R`` shortens the run (start-up does not depend on it).
The code measured is the ``p2pfl`` first on ``PYTHONPATH`` (this checkout when unset), so
one script measures two commits: run it with each commit's checkout on ``PYTHONPATH``,
turn by turn. Runs are interleaved (``1, auto, 1, auto, …``) and the table shows medians
of ``--repeats``. Writes ``--json``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

if not os.environ.get("PYTHONPATH"):  # else the p2pfl on PYTHONPATH is the one measured
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proc_memory import descendants, pss_mb  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from p2pfl.check.checked import check_topology  # noqa: E402
from p2pfl.check.load import load_topology  # noqa: E402
from p2pfl.check.preflight import check_model  # noqa: E402
from p2pfl.launch.swarm import auto_per_process, group_ids, run_swarm  # noqa: E402
from p2pfl.learning.node_inputs import check_dataset  # noqa: E402
from p2pfl.metrics import read_run  # noqa: E402


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
            total = sum(pss_mb(p) for p in descendants(me) if _is_node(p))
            self.peak = max(self.peak, total)
            self._halt.wait(self.period)

    def stop(self) -> float:
        self._halt.set()
        self.join()
        return self.peak


# whether this code's node processes trust the launcher's check (run_swarm(checked=...))
TRUSTS_LAUNCHER = "checked" in inspect.signature(run_swarm).parameters


def node_check_s(cfg, source: str, per_process: int | None) -> float:
    """What one node process (its first group of nodes) spends checking, replayed here:
    the process-level check (without the data and model where it trusts the launcher),
    and, where it does not, each node's model and method check as it loads. The data is
    loaded first, untimed: a node process loads it either way."""
    ids = group_ids(cfg.node_ids, max(1, per_process or auto_per_process(len(cfg.node_ids))))[0]
    arrays = check_dataset(cfg.dataset, cfg.seed, source)  # cached for what follows
    t0 = time.perf_counter()
    check_topology(cfg, source, inputs=not TRUSTS_LAUNCHER, node_ids=ids, runs_here=True)
    if not TRUSTS_LAUNCHER:  # each node checked its model and method before building it
        for _ in ids:
            check_model(cfg, arrays.num_classes, tuple(arrays.input_shape), source)
    took = time.perf_counter() - t0
    from p2pfl.learning.data import clear_cache

    clear_cache()
    return took


def one_run(cfg, source: str, per_process: int | None, node_check: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="p2pfl-startup-") as tmp:
        out = Path(tmp) / "run"
        sampler = PssSampler()
        sampler.start()
        t0 = time.time()
        check_topology(cfg, source, runs_here=True, keep_data=False)  # as p2pfl swarm
        launcher_check = time.time() - t0
        trust = {"checked": True} if TRUSTS_LAUNCHER else {}
        code, summary = run_swarm(
            cfg,
            out,
            nodes_per_process=per_process,
            progress=False,
            console=Console(quiet=True),
            **trust,
        )
        wall = time.time() - t0
        peak = sampler.stop()
        logs = read_run(out)
        starts = [recs[0]["t"] - recs[0]["round_s"] for recs in logs.values() if recs]
        startup = max(starts) - t0 if starts else float("nan")
        check = launcher_check + node_check
        return {
            "exit": code,
            "nodes_completed": summary["nodes_completed"],
            "processes": -(
                -len(cfg.node_ids) // (per_process or auto_per_process(len(cfg.node_ids)))
            ),
            "wall_s": round(wall, 2),
            "launch_to_round1_s": round(startup, 2),
            "startup_s": round(startup, 2),
            "launcher_check_s": round(launcher_check, 2),
            "node_check_s": round(node_check, 2),
            "check_s": round(check, 2),
            "check_share": round(check / startup, 3),
            "startup_share": round(startup / wall, 3),
            "peak_pss_mb": round(peak, 1),
            "final_acc_mean": summary["final"]["acc_mean"],
        }


MEDIANS = (
    "wall_s",
    "launch_to_round1_s",
    "startup_s",
    "launcher_check_s",
    "node_check_s",
    "check_s",
    "check_share",
    "startup_share",
    "peak_pss_mb",
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("topology", nargs="?", default="topologies/ring-8.yaml")
    ap.add_argument("--per-process", default="1,auto", help="comma list of K or auto")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scale", type=int, default=None, help="bench_scale's swarm of N nodes")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default: the topology's)")
    ap.add_argument("--data-root", default=None, help="dataset.root")
    ap.add_argument("--label", default=None, help="names the code measured (e.g. a commit)")
    ap.add_argument("--set", action="append", default=[], help="topology overrides")
    ap.add_argument("--json", default="results/bench_startup.json")
    args = ap.parse_args()
    over = list(args.set)
    topology = args.topology
    if args.scale is not None:
        from bench_scale import scale_overrides

        topology = "topologies/synthetic.yaml"
        over = [*scale_overrides(args.scale), *over]
    if args.data_root:
        over.append(f"dataset.root={args.data_root}")
    if args.rounds is not None:
        over.append(f"rounds={args.rounds}")
    cfg = load_topology(topology, over)
    modes = [None if m == "auto" else int(m) for m in args.per_process.split(",")]
    checks = {str(m or "auto"): node_check_s(cfg, topology, m) for m in modes}
    runs: dict[str, list[dict]] = {str(m or "auto"): [] for m in modes}
    for _ in range(args.repeats):
        for m in modes:  # interleaved
            key = str(m or "auto")
            runs[key].append(one_run(cfg, topology, m, checks[key]))
            print(json.dumps({"mode": key, **runs[key][-1]}), flush=True)
    n = len(cfg.node_ids)
    code = args.label or ("trusts the launcher" if TRUSTS_LAUNCHER else "checks again")
    table = Table(
        title=f"{topology}: {n} nodes, {cfg.rounds} rounds, {code} (median of {args.repeats})"
    )
    for col in (
        "nodes/process",
        "processes",
        "wall s",
        "launch→round 1 s",
        "check s",
        "check share",
        "peak PSS MB",
    ):
        table.add_column(col, justify="right")
    out = {
        "topology": topology,
        "overrides": over,
        "nodes": n,
        "code": code,
        "trusts_launcher": TRUSTS_LAUNCHER,
        "repeats": args.repeats,
        "modes": {},
    }
    for key, rs in runs.items():
        k = auto_per_process(n) if key == "auto" else int(key)
        med = {f: statistics.median(r[f] for r in rs) for f in MEDIANS}
        out["modes"][key] = {"nodes_per_process": k, "median": med, "runs": rs}
        table.add_row(
            f"{key} ({k})" if key == "auto" else key,
            str(-(-n // k)),
            f"{med['wall_s']:.1f}",
            f"{med['launch_to_round1_s']:.1f}",
            f"{med['check_s']:.2f}",
            f"{100 * med['check_share']:.0f}%",
            f"{med['peak_pss_mb']:.0f}",
        )
    Console(width=160).print(table)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
