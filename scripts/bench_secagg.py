#!/usr/bin/env python
"""The cost of secure aggregation (``privacy.secagg``): FedAvg plain vs SecAgg+ at 8, 20 and
50 nodes (MLP on synthetic data in small shards, 3 rounds, nodes packed about one process
per core: :mod:`bench_scale`'s swarm), and at 50 with a sparse SecAgg+ graph
(``--neighbours``, e.g. 10).

Per run: ``mb_per_round`` (every node's records' ``bytes_sent + bytes_recv`` summed, per
round), ``round_s_median`` (over every node's records of every round), ``secagg_s_median``
(the aggregators' protocol time), ``wall_s`` and the final mean accuracy; per size the
overhead ratios secagg / plain of bytes and seconds per round. Both modes use
``defence.rule: mean`` (secure aggregation refuses the robust rules). Each (size, mode)
runs ``--repeats`` times, the row holds the medians. Writes ``--json`` (with
``meta.commands``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_scale import scale_overrides  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from p2pfl.check.load import load_topology  # noqa: E402
from p2pfl.launch.swarm import run_swarm  # noqa: E402
from p2pfl.metrics import read_run  # noqa: E402

BASE = ["algorithm.name=fedavg", "algorithm.params={}", "defence.rule=mean"]


def mode_overrides(mode: str, neighbours: int | None) -> list[str]:
    """``plain``, or ``secagg`` (with SecAgg+ degree ``neighbours``; None: every member)."""
    if mode == "plain":
        return []
    out = ["privacy.secagg=true"]
    if neighbours is not None:
        out.append(f"privacy.secagg_neighbours={neighbours}")
    return out


def one_run(topology: str, n: int, extra: list[str]) -> dict:
    """One swarm of ``n`` nodes; its figures."""
    overrides = [*scale_overrides(n), "timing.linger_s=5", *BASE, *extra]
    cfg = load_topology(topology, overrides)
    with tempfile.TemporaryDirectory(prefix="p2pfl-secagg-") as tmp:
        out = Path(tmp) / "run"
        t0 = time.time()
        code, summary = run_swarm(cfg, out, progress=False, console=Console(quiet=True))
        wall = time.time() - t0
        logs = read_run(out)
    recs = [r for rs in logs.values() for r in rs]
    rounds = max((r["round"] for r in recs), default=0) or 1
    moved = sum(r["bytes_sent"] + r["bytes_recv"] for r in recs)
    round_s = [r["round_s"] for r in recs] or [float("nan")]
    secagg_s = [
        r["secagg"]["secagg_s"]
        for r in recs
        if isinstance(r.get("secagg"), dict) and "secagg_s" in r["secagg"]
    ]
    dropped = [
        len(r["secagg"].get("dropped", [])) for r in recs if isinstance(r.get("secagg"), dict)
    ]
    return {
        "nodes": n,
        "exit": code,
        "nodes_completed": summary["nodes_completed"],
        "rounds": rounds,
        "wall_s": round(wall, 1),
        "round_s_median": round(statistics.median(round_s), 3),
        "mb_per_round": round(moved / rounds / 1e6, 3),
        "secagg_s_median": round(statistics.median(secagg_s), 3) if secagg_s else None,
        "secagg_dropped": sum(dropped),
        "final_acc_mean": summary["final"]["acc_mean"],
    }


def median_row(runs: list[dict]) -> dict:
    row = dict(runs[0])
    for key, value in runs[0].items():
        values = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
        if key != "nodes" and isinstance(value, (int, float)) and len(values) == len(runs):
            row[key] = round(statistics.median(values), 3)
    row["exit"] = max(r["exit"] for r in runs)
    row["nodes_completed"] = min(r["nodes_completed"] for r in runs)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", default="topologies/synthetic.yaml")
    ap.add_argument("--nodes", default="8,20,50", help="comma list of swarm sizes")
    ap.add_argument(
        "--neighbours",
        type=int,
        default=10,
        help="also run the largest size with this SecAgg+ degree k (0: do not)",
    )
    ap.add_argument("--repeats", type=int, default=1, help="runs per (size, mode)")
    ap.add_argument("--set", action="append", default=[], help="more topology overrides")
    ap.add_argument("--json", type=Path, default=Path("results/bench_secagg.json"))
    args = ap.parse_args(argv)
    sizes = sorted(int(x) for x in args.nodes.split(","))
    cases: list[tuple[int, str, int | None]] = []
    for n in sizes:
        cases += [(n, "plain", None), (n, "secagg", None)]
    if args.neighbours:
        cases.append((sizes[-1], "secagg", args.neighbours))
    runs: dict[str, list[dict]] = {}
    for _ in range(args.repeats):
        for n, mode, k in cases:
            res = one_run(args.topology, n, [*mode_overrides(mode, k), *args.set])
            res.update(mode=mode, k=k)
            runs.setdefault(f"{n}/{mode}/{k}", []).append(res)
            Console().print(res)
    rows = [median_row(rs) for rs in runs.values()]
    plain = {r["nodes"]: r for r in rows if r["mode"] == "plain"}
    for r in rows:
        base = plain.get(r["nodes"])
        if r["mode"] == "secagg" and base is not None:
            r["bytes_ratio"] = round(r["mb_per_round"] / base["mb_per_round"], 2)
            r["seconds_ratio"] = round(r["round_s_median"] / base["round_s_median"], 2)
    table = Table(title="secure aggregation: FedAvg, synthetic MLP, 3 rounds, packed processes")
    cols = [
        ("nodes", "nodes"),
        ("mode", "mode"),
        ("k", "k"),
        ("nodes_completed", "done"),
        ("mb_per_round", "MB/round (sent+recv)"),
        ("round_s_median", "round s (median)"),
        ("secagg_s_median", "secagg s (median)"),
        ("bytes_ratio", "bytes ×"),
        ("seconds_ratio", "seconds ×"),
        ("final_acc_mean", "acc"),
        ("wall_s", "wall s"),
    ]
    for _, head in cols:
        table.add_column(head, justify="right")
    for r in rows:
        table.add_row(*(str(r.get(key, "–")) for key, _ in cols))
    Console(width=200).print(table)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "rows": rows,
        "runs": runs,
        "meta": {
            "commands": [" ".join(["python", "scripts/bench_secagg.py", *(argv or sys.argv[1:])])],
            "overrides": [*BASE, *args.set],
            "repeats": args.repeats,
            "note": "bytes: every node's records' bytes_sent + bytes_recv, per round",
        },
    }
    args.json.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
