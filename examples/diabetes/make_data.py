"""Split scikit-learn's diabetes data (442 patients, 10 numeric features and a disease
progression score a year later, shipped with the package: no download) among three clinics,
each with its own training file and its own test file, as three clinics would hold them.
The clinics differ in size: clinic A holds half the patients, B a third, C a sixth.

    python make_data.py        # data/clinic-{a,b,c}-train.csv and data/clinic-{a,b,c}-test.csv
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from sklearn.datasets import load_diabetes

HERE = Path(__file__).resolve().parent
CLINICS = ("clinic-a", "clinic-b", "clinic-c")
SHARES = (1 / 2, 1 / 3, 1 / 6)  # of the patients
SEED = 3


def main(out: Path = HERE / "data") -> None:
    frame = load_diabetes(as_frame=True, scaled=False).frame.rename(
        columns={"target": "progression"}
    )
    rng = np.random.default_rng(SEED)
    order = rng.permutation(len(frame))
    cuts = np.cumsum([int(len(frame) * s) for s in SHARES])[:-1]
    out.mkdir(parents=True, exist_ok=True)
    for clinic, rows in zip(CLINICS, np.split(order, cuts), strict=True):
        test, train = rows[: len(rows) // 4], rows[len(rows) // 4 :]
        frame.iloc[train].to_csv(out / f"{clinic}-train.csv", index=False)
        frame.iloc[test].to_csv(out / f"{clinic}-test.csv", index=False)
        print(f"{clinic}: {len(train)} training and {len(test)} test patients -> {out}")


if __name__ == "__main__":
    main()
