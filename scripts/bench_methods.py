"""Run one topology with several methods through the real swarm and compare them.

Each method runs as ``p2pfl swarm TOPOLOGY --method NAME`` would (private Mosquitto, node
processes) with the topology's other settings unchanged; the table shows the final mean
accuracy over nodes (± std), the best mean over rounds, the wall time and the bytes sent by
all nodes. ``--from-runs`` only tabulates runs already on disk (``<out>/<method>/``).

    python scripts/bench_methods.py topologies/ring-8.yaml --rounds 10 \\
        --json results/methods_ring8.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pfl.check.load import load_topology  # noqa: E402
from p2pfl.launch.swarm import run_swarm  # noqa: E402
from p2pfl.metrics import write_json  # noqa: E402

DEFAULT_METHODS = ["fedavg", "fedper", "criticalfl", "diversifed", "pfedc", "fedsa", "uapdfl"]


def method_row(method: str, summary: dict) -> dict:
    final = summary["final"]
    return {
        "method": method,
        "rounds": summary["rounds_reached"],
        "acc_mean": final["acc_mean"],
        "acc_std": final["acc_std"],
        "best_acc_mean": summary["best_acc_mean"],
        "wall_s": summary["wall_s"],
        "bytes_sent": summary["bytes_sent_total"],
        "nodes_completed": summary["nodes_completed"],
        "nodes": summary["nodes"],
    }


def render(rows: list[dict], title: str) -> Table:
    table = Table(title=title)
    for col in ("method", "rounds", "final acc", "best mean", "wall", "bytes sent", "nodes"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for r in rows:
        table.add_row(
            r["method"],
            str(r["rounds"]),
            f"{r['acc_mean']:.4f} ± {r['acc_std']:.4f}",
            f"{r['best_acc_mean']:.4f}",
            f"{r['wall_s']:.1f} s",
            f"{r['bytes_sent'] / 1e6:.1f} MB",
            f"{r['nodes_completed']}/{r['nodes']}",
        )
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("topology")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--data-root", help="sets dataset.root")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default="runs/bench_methods", help="one run directory per method")
    ap.add_argument("--nodes-per-process", type=int, default=1)
    ap.add_argument("--from-runs", action="store_true", help="tabulate existing runs only")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    console = Console()
    out = Path(args.out)
    rows = []
    for method in [m.strip() for m in args.methods.split(",") if m.strip()]:
        run_dir = out / method
        if args.from_runs:
            summary = json.loads((run_dir / "summary.json").read_text())
        else:
            base = load_topology(args.topology)
            swap = (
                []
                if base.algorithm.name == method
                else [
                    f"algorithm.name={method}",
                    "algorithm.params={}",
                ]
            )
            extra = [*swap, *args.set]
            if args.rounds:
                extra.append(f"rounds={args.rounds}")
            if args.data_root:
                extra.append(f"dataset.root={args.data_root}")
            cfg = load_topology(args.topology, extra)
            code, summary = run_swarm(
                cfg,
                run_dir,
                nodes_per_process=args.nodes_per_process,
                progress=False,
                console=console,
            )
            if code != 0:
                console.print(f"[red]{method}: swarm exited with {code}[/]")
        rows.append(method_row(method, summary))
    console.print(render(rows, f"{args.topology}: methods compared"))
    if args.json:
        write_json(
            Path(args.json),
            {
                "topology": args.topology,
                "overrides": args.set,
                "machine": f"{platform.node()} {platform.machine()}, {platform.processor()}",
                "methods": {r["method"]: r for r in rows},
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
