"""What UA-PDFL decided in finished runs: dropout and ``h``-sharing rates, and how ``Div``
(and the relative divergence ``D``) spread over rounds.

Reads the per-node records of each run directory (``nodes/<id>.jsonl``; the facts UA-PDFL
logs each round under the record's ``method``: ``divergence``, ``relative``, ``drift``,
``h_peers``, and ``dropout``, which the record also has at its top level; an older run's
records have them all at the top level) and prints, per run, one row per round bucket: the
share of node-rounds that took client-wise dropout, the mean number of peers ``h`` was
shared with, the share of drawn peers it was shared with, and the 10th / 50th / 90th
percentiles of ``Div`` and of ``D`` over every (node, drawn peer).

    python scripts/divergence_report.py runs/bench_accuracy/quick/uapdfl/seed0
    python scripts/divergence_report.py runs/bench_accuracy/uapdfl-fmnist-a*/uapdfl/seed* \\
        --buckets 4 --json results/uapdfl-decisions.json
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from p2pfl.metrics import method_facts, read_run, write_json  # noqa: E402


def _quantiles(values: list[float]) -> list[float] | None:
    """10th, 50th and 90th percentiles (inclusive method), None for no values."""
    if not values:
        return None
    if len(values) == 1:
        return [values[0]] * 3
    q = statistics.quantiles(values, n=10, method="inclusive")
    return [q[0], statistics.median(values), q[8]]


def round_stats(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The decisions of one set of node-rounds (records of UA-PDFL rounds)."""
    divs: list[float] = []
    rel: list[float] = []
    drawn = shared = dropouts = 0
    for r in records:
        facts = method_facts(r)  # the record's "method" map (an older run's: its top level)
        d = facts.get("divergence") or {}
        divs += [float(v) for v in d.values()]
        # an infinite D (no drift known yet) is logged as null: it counts as "far"
        rel += [math.inf if v is None else float(v) for v in (facts.get("relative") or {}).values()]
        drawn += len(d)
        shared += len(facts.get("h_peers") or [])
        dropouts += bool(r.get("dropout"))
    n = len(records)
    return {
        "node_rounds": n,
        "dropout_rate": dropouts / n if n else 0.0,
        "h_peers_mean": shared / n if n else 0.0,
        "h_share_of_drawn": shared / drawn if drawn else 0.0,
        "div_q10_50_90": _quantiles(divs),
        "rel_q10_50_90": _quantiles(rel),
    }


def run_report(run_dir: Path, buckets: int) -> dict[str, Any]:
    """Per-bucket and whole-run decision statistics of one run directory."""
    per_node = read_run(run_dir)
    if not per_node:
        raise SystemExit(f"{run_dir}: no node records (nodes/*.jsonl)")
    rounds = max(r["round"] for recs in per_node.values() for r in recs)
    size = max(1, math.ceil(rounds / buckets))
    rows = []
    for lo in range(1, rounds + 1, size):
        hi = min(rounds, lo + size - 1)
        recs = [r for v in per_node.values() for r in v if lo <= r["round"] <= hi]
        rows.append({"rounds": [lo, hi], **round_stats(recs)})
    later = [r for v in per_node.values() for r in v if r["round"] >= 2]
    return {
        "run_dir": str(run_dir),
        "rounds": rounds,
        "buckets": rows,
        "rounds_2_on": round_stats(later),
    }


def _fmt_q(q: list[float] | None) -> str:
    if q is None:
        return "—"
    return " / ".join("∞" if math.isinf(v) else f"{v:.3g}" for v in q)


def _finite(obj: Any) -> Any:
    """``obj`` with every infinite float replaced by None."""
    if isinstance(obj, float) and math.isinf(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def render(report: dict[str, Any]) -> Table:
    table = Table(title=f"{report['run_dir']} ({report['rounds']} rounds)")
    for col in ("rounds", "dropout", "h peers", "h / drawn", "Div q10/50/90", "D q10/50/90"):
        table.add_column(col, justify="right")
    rows = [*report["buckets"], {"rounds": ["2", "end"], **report["rounds_2_on"]}]
    for row in rows:
        lo, hi = row["rounds"]
        table.add_row(
            f"{lo}–{hi}",
            f"{row['dropout_rate']:.0%}",
            f"{row['h_peers_mean']:.2f}",
            f"{row['h_share_of_drawn']:.0%}",
            _fmt_q(row["div_q10_50_90"]),
            _fmt_q(row["rel_q10_50_90"]),
        )
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories of UA-PDFL swarms")
    ap.add_argument("--buckets", type=int, default=4, help="round buckets per run (4)")
    ap.add_argument("--json", type=Path, help="write the reports here")
    args = ap.parse_args(argv)
    console = Console()
    reports = [run_report(run, max(1, args.buckets)) for run in args.runs]
    for report in reports:
        console.print(render(report))
    if args.json:  # JSON has no infinity: an infinite D is written as null
        write_json(args.json, _finite(reports))
        console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
