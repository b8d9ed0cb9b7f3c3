#!/usr/bin/env python
"""Heterogeneity benchmark: slow devices and slow links, synchronous against asynchronous
rounds, compression off against on, through the real swarm.

Each run is one whole swarm (a private broker, one process per node unless
``--nodes-per-process``) of ``topologies/ring-8.yaml``'s Fashion-MNIST setup with a node
count, a method, a condition, a timing mode and a compression:

- conditions (the topology's ``devices:`` and ``network:`` sections, docs/design.md,
  "Emulated devices and links"):
  ``equal`` (no emulation), ``slow1`` (one device, the first of the sorted ids but one, at
  ``--slow-speed`` 0.1), ``slow30`` (30% of the devices, drawn with the seed, at 0.25),
  ``mixed`` (half the nodes on ``lte``, two on ``wan`` at 150 ms and 5 Mbit/s);
- modes: ``sync`` (today's rounds) and ``async`` (``timing.mode: async`` for decentralized
  methods; ``timing.quorum: --quorum`` for centralized ones);
- compression: ``transfer.compress`` (``none``, ``int8``, ``fp16``).

Per run: ``wall_s`` (the launcher's), each node's span (from its first round's start,
``t − round_s`` of its first record, to its last record's ``t``), ``fast_span_s`` (the
median span over the nodes at full speed), ``rounds`` (median records per node),
``acc_mean`` (the summary's final mean), ``acc_fast`` (over the full-speed nodes),
``bytes`` (all nodes' bytes sent) and ``staleness`` (the mean staleness of the slow nodes'
states as their neighbours recorded them). Runs are written to ``--json`` as they finish; a
run already there is skipped (rerun the same command to resume). ``--repeats`` runs each
setting that many times, interleaved, and the table shows medians.

    python scripts/bench_hetero.py --dry-run
    python scripts/bench_hetero.py --nodes 8 --methods uapdfl --conditions equal,slow1 \\
        --modes sync,async --json results/bench_hetero.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
CONDITIONS = ("equal", "slow1", "slow30", "mixed")


def condition_overrides(condition: str, ids: list[str], slow_speed: float) -> list[str]:
    """The ``--set`` overrides that make ``condition`` on a swarm of ``ids``."""
    if condition == "equal":
        return []
    if condition == "slow1":
        slow = sorted(ids)[1 % len(ids)]
        return [f"devices=[{{nodes: [{slow}], speed: {slow_speed}}}]"]
    if condition == "slow30":
        return ["devices=[{fraction: 0.3, speed: 0.25}]"]
    if condition == "mixed":
        half = sorted(ids)[: len(ids) // 2]
        wan = sorted(ids)[-2:]
        links = (
            f"[{{nodes: [{', '.join(half)}], preset: lte}}, "
            f"{{nodes: [{', '.join(wan)}], preset: wan, latency_ms: 150, bandwidth_mbps: 5}}]"
        )
        return ["network.default=lan", f"network.links={links}"]
    raise ValueError(f"unknown condition {condition!r}")


def run_key(s: dict[str, Any]) -> str:
    return "|".join(
        str(s[k]) for k in ("nodes", "method", "condition", "mode", "compress", "seed", "repeat")
    )


def span(records: list[dict[str, Any]]) -> float:
    """From the first round's start to the last round's record, in seconds."""
    first, last = records[0], records[-1]
    return float(last["t"] - (first["t"] - first.get("round_s", 0.0)))


def summarize_run(cfg, out: Path, summary: dict[str, Any]) -> dict[str, Any]:
    from p2pfl.metrics import read_records
    from p2pfl.services.device import EmulatedDevice

    recs = {n: read_records(out / "nodes" / f"{n}.jsonl") for n in cfg.node_ids}
    slow = {n for n in cfg.node_ids if EmulatedDevice.of(cfg, n).speed < 1.0}
    fast = [n for n in cfg.node_ids if n not in slow and recs[n]]
    spans = {n: span(r) for n, r in recs.items() if r}
    stale = [
        r["staleness"][s]
        for n in fast
        for r in recs[n]
        for s in slow
        if isinstance(r.get("staleness"), dict) and s in r["staleness"]
    ]
    acc_fast = [recs[n][-1]["test_acc"] for n in fast]
    return {
        "wall_s": round(float(summary.get("wall_s", 0.0)), 2),
        "fast_span_s": round(statistics.median(spans[n] for n in fast), 2) if fast else None,
        "max_span_s": round(max(spans.values()), 2) if spans else None,
        "rounds": statistics.median(len(r) for r in recs.values()),
        "acc_mean": round(float(summary["final"]["acc_mean"]), 4),
        "acc_fast": round(statistics.mean(acc_fast), 4) if acc_fast else None,
        "bytes": int(summary.get("bytes_sent_total", 0)),
        "staleness": round(statistics.mean(stale), 2) if stale else None,
        "slow_nodes": sorted(slow),
    }


def build_config(args, setting: dict[str, Any]):
    from p2pfl.algorithms import get_algorithm
    from p2pfl.check.load import load_topology

    centralized = get_algorithm(setting["method"]).kind == "centralized"
    sets = [
        f"nodes={setting['nodes']}",
        f"rounds={args.rounds}",
        f"seed={setting['seed']}",
        f"algorithm.name={setting['method']}",
        f"dataset.root={args.data_root}",
        f"dataset.train_per_node={args.train_per_node}",
        f"transfer.compress={setting['compress']}",
        "timing.linger_s=60",
    ]
    if setting["method"] != "uapdfl":  # UA-PDFL keeps the demo's knobs
        sets.append("algorithm.params={}")
    if setting["mode"] == "async":
        sets.append(f"timing.quorum={args.quorum}" if centralized else "timing.mode=async")
    cfg = load_topology(REPO / "topologies" / "ring-8.yaml", sets)
    extra = condition_overrides(setting["condition"], cfg.node_ids, args.slow_speed)
    return load_topology(REPO / "topologies" / "ring-8.yaml", [*sets, *extra])


def run_one(args, setting: dict[str, Any], console: Console) -> dict[str, Any]:
    from p2pfl.launch.swarm import run_swarm

    cfg = build_config(args, setting)
    out = Path(args.work) / run_key(setting).replace("|", "_")
    t0 = time.monotonic()
    code, summary = run_swarm(
        cfg, out, nodes_per_process=args.nodes_per_process, progress=False, console=console
    )
    row = {**setting, "code": code, "bench_s": round(time.monotonic() - t0, 1)}
    if code == 0:
        row.update(summarize_run(cfg, out, summary))
    return row


def settings(args) -> list[dict[str, Any]]:
    out = []
    for repeat in range(args.repeats):  # interleaved: one of each, then again
        for nodes in args.nodes:
            for method in args.methods:
                for condition in args.conditions:
                    for mode in args.modes:
                        for compress in args.compress:
                            for seed in args.seeds:
                                out.append(
                                    {
                                        "nodes": nodes,
                                        "method": method,
                                        "condition": condition,
                                        "mode": mode,
                                        "compress": compress,
                                        "seed": seed,
                                        "repeat": repeat,
                                    }
                                )
    return out


def table(rows: list[dict[str, Any]]) -> Table:
    """Medians over repeats and seeds, with each setting's fast span against the equal
    condition of the same mode, and the bytes and wall time against no compression."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("code") == 0:
            key = (r["nodes"], r["method"], r["condition"], r["mode"], r["compress"])
            groups.setdefault(key, []).append(r)

    def med(key: tuple, field: str) -> float | None:
        vals = [r[field] for r in groups.get(key, []) if r.get(field) is not None]
        return statistics.median(vals) if vals else None

    t = Table(title="heterogeneity: medians over repeats")
    for col in (
        "nodes",
        "method",
        "condition",
        "mode",
        "compress",
        "runs",
        "wall s",
        "fast span s",
        "× equal",
        "rounds",
        "acc",
        "acc fast",
        "MB sent",
        "bytes ÷",
        "wall ÷",
        "staleness",
    ):
        t.add_column(col, justify="right")
    for key in sorted(groups):
        nodes, method, condition, mode, compress = key
        base = med((nodes, method, "equal", mode, compress), "fast_span_s")
        fs = med(key, "fast_span_s")
        plain = (nodes, method, condition, mode, "none")
        b0, w0 = med(plain, "bytes"), med(plain, "wall_s")
        b, w = med(key, "bytes"), med(key, "wall_s")
        acc_fast, stale = med(key, "acc_fast"), med(key, "staleness")
        t.add_row(
            str(nodes),
            method,
            condition,
            mode,
            compress,
            str(len(groups[key])),
            f"{w:.1f}" if w else "–",
            f"{fs:.1f}" if fs else "–",
            f"{fs / base:.2f}" if fs and base else "–",
            f"{med(key, 'rounds'):.0f}",
            f"{med(key, 'acc_mean'):.4f}",
            f"{acc_fast:.4f}" if acc_fast is not None else "–",
            f"{b / 1e6:.1f}" if b else "–",
            f"{b0 / b:.2f}" if b and b0 and compress != "none" else "–",
            f"{w0 / w:.2f}" if w and w0 and compress != "none" else "–",
            f"{stale:.2f}" if stale is not None else "–",
        )
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    csv = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--nodes", type=lambda s: [int(x) for x in csv(s)], default=[8, 20])
    ap.add_argument("--methods", type=csv, default=["uapdfl", "dfedavgm", "fedavg"])
    ap.add_argument("--conditions", type=csv, default=list(CONDITIONS))
    ap.add_argument("--modes", type=csv, default=["sync", "async"])
    ap.add_argument("--compress", type=csv, default=["none", "int8"])
    ap.add_argument("--seeds", type=lambda s: [int(x) for x in csv(s)], default=[0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--train-per-node", type=int, default=1000)
    ap.add_argument("--slow-speed", type=float, default=0.1)
    ap.add_argument("--quorum", type=float, default=0.7)
    ap.add_argument("--nodes-per-process", type=int, default=1)
    ap.add_argument("--data-root", default=str(REPO.parent / "shared" / "data"))
    ap.add_argument("--work", default="/tmp/bench_hetero")
    ap.add_argument("--json", default=None, help="write (and resume from) this file")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.conditions) - set(CONDITIONS))
    if unknown:
        ap.error(f"--conditions: unknown {unknown}; choose from {', '.join(CONDITIONS)}")
    console = Console(width=200)
    todo = settings(args)
    done: list[dict[str, Any]] = []
    path = Path(args.json) if args.json else None
    commands: list[str] = []  # every command that added runs to the file, in order
    if path is not None and path.exists():
        saved = json.loads(path.read_text())
        done, commands = saved["runs"], list(saved.get("meta", {}).get("commands", []))
    command = " ".join(["python scripts/bench_hetero.py", *(argv or sys.argv[1:])])
    have = {run_key(r) for r in done}
    if args.dry_run:
        for s in todo:
            mark = "done" if run_key(s) in have else "todo"
            console.print(f"{mark}  {run_key(s)}")
        return 0
    for s in todo:
        if run_key(s) in have:
            continue
        console.print(f"[bold]run[/] {run_key(s)}")
        row = run_one(args, s, console)
        console.print(row)
        done.append(row)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            if command not in commands:
                commands.append(command)
            meta = {
                "machine": platform.node(),
                "python": sys.version.split()[0],
                "commands": commands,
            }
            path.write_text(json.dumps({"meta": meta, "runs": done}, indent=1))
    console.print(table(done))
    return 0 if all(r.get("code") == 0 for r in done) else 1


if __name__ == "__main__":
    sys.exit(main())
