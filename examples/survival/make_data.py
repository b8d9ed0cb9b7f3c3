"""FLamby's Fed-TCGA-BRCA as six hospitals' own files: the 1,088 breast-cancer patients of
``../shared/data/fed-tcga-brca/`` (beside the repository; its README says where it comes
from) split by FLamby's static split into each centre's training and test file, the 39
features, then ``event`` (1: death observed, 0: censored) and ``time`` (days).

    python make_data.py [--source DIR]     # data/centre-{0..5}-train.csv, data/centre-{0..5}-test.csv
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

HERE = Path(__file__).resolve().parent
SOURCE = HERE.parents[2] / "shared" / "data" / "fed-tcga-brca"


def main(source: Path = SOURCE, out: Path = HERE / "data") -> None:
    patients = pd.read_csv(source / "brca.csv")
    split = pd.read_csv(source / "train_test_split.csv")
    *features, event, time = [c for c in patients.columns if c != "pid"]
    table = patients.rename(columns={event: "event", time: "time"}).merge(split, on="pid")
    out.mkdir(parents=True, exist_ok=True)
    for centre in range(6):
        for part in ("train", "test"):
            rows = table[table["fold2"] == f"{part}_{centre}"]
            rows[[*features, "event", "time"]].to_csv(
                out / f"centre-{centre}-{part}.csv", index=False
            )
        print(
            f"centre-{centre}: {(table['fold2'] == f'train_{centre}').sum()} training and "
            f"{(table['fold2'] == f'test_{centre}').sum()} test patients"
        )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, default=SOURCE)
    main(ap.parse_args().source)
