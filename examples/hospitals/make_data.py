"""Split scikit-learn's Breast Cancer Wisconsin data (569 patients, 30 features, shipped with
the package: no download) into one CSV file per hospital, of different sizes and class
balance, as three hospitals would each hold their own patients.

    python make_data.py            # writes data/hospital-{a,b,c}.csv and data/new-patients.csv
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from sklearn.datasets import load_breast_cancer

HERE = Path(__file__).resolve().parent
# share of the patients each hospital holds, and the share of malignant cases among them
HOSPITALS = {"hospital-a": (0.50, 0.15), "hospital-b": (0.30, 0.45), "hospital-c": (0.12, 0.80)}
SEED = 7


def main(out: Path = HERE / "data") -> None:
    bunch = load_breast_cancer(as_frame=True)
    frame = bunch.frame.rename(columns=lambda c: c.replace(" ", "_"))
    frame["diagnosis"] = [bunch.target_names[t] for t in frame.pop("target")]
    rng = np.random.default_rng(SEED)
    pools = {
        name: list(rng.permutation(frame.index[frame["diagnosis"] == name]))
        for name in ("malignant", "benign")
    }
    total = len(frame)
    out.mkdir(parents=True, exist_ok=True)
    for hospital, (share, malignant) in HOSPITALS.items():
        n = int(share * total)
        n_mal = min(int(round(malignant * n)), len(pools["malignant"]))
        picked = [pools["malignant"].pop() for _ in range(n_mal)]
        picked += [pools["benign"].pop() for _ in range(min(n - n_mal, len(pools["benign"])))]
        part = frame.loc[rng.permutation(picked)]
        part.to_csv(out / f"{hospital}.csv", index=False)
        print(f"{hospital}: {len(part)} patients, {n_mal} malignant -> {out / f'{hospital}.csv'}")
    rest = frame.loc[pools["malignant"] + pools["benign"]]
    rest.to_csv(out / "new-patients.csv", index=False)
    print(f"new-patients: {len(rest)} patients no hospital holds -> {out / 'new-patients.csv'}")


if __name__ == "__main__":
    main()
