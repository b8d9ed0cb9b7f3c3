"""What auditing the aggregator costs: a signed centralized swarm with and without
``security.audit``, interleaved, repeated; bytes and seconds per round (docs/design.md,
"Auditing the aggregator").

    python scripts/bench_audit.py --repeats 3 --json results/bench_audit.json
    python scripts/bench_audit.py --topology topologies/ring-8.yaml --data-root ../shared/data \\
        --set dataset.train_per_node=300 --rounds 5 --repeats 2

Per run (over every node's records): the median round time, the bytes all nodes sent per
round, and with the audit the auditor's seconds (``audit.audit_s``: pulling the uploads,
recomputing, announcing) and bytes pulled (``audit.audit_bytes``), and the members' wait
for the verdict. The table gives medians over the repeats and the ratio of audit on / off.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from p2pfl.check.load import load_topology  # noqa: E402
from p2pfl.launch.swarm import run_swarm  # noqa: E402
from p2pfl.metrics import read_records, write_json  # noqa: E402


def run_metrics(records: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per-round costs of one run from its nodes' records."""
    rows = [rec for recs in records.values() for rec in recs]
    rounds = max((rec["round"] for rec in rows), default=0) or 1
    auditor: list[dict[str, Any]] = []  # the audit seen by the round's auditor
    members: list[dict[str, Any]] = []  # ... and by everyone else (their wait)
    verdicts: set[str] = set()
    for nid, recs in records.items():
        for rec in recs:
            audit = rec.get("audit")
            if isinstance(audit, dict):
                verdicts.add(str(audit.get("verdict")))
                (auditor if audit.get("auditor") == nid else members).append(audit)
    return {
        "round_s": statistics.median(rec["round_s"] for rec in rows),
        "bytes_per_round": sum(rec["bytes_sent"] for rec in rows) / rounds,
        "verdicts": sorted(verdicts),
        "auditor_s": statistics.median(a["audit_s"] for a in auditor) if auditor else None,
        "auditor_bytes": statistics.median(a["audit_bytes"] for a in auditor) if auditor else None,
        "member_wait_s": statistics.median(a["audit_s"] for a in members) if members else None,
        "accuracy": statistics.mean(recs[-1]["test_acc"] for recs in records.values()),
    }


def one_run(args: argparse.Namespace, audit: bool, repeat: int, console: Console) -> dict:
    overrides = [
        f"algorithm.name={args.method}",
        "algorithm.params={}",
        f"rounds={args.rounds}",
        "security.sign=true",
        f"security.audit={'true' if audit else 'false'}",
        *([f"nodes={args.nodes}"] if args.nodes else []),
        *([f"dataset.root={args.data_root}"] if args.data_root else []),
        *args.set,
    ]
    cfg = load_topology(args.topology, overrides)
    out = Path(args.out) / f"audit-{'on' if audit else 'off'}" / f"r{repeat}"
    code, _ = run_swarm(
        cfg, out, nodes_per_process=args.nodes_per_process, progress=False, console=console
    )
    if code != 0:
        raise SystemExit(f"swarm exited with {code}: {out}")
    records = {nid: read_records(out / "nodes" / f"{nid}.jsonl") for nid in cfg.node_ids}
    return {"audit": audit, "repeat": repeat, "run_dir": str(out), **run_metrics(records)}


def summarise(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for audit in (False, True):
        mine = [r for r in runs if r["audit"] is audit]
        if not mine:
            continue
        keys = ("round_s", "bytes_per_round", "auditor_s", "auditor_bytes", "member_wait_s")
        out["on" if audit else "off"] = {
            k: statistics.median(v) if (v := [r[k] for r in mine if r[k] is not None]) else None
            for k in keys
        }
    if "on" in out and "off" in out:
        out["ratio"] = {k: out["on"][k] / out["off"][k] for k in ("round_s", "bytes_per_round")}
    return out


def render(summary: dict[str, dict[str, Any]], title: str) -> Table:
    table = Table(title=title)
    for col in (
        "audit",
        "round (median s)",
        "sent / round",
        "auditor s",
        "auditor pulled",
        "members' wait s",
    ):
        table.add_column(col, justify="right")

    def fmt(v: float | None, unit: str = "") -> str:
        if v is None:
            return "–"
        return f"{v / 1e6:.2f} MB" if unit == "MB" else f"{v:.3f}"

    for key in ("off", "on"):
        if key in summary:
            s = summary[key]
            table.add_row(
                key,
                fmt(s["round_s"]),
                fmt(s["bytes_per_round"], "MB"),
                fmt(s["auditor_s"]),
                fmt(s["auditor_bytes"], "MB"),
                fmt(s["member_wait_s"]),
            )
    if "ratio" in summary:
        ratio = summary["ratio"]
        table.add_row(
            "on / off", f"{ratio['round_s']:.2f}x", f"{ratio['bytes_per_round']:.2f}x", "", "", ""
        )
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", default=str(ROOT / "topologies" / "synthetic.yaml"))
    ap.add_argument("--method", default="fedavg")
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data-root")
    ap.add_argument("--set", action="append", default=[], help="more topology overrides")
    ap.add_argument("--nodes-per-process", type=int, default=4)
    ap.add_argument("--out", default="runs/bench_audit")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    console = Console()
    runs = []
    for repeat in range(args.repeats):  # interleaved: off, on, off, on, ...
        for audit in (False, True):
            runs.append(one_run(args, audit, repeat, console))
    summary = summarise(runs)
    title = f"audit cost: {args.method}, {args.nodes} nodes, {args.rounds} rounds, signed"
    console.print(render(summary, title))
    if args.json:
        write_json(
            args.json,
            {
                "command": " ".join(["python", "scripts/bench_audit.py", *(argv or sys.argv[1:])]),
                "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
                "settings": {k: v for k, v in vars(args).items() if k != "json"},
                "runs": runs,
                "summary": summary,
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
