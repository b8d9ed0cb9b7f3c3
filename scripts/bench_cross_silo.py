#!/usr/bin/env python
"""A real cross-silo benchmark: FLamby's Fed-TCGA-BRCA (six regions' breast-cancer patients,
a Cox model scored by the C-index), through the real swarm, beside FLamby's published table.

The task is the user's own, as ``examples/survival/`` gives it (its ``make_data.py``, its
``cox_model.py``: a ``Linear(39, 1)`` risk score and FLamby's Cox loss, ``label: [event,
time]``, ``evaluation.metrics: [c_index]``). Each method runs once a seed in two settings:

- ``flamby``: FLamby's benchmark settings (``flamby/config_tcga_brca.json``,
  ``flamby/datasets/fed_tcga_brca/common.py`` and ``dataset.py`` at owkin/FLamby
  edacf54): SGD without momentum, learning rate 0.1 (0.01 for its server-optimizer rows),
  batches of 8, 100 optimizer steps a round (``training.steps``), 5 rounds
  (``get_nb_max_rounds(100)``), the raw features (no standardisation: ``dataset.stats``
  of mean 0 and scale 1), FedProx's ``mu`` 0.1;
- ``defaults``: p2pfl's defaults for ``training:`` (SGD, lr 0.05, momentum 0.5, batches of
  50, whole epochs up to 20 steps a round), features standardised by each centre's own
  training rows, 15 rounds.

The mapping of FLamby's rows: FedAvg and FedProx are p2pfl's ``fedavg`` (``mu`` 0 and 0.1);
FedAdam, FedYogi and FedAdagrad are ``fedavg`` with ``server_opt`` (at FLamby's settings with
its knobs: clients at lr 0.01, server lr 0.1, FedAdagrad 1.0, ``beta1`` 0.9, ``beta2`` 0.999,
``tau`` 1e-8; at the defaults, Flower's defaults);
FLamby's "Local i" trains on centre i and is scored on every centre, ours is each centre's
own model on its own test patients (the personalised reading of "Local"); FedPer shares the
risk score's weights and keeps its intercept (``model.personal: [bias]``; Cox's partial
likelihood ignores the intercept, so FedPer is FedAvg here); UA-PDFL takes the same split
(the split is the model's, docs/algorithms.md "Split of every model into g and h": its ``g``,
the weights, is pulled from every drawn peer, its ``h``, the intercept, through the
divergence gate); the row "UA-PDFL (train first)" takes ``order: train_first`` (each round
trains, then merges, and is scored on the merged model, as FedAvg's and FedPer's rounds are
on their aggregate: docs/algorithms.md, "UA-PDFL", the round's cut), the row "UA-PDFL" the
default ``merge_first`` (scored on the model just trained), and the row "UA-PDFL (all
personal)" keeps the whole linear model in ``h`` (``g`` empty: it shares only through the
gate); DisPFL personalises the whole linear
model. Each run reports every centre's final C-index on its own test patients; a method's
figure is their unweighted mean (FLamby's figure: 6 centres) and the mean weighted by test
patients (63, 40, 42, 33, 33, 11), each the mean ± std over seeds.

    python scripts/bench_cross_silo.py --seeds 0,1,2 --json results/bench_cross_silo.json

Each run also counts what the defence refused, clipped and distrusted (every site is honest
here, so each is a false positive).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "survival"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(EXAMPLE))

import make_data  # noqa: E402  (examples/survival/make_data.py)
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from p2pfl.check.load import load_topology  # noqa: E402
from p2pfl.launch.swarm import run_swarm  # noqa: E402
from p2pfl.metrics import read_records  # noqa: E402

CENTRES = [f"centre-{c}" for c in range(6)]
TEST_SIZES = {
    "centre-0": 63,
    "centre-1": 40,
    "centre-2": 42,
    "centre-3": 33,
    "centre-4": 33,
    "centre-5": 11,
}

# FLamby's published C-index (flamby/results/results_benchmark_fed_tcga_brca/tcga_seed{42..46}.csv
# at owkin/FLamby edacf54): the unweighted mean over 6 test centres x 5 seeds (its figure's
# estimator, flamby/results/plot_results.py), and weighted by the centres' test patients
FLAMBY = {
    "FedAvg": (0.732, 0.715),
    "FedProx": (0.729, 0.709),
    "Scaffold": (0.687, 0.671),
    "Cyclic": (0.658, 0.654),
    "FedAdam": (0.815, 0.799),
    "FedYogi": (0.815, 0.799),
    "FedAdagrad": (0.813, 0.796),
    "Pooled": (0.676, 0.695),
}

METHODS = {  # name in the table -> (algorithm, its overrides)
    "Local": ("local", []),
    "FedAvg": ("fedavg", []),
    "FedProx": ("fedavg", ["algorithm.params.mu=0.1"]),
    "FedPer": ("fedper", ["model.personal=[bias]"]),
    "FedAdam": ("fedavg", ["algorithm.params.server_opt=adam"]),
    "FedYogi": ("fedavg", ["algorithm.params.server_opt=yogi"]),
    "FedAdagrad": ("fedavg", ["algorithm.params.server_opt=adagrad"]),
    "UA-PDFL (train first)": (
        "uapdfl",
        ["model.personal=[bias]", "algorithm.params.order=train_first"],
    ),
    "UA-PDFL": ("uapdfl", ["model.personal=[bias]"]),
    "UA-PDFL (all personal)": ("uapdfl", []),
    "DisPFL": ("dispfl", []),
}
SERVER_OPT_FLAMBY = [  # FLamby's server-optimizer rows (config_tcga_brca.json's strategies)
    "training.lr=0.01",
    "algorithm.params.beta1=0.9",
    "algorithm.params.beta2=0.999",
    "algorithm.params.tau=1e-8",
]
SERVER_LR_FLAMBY = {"FedAdam": 0.1, "FedYogi": 0.1, "FedAdagrad": 1.0}

SETTINGS = {
    "flamby": [
        "rounds=5",
        "training.optimizer=sgd",
        "training.momentum=0",
        "training.lr=0.1",
        "training.batch_size=8",
        "training.steps=100",
    ],
    "defaults": ["rounds=15", "training={loss: 'cox_model:cox_loss'}"],
}


def flat_stats(data: Path) -> Path:
    """A ``dataset.stats`` file of mean 0 and scale 1 for every feature: the raw features,
    as FLamby feeds them."""
    import pandas as pd

    features = [
        c for c in pd.read_csv(data / "centre-0-train.csv").columns if c not in ("event", "time")
    ]
    path = data / "raw-stats.json"
    path.write_text(
        json.dumps({"mean": dict.fromkeys(features, 0.0), "std": dict.fromkeys(features, 1.0)})
    )
    return path


def one_run(
    data: Path, setting: str, method: str, seed: int, out: Path, more: list[str] = ()
) -> dict:
    algorithm, extra = METHODS[method]
    flamby: list[str] = []  # FLamby's raw features, and its server optimizers' knobs
    if setting == "flamby":
        flamby.append(f"dataset.stats={data / 'raw-stats.json'}")
        if method in SERVER_LR_FLAMBY:
            server_lr = f"algorithm.params.server_lr={SERVER_LR_FLAMBY[method]}"
            flamby += [*SERVER_OPT_FLAMBY, server_lr]
    overrides = [
        f"seed={seed}",
        f"algorithm.name={algorithm}",
        "algorithm.params={}",
        f"dataset.root={data}/{{id}}-train.csv",
        f"dataset.test_root={data}/{{id}}-test.csv",
        *SETTINGS[setting],
        *extra,
        *flamby,
        *more,
    ]
    cfg = load_topology(EXAMPLE / "topology.yaml", overrides)
    t0 = time.monotonic()
    code, _ = run_swarm(cfg, out, nodes_per_process=6, progress=False, console=Console(quiet=True))
    wall = time.monotonic() - t0
    finals = {}
    # every site is honest here: what the defence refused, clipped or distrusted is a false
    # positive (summed over every node's records: a refusal, a clipping, a distrusted peer)
    refused = clipped = distrusted = 0
    for centre in CENTRES:
        records = read_records(out / "nodes" / f"{centre}.jsonl")
        finals[centre] = records[-1].get("test_c_index") if records else None
        refused += sum(len(r.get("rejected") or {}) for r in records)
        clipped += sum(len(r.get("clipped") or {}) for r in records)
        distrusted += sum(len(r.get("distrusted") or {}) for r in records)
    scored = {c: v for c, v in finals.items() if isinstance(v, (int, float))}
    mean = statistics.fmean(scored.values()) if scored else float("nan")
    weight = sum(TEST_SIZES[c] for c in scored)
    weighted = (
        sum(v * TEST_SIZES[c] for c, v in scored.items()) / weight if weight else float("nan")
    )
    return {
        "exit": code,
        "wall_s": round(wall, 1),
        "c_index": finals,
        "mean": mean,
        "weighted": weighted,
        "refused": refused,
        "clipped": clipped,
        "distrusted": distrusted,
    }


def summarise(runs: list[dict]) -> dict:
    means = [r["mean"] for r in runs]
    weighted = [r["weighted"] for r in runs]
    spread = statistics.pstdev if len(runs) < 2 else statistics.stdev
    return {
        "mean": statistics.fmean(means),
        "mean_std": spread(means) if len(means) > 1 else 0.0,
        "weighted": statistics.fmean(weighted),
        "weighted_std": spread(weighted) if len(weighted) > 1 else 0.0,
        "per_centre": {
            c: statistics.fmean(r["c_index"][c] for r in runs if r["c_index"][c] is not None)
            for c in CENTRES
        },
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--settings", default="flamby,defaults")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument(
        "--source", type=Path, default=make_data.SOURCE, help="FLamby's Fed-TCGA-BRCA files"
    )
    ap.add_argument("--json", type=Path, default=ROOT / "results" / "bench_cross_silo.json")
    ap.add_argument("--set", action="append", default=[], help="more topology overrides")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    settings = args.settings.split(",")
    methods = args.methods.split(",")
    results: dict = {"seeds": seeds, "set": args.set, "flamby_published": FLAMBY, "settings": {}}
    with tempfile.TemporaryDirectory(prefix="p2pfl-cross-silo-") as tmp:
        data = Path(tmp) / "data"
        make_data.main(args.source, data)
        flat_stats(data)
        for setting in settings:
            rows = {}
            for method in methods:
                runs = []
                for seed in seeds:
                    out = Path(tmp) / f"{setting}-{method}-{seed}"
                    res = one_run(data, setting, method, seed, out, args.set)
                    runs.append(res)
                    Console().print(
                        f"{setting} {method} seed {seed}: mean {res['mean']:.3f} "
                        f"weighted {res['weighted']:.3f} refused {res['refused']} "
                        f"clipped {res['clipped']} distrusted {res['distrusted']} "
                        f"exit {res['exit']} ({res['wall_s']} s)"
                    )
                rows[method] = summarise(runs)
            results["settings"][setting] = {"overrides": SETTINGS[setting], "methods": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    for setting, body in results["settings"].items():
        table = Table(title=f"Fed-TCGA-BRCA C-index, {setting} settings, seeds {args.seeds}")
        for col in (
            "method",
            "mean over centres",
            "weighted by test patients",
            "FLamby (mean / weighted)",
        ):
            table.add_column(col, justify="right")
        for method, row in body["methods"].items():
            published = FLAMBY.get(method)
            shown = (
                f"{published[0]:.3f} / {published[1]:.3f}"
                if published and setting == "flamby"
                else ""
            )
            table.add_row(
                method,
                f"{row['mean']:.3f} ± {row['mean_std']:.3f}",
                f"{row['weighted']:.3f} ± {row['weighted_std']:.3f}",
                shown,
            )
        Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
