#!/usr/bin/env python
"""Whether a new user's small own data learns at the defaults: scikit-learn's iris cut into
three CSV files (50 rows a node, a quarter held out: about 37 training rows each), the
user's own two-layer MLP in their own module, UA-PDFL, and no ``training:`` section.

Variants, each over ``--seeds``, interleaved:

- ``defaults``: no ``training:`` section (``training.min_steps``, 20 steps a round);
- ``one-epoch``: ``training.epochs: 1`` (one step a round at batch 50: the default before
  ``training.min_steps``);
- ``tuned``: ``training.epochs: 10, batch_size: 16`` (what a user had to find by hand).

The table gives each variant's median over the seeds of the nodes' mean final test
accuracy, and its optimizer steps a round (20 rounds, as the hospitals example).

    python scripts/bench_small_data.py --seeds 0 1 2 --json results/bench_small_data.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS.parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import p2pfl  # noqa: E402
from p2pfl.check.sizes import node_sizes  # noqa: E402
from p2pfl.metrics import write_json  # noqa: E402

NODES = ("lab-a", "lab-b", "lab-c")
MODEL_CODE = '''\
from torch import nn


class IrisMLP(nn.Module):
    """Two linear layers; ``head`` is the personal part (the last nn.Linear)."""

    def __init__(self, num_classes, input_shape, hidden=16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(input_shape[0], hidden), nn.ReLU())
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x):
        return self.head(self.body(x))
'''
VARIANTS: dict[str, dict | None] = {
    "defaults": None,
    "one-epoch": {"epochs": 1},
    "tuned": {"epochs": 10, "batch_size": 16},
}


def write_iris(folder: Path) -> None:
    """Iris shuffled once and cut into one CSV of 50 rows per node (``<node>.csv``)."""
    from sklearn.datasets import load_iris

    iris = load_iris(as_frame=True)
    frame = iris.frame.rename(columns={"target": "species"})
    frame["species"] = [iris.target_names[i] for i in frame["species"]]
    frame = frame.sample(frac=1.0, random_state=0).reset_index(drop=True)
    for i, node in enumerate(NODES):
        frame.iloc[50 * i : 50 * (i + 1)].to_csv(folder / f"{node}.csv", index=False)


def topology(folder: Path, training: dict | None, seed: int) -> dict:
    topo = {
        "name": "iris",
        "seed": seed,
        "rounds": 20,
        "algorithm": {"name": "uapdfl"},
        "dataset": {
            "name": "csv",
            "root": str(folder / "{id}.csv"),
            "partition": "none",
            "label": "species",
            "classes": ["setosa", "versicolor", "virginica"],
            "test_fraction": 0.25,
        },
        "model": {"name": "iris_model:IrisMLP"},
        "nodes": list(NODES),
        "edges": "full",
        "timing": {"linger_s": 5},
    }
    if training is not None:
        topo["training"] = training
    return topo


def one_run(folder: Path, variant: str, seed: int) -> dict:
    topo = topology(folder, VARIANTS[variant], seed)
    steps = sorted({s.steps_per_round for s in node_sizes(p2pfl.load_topology(topo))})
    run = p2pfl.run_swarm(
        topo,
        folder / f"run-{variant}-{seed}",
        nodes_per_process=3,
        quiet=True,
    )
    final = run.final()
    accs = [float(r["test_acc"]) for r in final.values()]
    return {
        "variant": variant,
        "seed": seed,
        "ok": run.ok,
        "acc_mean": round(statistics.fmean(accs), 4),
        "steps_per_round": steps,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--json", default=None, help="write the runs and the table here")
    args = ap.parse_args()
    out = Path(args.json).resolve() if args.json else None  # before the chdir below
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="p2pfl-small-") as tmp:
        folder = Path(tmp)
        write_iris(folder)
        (folder / "iris_model.py").write_text(MODEL_CODE)
        os.chdir(folder)  # the user's module sits beside the topology, as in the README
        sys.path.insert(0, str(folder))
        for seed in args.seeds:
            for variant in VARIANTS:
                runs.append(one_run(folder, variant, seed))
                print(runs[-1], flush=True)
    rows = []
    table = Table(title="iris, 3 nodes x ~37 training rows, UA-PDFL, 20 rounds")
    for col in ("variant", "training", "steps a round", "mean final acc (median)", "runs ok"):
        table.add_column(col)
    for variant, training in VARIANTS.items():
        mine = [r for r in runs if r["variant"] == variant]
        acc = statistics.median(r["acc_mean"] for r in mine)
        steps = sorted({s for r in mine for s in r["steps_per_round"]})
        rows.append({"variant": variant, "training": training, "acc_median": acc, "steps": steps})
        table.add_row(
            variant,
            str(training or "(none)"),
            ", ".join(map(str, steps)),
            f"{acc:.4f}",
            f"{sum(r['ok'] for r in mine)}/{len(mine)}",
        )
    Console().print(table)
    if out is not None:
        write_json(out, {"runs": runs, "table": rows, "seeds": args.seeds})
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
