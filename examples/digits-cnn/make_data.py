"""Write scikit-learn's handwritten digits (1,797 images of 8x8 pixels, shipped with the
package: no download) as PNG files, one image folder per node, each node seeing mostly a few
digits (as each device's camera would), plus a folder of images no node holds.

    python make_data.py     # data/<node>/<digit>/<n>.png for n0..n3, and data/holdout/
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits

HERE = Path(__file__).resolve().parent
NODES = ["n0", "n1", "n2", "n3"]
HOLDOUT = 0.15  # share of the images kept out of every node, for `p2pfl predict`
SEED = 3


def main(out: Path = HERE / "data") -> None:
    digits = load_digits()
    rng = np.random.default_rng(SEED)
    order = rng.permutation(len(digits.target))
    n_hold = int(HOLDOUT * len(order))
    holdout, pool = order[:n_hold], order[n_hold:]
    # each node favours 3 digits: 70% of its images come from them
    favourites = {node: [(3 * i + k) % 10 for k in range(3)] for i, node in enumerate(NODES)}
    owner = {}
    for idx in pool:
        label = int(digits.target[idx])
        fans = [n for n in NODES if label in favourites[n]]
        if fans and rng.random() < 0.7:
            owner[idx] = fans[int(rng.integers(len(fans)))]
        else:
            owner[idx] = NODES[int(rng.integers(len(NODES)))]
    for idx in order:
        folder = out / ("holdout" if idx in set(holdout) else owner[idx]) / str(digits.target[idx])
        folder.mkdir(parents=True, exist_ok=True)
        pixels = (digits.images[idx] * (255.0 / 16.0)).round().astype(np.uint8)
        Image.fromarray(pixels, mode="L").save(folder / f"{idx}.png")
    for node in [*NODES, "holdout"]:
        count = sum(1 for _ in (out / node).glob("*/*.png"))
        print(f"{node}: {count} images in {out / node}")


if __name__ == "__main__":
    main()
