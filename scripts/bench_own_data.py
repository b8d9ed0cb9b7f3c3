#!/usr/bin/env python
"""Start-up time and peak memory of one node on its own data: a 100,000-row CSV file and a
10,000-image folder (Fashion-MNIST written as PNG files), against a 1,000-row CSV file.

Each case runs ``p2pfl swarm`` on a one-node topology (``partition: none``, method
``local``, one round of one epoch) and measures, as ``scripts/bench_startup.py`` does:

- ``startup_s``: launch until the node starts its first round (process, imports, reading
  and normalising its data, building the model, the broker);
- ``peak_pss_mb``: the node process's peak proportional set size, sampled every 0.2 s;
- ``wall_s`` and the node's final test accuracy.

The image folder is decoded once into the cache (``cold``: an empty ``$P2PFL_CACHE``) and
memory-mapped afterwards (``warm``). Cases are interleaved over ``--repeats``; the table
shows medians.

    python scripts/bench_own_data.py --repeats 3 --json results/bench_own_data.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS.parent))
sys.path.insert(0, str(SCRIPTS))

from bench_startup import one_run  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from p2pfl.check.load import topology_from_dict  # noqa: E402
from p2pfl.metrics import write_json  # noqa: E402

FEATURES = 30
DATA_ROOT = SCRIPTS.parent.parent / "shared" / "data"


def write_csv(path: Path, rows: int, seed: int = 0) -> Path:
    """``rows`` rows of ``FEATURES`` float features and a 4-class label that depends on them."""
    import pandas as pd

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    w = rng.normal(size=(FEATURES, 4))
    y = (x @ w + rng.normal(scale=0.5, size=(rows, 4))).argmax(1)
    frame = pd.DataFrame(x, columns=[f"f{i}" for i in range(FEATURES)])
    frame["label"] = y
    frame.to_csv(path, index=False)
    return path


def write_images(folder: Path, count: int) -> Path:
    """``count`` Fashion-MNIST training images as ``<folder>/<class>/<i>.png``."""
    from PIL import Image

    from p2pfl.config.schema import DatasetConfig
    from p2pfl.learning.data import load_arrays

    arrays = load_arrays(DatasetConfig(name="fashionmnist", root=str(DATA_ROOT)), 0)
    for i in range(count):
        img, label = arrays.train_x[i, 0], int(arrays.train_y[i])
        (folder / str(label)).mkdir(parents=True, exist_ok=True)
        Image.fromarray(img, mode="L").save(folder / str(label) / f"{i}.png")
    return folder


def topology(root: Path, dataset: dict) -> object:
    return topology_from_dict(
        {
            "name": "own-data",
            "rounds": 1,
            "algorithm": {"name": "local"},
            "dataset": {"root": str(root), "partition": "none", **dataset},
            "model": {"name": "mlp", "hidden": 64},
            "training": {"epochs": 1, "batch_size": 256},
            "nodes": ["n0"],
            "edges": [],
            "timing": {"linger_s": 0},
        }
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--images", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory(prefix="p2pfl-own-data-") as tmp:
        base = Path(tmp)
        small = write_csv(base / "small.csv", 1_000)
        big = write_csv(base / "big.csv", args.rows)
        images = write_images(base / "images", args.images)
        csv = {"name": "csv", "label": "label", "classes": 4}
        cases = {
            "CSV, 1,000 rows": topology(small, csv),
            f"CSV, {args.rows:,} rows": topology(big, csv),
            f"image folder, {args.images:,} PNG (cold cache)": topology(
                images, {"name": "imagefolder", "classes": [str(c) for c in range(10)]}
            ),
            f"image folder, {args.images:,} PNG (warm cache)": None,
        }
        warm_key = list(cases)[-1]
        cases[warm_key] = cases[list(cases)[-2]]
        runs: dict[str, list[dict]] = {k: [] for k in cases}
        cache = base / "cache"
        os.environ["P2PFL_CACHE"] = str(cache)
        for rep in range(args.repeats):
            for label, cfg in cases.items():
                if "cold" in label:
                    shutil.rmtree(cache, ignore_errors=True)
                result = one_run(cfg, 1)
                runs[label].append(result)
                console.print(f"[{rep + 1}/{args.repeats}] {label}: {result}")
    table = Table(title="one node on its own data (median over repeats)")
    for col in ("data", "start-up", "peak PSS", "wall", "test acc"):
        table.add_column(col)
    rows = {}
    for label, results in runs.items():
        med = {
            k: statistics.median(r[k] for r in results)
            for k in ("startup_s", "peak_pss_mb", "wall_s", "final_acc_mean")
        }
        rows[label] = {"median": med, "runs": results}
        table.add_row(
            label,
            f"{med['startup_s']:.2f} s",
            f"{med['peak_pss_mb']:.0f} MB",
            f"{med['wall_s']:.2f} s",
            f"{med['final_acc_mean']:.4f}",
        )
    console.print(table)
    if args.json:
        write_json(Path(args.json), {"repeats": args.repeats, "cases": rows})
        console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
