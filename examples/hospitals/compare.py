"""Federated against local-only, per hospital: the same three hospitals run three swarms
through p2pfl's Python API (one daemon process per hospital): local-only training
(``local``: no weight leaves a hospital), FedAvg and UA-PDFL. Prints a table and writes
``results.json``.

    python compare.py [--rounds 20]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import p2pfl

HERE = Path(__file__).resolve().parent
METHODS = {"local": "local-only", "fedavg": "FedAvg", "uapdfl": "UA-PDFL"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=None, help="default: the topology's")
    args = parser.parse_args()
    fields = {"rounds": args.rounds} if args.rounds else {}
    results: dict[str, dict[str, float]] = {}
    sizes: dict[str, tuple[int, int]] = {}
    for method, label in METHODS.items():
        run = p2pfl.run_swarm(
            HERE / "topology.yaml",
            HERE / "runs" / method,
            method=method,
            nodes_per_process=1,
            quiet=True,
            **fields,
        )
        if not run.ok:
            print(f"{label}: the swarm failed (exit {run.code}); logs in {run.out_dir}/logs")
            return 1
        for node, last in run.final().items():
            results.setdefault(node, {})[label] = last["test_acc"]
            meta = json.loads((run.out_dir / "nodes" / f"{node}.meta.json").read_text())
            sizes[node] = (meta["n_train"], meta["n_test"])
    header = ["hospital", "train / test", *METHODS.values()]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for node, accs in results.items():
        cells = [f"{accs[label]:.3f}" for label in METHODS.values()]
        print(f"| {node} | {sizes[node][0]} / {sizes[node][1]} | " + " | ".join(cells) + " |")
    means = [sum(a[label] for a in results.values()) / len(results) for label in METHODS.values()]
    print("| mean | | " + " | ".join(f"{m:.3f}" for m in means) + " |")
    (HERE / "results.json").write_text(json.dumps({"accuracy": results, "sizes": sizes}, indent=2))
    print(f"wrote {HERE / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
