"""Paper-reproduction benchmark: every method of a suite through the real swarm.

Each method of ``--suite`` runs as a whole swarm (a private Mosquitto and node processes,
``--nodes-per-process`` allowed) once per seed of ``--seeds``; the table shows the paper's
number, ours (mean ± std over seeds of the suite's metric: the final mean accuracy over
nodes, or the best mean over rounds), the difference, the rounds actually run, wall time and
bytes sent. A row whose runs skipped node-rounds (nodes that fell behind caught up with
their neighbours, so they trained less than set) is flagged ``⚠ N skipped`` in the table and
``load_dependent`` in the result file: its number depends on the machine's load. Suites live in ``topologies/suites.yaml``. ``--rounds`` shortens a run: the
table records the rounds run, so a short run is never presented as the paper's setting.

    python scripts/bench_accuracy.py --suite quick
    python scripts/bench_accuracy.py --suite uapdfl-cnn-cifar10-a0.5 --rounds 20 \\
        --nodes-per-process 10 --seeds 0
    python scripts/bench_accuracy.py --suite quick --set training.device=cuda   # on a GPU
    python scripts/bench_accuracy.py --from-json results/quick.json   # table + plot again

Writes ``--json`` (default ``results/<suite>.json``) and a plot beside it (``.png``):
accuracy vs round and accuracy vs bytes sent, one line per method.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from p2pfl.check.load import load_topology  # noqa: E402
from p2pfl.metrics import write_json  # noqa: E402

SUITES = ROOT / "topologies" / "suites.yaml"


class MethodSpec(BaseModel):
    """One row of a suite. The row's name is the method's, unless ``algorithm`` names the
    method and the row is a labelled variant of it (e.g. other knobs)."""

    model_config = ConfigDict(extra="forbid")
    paper: float | None = None
    algorithm: str | None = None
    note: str = ""
    set: list[str] = Field(default_factory=list)
    rounds_factor: float = Field(1.0, gt=0, le=1)


class Suite(BaseModel):
    model_config = ConfigDict(extra="forbid")
    topology: str
    set: list[str] = Field(default_factory=list)
    metric: Literal["final", "best"] = "final"
    source: str = ""
    note: str = ""
    methods: dict[str, MethodSpec]


def load_suites(path: Path = SUITES) -> tuple[dict[str, Suite], dict[str, list[str]]]:
    """The suites and the named groups of suites; errors name the file and the suite."""
    raw = yaml.safe_load(path.read_text()) or {}
    groups = raw.pop("groups", {}) or {}
    suites = {}
    for name, body in raw.items():
        try:
            suites[name] = Suite.model_validate(body)
        except ValidationError as exc:
            raise SystemExit(f"{path}: suite {name!r}: {exc}") from None
    for group, members in groups.items():
        unknown = [m for m in members if m not in suites]
        if unknown:
            raise SystemExit(f"{path}: group {group!r} names unknown suites {unknown}")
    return suites, groups


def method_overrides(suite: Suite, method: str, spec: MethodSpec, base_method: str) -> list[str]:
    """The overrides of one row: the suite's, a swap to the row's algorithm (with that
    algorithm's default knobs) unless the topology already runs it, then the row's own."""
    algorithm = spec.algorithm or method
    swap = (
        [] if algorithm == base_method else [f"algorithm.name={algorithm}", "algorithm.params={}"]
    )
    return [*suite.set, *swap, *spec.set]


def run_one(
    suite_name: str,
    suite: Suite,
    method: str,
    spec: MethodSpec,
    seed: int,
    args: argparse.Namespace,
    console: Console,
) -> dict[str, Any]:
    """One swarm run; returns its summary (with the run directory)."""
    from p2pfl.launch.swarm import run_swarm

    base = load_topology(ROOT / suite.topology, suite.set)
    extra = method_overrides(suite, method, spec, base.algorithm.name)
    rounds = args.rounds or base.rounds
    extra += [f"seed={seed}", f"rounds={max(1, round(rounds * spec.rounds_factor))}"]
    if args.data_root:
        extra.append(f"dataset.root={args.data_root}")
    extra += args.set
    cfg = load_topology(ROOT / suite.topology, extra)
    run_dir = Path(args.out) / suite_name / method / f"seed{seed}"
    code, summary = run_swarm(
        cfg, run_dir, nodes_per_process=args.nodes_per_process, progress=False, console=console
    )
    if code != 0:
        console.print(f"[red]{suite_name}/{method}/seed{seed}: swarm exited with {code}[/]")
    return {**summary, "run_dir": str(run_dir), "exit_code": code}


def metric_of(summary: dict[str, Any], metric: str) -> float:
    value = summary["final"]["acc_mean"] if metric == "final" else summary["best_acc_mean"]
    return 100.0 * value


def skipped_of(summary: dict[str, Any]) -> int | None:
    """The node-rounds one run skipped (its summary's ``rounds_skipped`` total: nodes that
    fell behind caught up, or joined late, so they never trained those rounds); None for a
    summary that does not say (an older run's)."""
    skipped = summary.get("rounds_skipped")
    total = skipped.get("total") if isinstance(skipped, dict) else None
    return total if isinstance(total, int) and not isinstance(total, bool) else None


def skip_flag(row: dict[str, Any]) -> str:
    """The table's mark for a row whose runs skipped node-rounds: ``⚠ 196 skipped`` (summed
    over seeds), ``""`` when none did, or when the row's result file predates the count."""
    per_seed = [n for n in row.get("rounds_skipped_per_seed") or [] if n is not None]
    total = sum(per_seed)
    return f"⚠ {total} skipped" if total > 0 else ""


def skip_notes(result: dict[str, Any]) -> list[str]:
    """Caption lines for the rows whose runs skipped node-rounds: such a result depends on
    the machine's load, so it is never shown without saying so."""
    notes = []
    seeds = result.get("seeds") or []
    for name, r in result["methods"].items():
        per_seed = r.get("rounds_skipped_per_seed") or []
        which = [
            f"seed {seeds[i] if i < len(seeds) else i}: {n}"
            for i, n in enumerate(per_seed)
            if n is not None and n > 0
        ]
        if which:
            planned = r.get("nodes", 0) * r.get("rounds", 0)  # node-rounds set per seed
            notes.append(
                f"⚠ {name}: node-rounds skipped under load ({', '.join(which)}"
                f"{f'; of {planned} per seed' if planned else ''}): its result depends on "
                "the machine's load"
            )
    return notes


def method_result(spec: MethodSpec, runs: list[dict[str, Any]], metric: str) -> dict[str, Any]:
    """Mean ± std over seeds of the suite's metric (percent), plus cost and the curves;
    ``rounds_skipped_per_seed`` (each run's skipped node-rounds, :func:`skipped_of`) and
    ``load_dependent`` (True when a run skipped any) flag a result that depends on load."""
    values = [metric_of(r, metric) for r in runs]
    skipped = [skipped_of(r) for r in runs]
    return {
        "paper": spec.paper,
        "algorithm": spec.algorithm,
        "note": spec.note,
        "overrides": spec.set,
        "acc_mean": statistics.fmean(values),
        "acc_std": statistics.pstdev(values) if len(values) > 1 else 0.0,
        "per_seed": values,
        "rounds": min(r["rounds_reached"] for r in runs),
        "wall_s": statistics.fmean(r["wall_s"] for r in runs),
        "bytes_sent": statistics.fmean(r["bytes_sent_total"] for r in runs),
        "nodes_completed": min(r["nodes_completed"] for r in runs),
        "nodes": runs[0]["nodes"],
        "rounds_skipped_per_seed": skipped,
        "load_dependent": any(n for n in skipped if n is not None),
        "curve": runs[0]["curve"],
    }


def merge_results(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One result of a suite from result files whose methods ran separately: the methods in
    the order the suite lists them, the suite's wall time as the longest part's (the parts
    may have run at the same time). Raises ``ValueError`` when the files are of different
    suites, rounds, seeds or metric, or name a method twice."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    for key in ("suite", "rounds", "seeds", "metric"):
        values = {repr(p.get(key)) for p in parts}
        if len(values) > 1:
            raise ValueError(f"cannot merge result files with different {key}: {sorted(values)}")
    methods: dict[str, Any] = {}
    for p in parts:
        for name, r in p["methods"].items():
            if name in methods:
                raise ValueError(f"method {name!r} is in more than one result file")
            methods[name] = r
    try:
        order = list(load_suites()[0][first["suite"]].methods)
    except (KeyError, SystemExit):
        order = []
    ranked = sorted(methods, key=lambda m: order.index(m) if m in order else len(order))
    return {
        **first,
        "wall_s": max(p.get("wall_s", 0.0) for p in parts),
        "merged_from": len(parts),
        "load_dependent": [m for m in ranked if methods[m].get("load_dependent")],
        "methods": {m: methods[m] for m in ranked},
    }


def seed_spread(values: list[float]) -> str:
    """The per-seed values of one row and their range, e.g. ``83.10 84.00 82.70 (Δ 1.30)``."""
    if len(values) < 2:
        return "—"
    return " ".join(f"{v:.2f}" for v in values) + f" (Δ {max(values) - min(values):.2f})"


def render(result: dict[str, Any]) -> Table:
    """The comparison table of one suite's result file."""
    title = (
        f"{result['suite']} ({result['metric']} mean accuracy over nodes, %; "
        f"seeds {result['seeds']}; {result['source']})"
    )
    notes = [result.get("note") or ""]
    notes += [f"{name}: {r['note']}" for name, r in result["methods"].items() if r.get("note")]
    notes += skip_notes(result)
    table = Table(title=title, caption="\n".join(n for n in notes if n) or None)
    cols = ("method", "paper", "ours", "per seed", "diff", "rounds", "wall", "bytes sent", "nodes")
    for col in cols:
        table.add_column(col, justify="left" if col == "method" else "right")
    for name, r in result["methods"].items():
        paper = r["paper"]
        diff = "—" if paper is None else f"{r['acc_mean'] - paper:+.2f}"
        table.add_row(
            name,
            "—" if paper is None else f"{paper:.2f}",
            f"{r['acc_mean']:.2f} ± {r['acc_std']:.2f}",
            seed_spread(r.get("per_seed") or []),
            diff,
            f"{r['rounds']}"
            + ("" if r["rounds"] >= r.get("paper_rounds", 0) else " (short)")
            + (f" {flag}" if (flag := skip_flag(r)) else ""),
            f"{r['wall_s']:.0f} s",
            f"{r['bytes_sent'] / 1e6:.1f} MB",
            f"{r['nodes_completed']}/{r['nodes']}",
        )
    return table


def plot(result: dict[str, Any], path: Path) -> None:
    """Accuracy vs round and accuracy vs cumulative bytes sent, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in result["methods"].items():
        curve = r.get("curve") or []
        if not curve:
            continue
        acc = [100 * c["acc_mean"] for c in curve]
        ax1.plot([c["round"] for c in curve], acc, label=name)
        ax2.plot([c["bytes_sent"] / 1e6 for c in curve], acc, label=name)
    ax1.set(xlabel="round", ylabel="mean accuracy (%)", title=result["suite"])
    ax2.set(xlabel="MB sent (all nodes)", ylabel="mean accuracy (%)")
    ax2.set_xscale("symlog")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_suite(
    name: str,
    suite: Suite,
    args: argparse.Namespace,
    console: Console,
    path: Path | None = None,
) -> dict:
    """Run every (selected) method of a suite; when ``path`` is given, the result file is
    rewritten after each method, so an interrupted benchmark keeps what finished."""
    seeds = [int(s) for s in args.seeds.split(",")]
    base = load_topology(ROOT / suite.topology, suite.set)
    machine = _machine(args, suite.topology, suite.set)
    methods: dict[str, Any] = {}
    t0 = time.monotonic()
    for method, spec in suite.methods.items():
        if args.methods and method not in args.methods.split(","):
            continue
        runs = [run_one(name, suite, method, spec, s, args, console) for s in seeds]
        methods[method] = method_result(spec, runs, suite.metric)
        methods[method]["paper_rounds"] = max(1, round(base.rounds * spec.rounds_factor))
        flag = skip_flag(methods[method])
        console.print(
            f"{name}/{method}: {methods[method]['acc_mean']:.2f} "
            f"(paper {spec.paper}) after {methods[method]['rounds']} rounds"
            + (f" [yellow]{flag} node-rounds: depends on load[/]" if flag else "")
        )
        if path is not None:
            write_json(
                path, _suite_result(name, suite, base.rounds, seeds, args, machine, t0, methods)
            )
    return _suite_result(name, suite, base.rounds, seeds, args, machine, t0, methods)


def _suite_result(
    name: str,
    suite: Suite,
    paper_rounds: int,
    seeds: list[int],
    args: argparse.Namespace,
    machine: str,
    t0: float,
    methods: dict[str, Any],
) -> dict[str, Any]:
    return {
        "suite": name,
        "rounds": args.rounds or paper_rounds,
        "paper_rounds": paper_rounds,
        "seeds": seeds,
        "metric": suite.metric,
        "source": suite.source,
        "note": suite.note,
        "topology": suite.topology,
        "overrides": suite.set,
        "extra_overrides": args.set,
        "machine": machine,
        "wall_s": time.monotonic() - t0,
        # the rows whose runs skipped node-rounds (their results depend on load)
        "load_dependent": [m for m, r in methods.items() if r.get("load_dependent")],
        "methods": dict(methods),
    }


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _machine(args: argparse.Namespace, topology: str, overrides: list[str]) -> str:
    """Where the suite ran: host, cores, and the accelerator when training used one."""
    cfg = load_topology(ROOT / topology, [*overrides, *args.set])
    where = f"{platform.node()}: {platform.machine()}, {_cores()} cores"
    if cfg.training.device.startswith("cuda"):
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "unavailable"
        return f"{where}, training on {cfg.training.device} ({gpu})"
    return f"{where}, training on the CPU"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", help="a suite or group of topologies/suites.yaml")
    ap.add_argument("--rounds", type=int, help="shorten every run to this many rounds")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    ap.add_argument("--methods", help="only these methods of the suite (comma-separated)")
    ap.add_argument("--nodes-per-process", type=int, default=1)
    ap.add_argument("--data-root", help="sets dataset.root")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a topology field for every run (repeatable), e.g. training.device=cuda",
    )
    ap.add_argument("--out", default="runs/bench_accuracy", help="run directories go here")
    ap.add_argument("--json", help="result file (default results/<suite>.json)")
    ap.add_argument(
        "--from-json",
        nargs="+",
        help="only render the table and plot of a result file; several files of one suite "
        "(methods run separately, e.g. in parallel) are merged, and written to --json if given",
    )
    args = ap.parse_args(argv)
    console = Console()
    if args.from_json:
        import json

        parts = [json.loads(Path(p).read_text()) for p in args.from_json]
        try:
            result = merge_results(parts)
        except ValueError as exc:
            ap.error(str(exc))
        out = Path(args.json) if args.json else Path(args.from_json[0])
        if args.json:
            write_json(out, result)
        console.print(render(result))
        plot(result, out.with_suffix(".png"))
        return 0
    suites, groups = load_suites()
    if args.suite not in suites and args.suite not in groups:
        known = ", ".join([*suites, *groups])
        ap.error(f"unknown suite {args.suite!r}; known: {known}")
    names = groups.get(args.suite, [args.suite])
    for name in names:
        path = Path(args.json if args.json and len(names) == 1 else f"results/{name}.json")
        result = run_suite(name, suites[name], args, console, path)
        write_json(path, result)
        plot(result, path.with_suffix(".png"))
        console.print(render(result))
        console.print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
