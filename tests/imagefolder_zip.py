"""A tiny ImageFolder zip for tests of the data loaders and their error reports."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np


def make_imagefolder_zip(path: Path, top: str = "") -> None:
    """A tiny ImageFolder zip (``train/`` and ``test/`` of three classes of 6x5 RGB PNGs,
    optionally under a top folder ``top``, plus a non-image file) at ``path``."""
    from PIL import Image

    rng = np.random.default_rng(0)
    classes = {"cat": 40, "dog": 200, "ant": 120}  # gray levels; sorted order: ant, cat, dog
    with zipfile.ZipFile(path, "w") as zf:
        for split, n in (("train", 4), ("test", 2)):
            for cls, level in classes.items():
                for i in range(n):
                    arr = np.clip(level + rng.integers(-5, 6, size=(6, 5, 3)), 0, 255)
                    img = Image.fromarray(arr.astype(np.uint8), "RGB")
                    buf = zipfile.ZipInfo(f"{top}{split}/{cls}/{i}.png")
                    import io

                    b = io.BytesIO()
                    img.save(b, format="PNG")
                    zf.writestr(buf, b.getvalue())
        zf.writestr(f"{top}train/README.txt", "not an image")
