#!/usr/bin/env python
"""Scale on one machine: wall time, round time, memory and bytes of a local swarm of 100,
400 and 1,000 nodes (MLP, synthetic data in small shards, ring, 3 rounds, nodes packed
about one process per core).

For each ``--nodes`` size, runs ``p2pfl swarm`` in-process (:func:`run_swarm`) and reports:

- ``wall_s``: launch to exit; ``startup_s``: launch until the slowest node starts round 1;
- ``round_s_median`` / ``round_s_p90``: over every node's records of every round;
- ``peak_pss_mb``: the peak of the summed proportional set size of the node processes
  (sampled every 0.2 s), and ``mb_per_node``: the growth of that peak per added node from
  the previous size (the cost of one node beyond its process's shared torch and model);
- ``mb_per_round``: bytes sent per round by all nodes (both lanes), and ``mqtt_mb_per_round``:
  the part that went through the broker (the rest took the direct lane);
- ``trained_per_round``: how many nodes trained a round (all of them, but under a client
  fraction the drawn members only);
- ``unreachable_verdicts``: "cannot be reached (unreachable)" lines in the nodes' logs, and
  ``failovers``: the failovers the records of centralized members list (both 0 in a run
  with no fault);
- ``broker_out_mb_per_round``: bytes the broker delivered to the nodes per round (what they
  received over MQTT): its fan-out, which grows as ``N²`` when every node hears every
  node's presence and gossip, and as ``N·k`` when it hears its ``k`` neighbours only.

``--method NAME`` runs another method than the topology's (its default knobs, as
``p2pfl swarm --method``); ``--fraction C`` sets a centralized method's client fraction
(``algorithm.params.fraction``): ``--method fedavg --fraction 0.1`` trains a tenth of the
members each round. ``--set`` adds any other override.

Each size runs ``--repeats`` times (sizes interleaved) and its row holds the medians.
Writes ``--json`` and prints a table. Sizes run smallest first; a size that fails (exit
code, or a node that did not finish) is reported as such and the larger ones still run.
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

from bench_startup import PssSampler  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from p2pfl.check.load import load_topology  # noqa: E402
from p2pfl.launch.swarm import auto_per_process, run_swarm  # noqa: E402
from p2pfl.metrics import read_run  # noqa: E402

SHARD = 40  # training examples per node


def scale_overrides(n: int) -> list[str]:
    """The synthetic topology at ``n`` nodes: an MLP on small shards, generous timeouts."""
    return [
        f"nodes={n}",
        "edges=ring",
        "rounds=3",
        "dataset.partition=dirichlet(5.0)",
        "model.name=mlp",
        "model.hidden=32",
        f"dataset.synthetic_train={SHARD * n}",
        f"dataset.synthetic_test={8 * n}",
        "training.batch_size=8",
        "timing.round_timeout_s=120",
        f"timing.startup_timeout_s={max(120, n)}",
        "timing.linger_s=20",
    ]


def method_overrides(method: str | None, fraction: float | None) -> list[str]:
    """``--method`` (the method with its default knobs) and ``--fraction`` as overrides."""
    out = [f"algorithm.name={method}", "algorithm.params={}"] if method else []
    if fraction is not None:
        out.append(f"algorithm.params.fraction={fraction}")
    return out


def one_size(topology: str, n: int, extra: list[str]) -> dict:
    cfg = load_topology(topology, [*scale_overrides(n), *extra])
    with tempfile.TemporaryDirectory(prefix="p2pfl-scale-") as tmp:
        out = Path(tmp) / "run"
        sampler = PssSampler()
        sampler.start()
        t0 = time.time()
        code, summary = run_swarm(cfg, out, progress=False, console=Console(quiet=True))
        wall = time.time() - t0
        peak = sampler.stop()
        logs = read_run(out)
        text = "".join(p.read_text(errors="replace") for p in (out / "logs").glob("*.log"))
    recs = [r for rs in logs.values() for r in rs]
    starts = [rs[0]["t"] - rs[0]["round_s"] for rs in logs.values() if rs]
    round_s = sorted(r["round_s"] for r in recs) or [float("nan")]
    rounds = max((r["round"] for r in recs), default=0) or 1
    sent = sum(r["bytes_sent"] for r in recs)
    direct = sum(r.get("direct_bytes_sent", 0) for r in recs)
    mqtt_in = sum(r["bytes_recv"] - r.get("direct_bytes_recv", 0) for r in recs)
    trained = sum(r.get("train_loss") is not None for r in recs)
    return {
        "nodes": n,
        "method": cfg.algorithm.name,
        "exit": code,
        "nodes_completed": summary["nodes_completed"],
        "processes": -(-n // auto_per_process(n)),
        "wall_s": round(wall, 1),
        "startup_s": round(max(starts) - t0, 1) if starts else None,
        "round_s_median": round(statistics.median(round_s), 2),
        "round_s_p90": round(round_s[int(0.9 * (len(round_s) - 1))], 2),
        "peak_pss_mb": round(peak, 1),
        "mb_per_round": round(sent / rounds / 1e6, 2),
        "mqtt_mb_per_round": round((sent - direct) / rounds / 1e6, 3),
        "broker_out_mb_per_round": round(mqtt_in / rounds / 1e6, 3),
        "trained_per_round": round(trained / rounds, 1),
        # a run with no fault has none of either (docs/wire.md, "Partitions")
        "unreachable_verdicts": text.count("cannot be reached (unreachable)"),
        "failovers": sum(len(r.get("failovers") or []) for r in recs),
        "final_acc_mean": summary["final"]["acc_mean"],
    }


def median_of(runs: list[dict]) -> dict:
    """One size's row from its repeated runs: the median of every measured figure, the
    worst exit code and completion count, and each run's wall time."""
    row = dict(runs[0])
    for key, value in runs[0].items():
        if key in ("nodes", "processes", "method"):
            continue
        values = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
        if isinstance(value, (int, float)) and len(values) == len(runs):
            row[key] = round(statistics.median(values), 3)
    row["exit"] = max(r["exit"] for r in runs)
    row["nodes_completed"] = min(r["nodes_completed"] for r in runs)
    row["runs_wall_s"] = [r["wall_s"] for r in runs]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", default="topologies/synthetic.yaml")
    ap.add_argument("--nodes", default="100,400,1000", help="comma list of swarm sizes")
    ap.add_argument("--repeats", type=int, default=3, help="runs per size (medians reported)")
    ap.add_argument(
        "--method",
        default=None,
        help="run this method instead of the topology's (its default knobs), e.g. fedavg",
    )
    ap.add_argument(
        "--fraction",
        type=float,
        default=None,
        help="a centralized method's client fraction C (algorithm.params.fraction), e.g. 0.1",
    )
    ap.add_argument("--set", action="append", default=[], help="more topology overrides")
    ap.add_argument("--json", type=Path, default=Path("results/bench_scale.json"))
    args = ap.parse_args(argv)
    sizes = sorted(int(x) for x in args.nodes.split(","))
    extra = [*method_overrides(args.method, args.fraction), *args.set]
    method = load_topology(args.topology, extra).algorithm.name
    runs: dict[int, list[dict]] = {n: [] for n in sizes}
    for _ in range(args.repeats):  # sizes interleaved: a noisy minute hits every size alike
        for n in sizes:
            res = one_size(args.topology, n, extra)
            runs[n].append(res)
            Console().print(res)
    results: list[dict] = []
    for n in sizes:
        res = median_of(runs[n])
        if results:
            prev = results[-1]
            res["mb_per_node"] = round(
                (res["peak_pss_mb"] - prev["peak_pss_mb"]) / (n - prev["nodes"]), 2
            )
        results.append(res)
    frac = f", fraction {args.fraction}" if args.fraction is not None else ""
    table = Table(title=f"scale: {method}{frac}, synthetic MLP, ring, 3 rounds, packed processes")
    cols = [
        ("nodes", "nodes"),
        ("processes", "proc"),
        ("nodes_completed", "done"),
        ("wall_s", "wall s"),
        ("startup_s", "start-up s"),
        ("round_s_median", "round s (median)"),
        ("round_s_p90", "round s (p90)"),
        ("peak_pss_mb", "peak PSS MB"),
        ("mb_per_node", "MB/node (marginal)"),
        ("mb_per_round", "MB sent/round"),
        ("trained_per_round", "trained/round"),
        ("mqtt_mb_per_round", "into broker MB/round"),
        ("broker_out_mb_per_round", "out of broker MB/round"),
        ("unreachable_verdicts", "unreachable"),
        ("failovers", "failovers"),
    ]
    for _, head in cols:
        table.add_column(head, justify="right")
    for r in results:
        table.add_row(*(str(r.get(k, "–")) for k, _ in cols))
    Console(width=200).print(table)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "sizes": results,
        "runs": runs,
        "repeats": args.repeats,
        "method": method,
        "fraction": args.fraction,
        "overrides": extra,
    }
    args.json.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
