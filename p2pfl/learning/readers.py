"""The built-in benchmark datasets, read whole into :class:`~p2pfl.learning.arrays.DatasetArrays`:
``synthetic``, the torchvision MNIST / Fashion-MNIST / CIFAR-10/100 / SVHN files, and
ImageFolder zips or directories.

Contract: images stay ``uint8`` in ``N x C x H x W`` layout (possibly a read-only memory map
or view), synthetic data is ``float32``; labels are ``int64``. Files are never downloaded
unless asked (``download``); missing files raise ``FileNotFoundError`` naming the dataset and
the root; files that are there but cannot be read raise
:class:`~p2pfl.learning.arrays.DatasetError` naming the file (and the zip member). Derived
files (gunzipped IDX files, decoded image arrays) go to the cache
(:mod:`p2pfl.learning.cache`), written once however many processes ask together.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from p2pfl.config.schema import DatasetConfig
from p2pfl.files import write_atomic, write_bytes_atomic
from p2pfl.learning.arrays import DatasetArrays, DatasetError, readonly
from p2pfl.learning.cache import atomic_save_npy, default_cache_dir, file_lock
from p2pfl.learning.image_layout import IMAGE_EXTENSIONS as IMAGE_EXTENSIONS
from p2pfl.learning.image_layout import Layout as _Layout
from p2pfl.learning.image_layout import image_layout as _imagefolder_layout
from p2pfl.learning.partition import stable_rng

# (mean, std) per channel for (x / 255 - mean) / std
NORMALIZATION: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "mnist": ((0.1307,), (0.3081,)),
    "fashionmnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "svhn": ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
}
SYNTHETIC_NOISE = 1.0  # std of the per-sample gaussian noise around a class prototype


# ----------------------------------------------------------------------------- loaders


def read_synthetic(cfg: DatasetConfig, seed: int) -> DatasetArrays:
    """Class-structured data: a fixed N(0,1) prototype per class plus N(0, 1) noise per sample;
    balanced classes. Deterministic in ``seed`` and the synthetic settings."""
    shape = tuple(int(v) for v in cfg.input_shape)
    c = cfg.num_classes
    rng = stable_rng(seed, "synthetic", c, *shape)
    protos = rng.normal(0.0, 1.0, size=(c, *shape)).astype(np.float32)

    def make(n: int, tag: str) -> tuple[np.ndarray, np.ndarray]:
        r = stable_rng(seed, "synthetic", tag, n)
        y = r.permutation(np.arange(n) % c).astype(np.int64)
        noise = r.normal(0.0, SYNTHETIC_NOISE, size=(n, *shape)).astype(np.float32)
        return protos[y] + noise, y

    tx, ty = make(cfg.synthetic_train, "train")
    vx, vy = make(cfg.synthetic_test, "test")
    return DatasetArrays(
        name="synthetic",
        train_x=readonly(tx),
        train_y=readonly(ty),
        test_x=readonly(vx),
        test_y=readonly(vy),
        num_classes=c,
        input_shape=shape,
        classes=[str(i) for i in range(c)],
    )


def _from_torchvision(name: str, train: Any, test: Any, classes: list[str]) -> DatasetArrays:
    def xy(ds: Any) -> tuple[np.ndarray, np.ndarray]:
        data = ds.data
        x = data.numpy() if isinstance(data, torch.Tensor) else np.asarray(data)
        if x.ndim == 3:  # N x H x W (MNIST family)
            x = x[:, None]
        elif x.ndim == 4 and x.shape[-1] in (1, 3) and x.shape[1] not in (1, 3):
            x = x.transpose(0, 3, 1, 2)  # N x H x W x C (CIFAR) -> a view, no copy
        raw_y = getattr(ds, "targets", None)
        if raw_y is None:
            raw_y = ds.labels  # SVHN
        y = np.asarray(raw_y.numpy() if isinstance(raw_y, torch.Tensor) else raw_y)
        return readonly(x), readonly(y.astype(np.int64))

    tx, ty = xy(train)
    vx, vy = xy(test)
    mean, std = NORMALIZATION[name]
    num_classes = len(classes) if classes else int(max(ty.max(), vy.max())) + 1
    return DatasetArrays(
        name=name,
        train_x=tx,
        train_y=ty,
        test_x=vx,
        test_y=vy,
        num_classes=num_classes,
        input_shape=tuple(int(v) for v in tx.shape[1:]),
        mean=mean,
        std=std,
        classes=list(classes) or [str(i) for i in range(num_classes)],
    )


def read_mnist_like(name: str, root: Path, download: bool, cache: Path) -> DatasetArrays:
    """MNIST / Fashion-MNIST through torchvision's own classes. ``root`` may hold
    ``<Folder>/raw/`` (the torchvision layout), or be that folder or its ``raw`` directory.
    Where only the ``.gz`` files exist (e.g. a read-only share), they are gunzipped once into
    ``<cache>/<Folder>/raw/`` and torchvision reads from ``<cache>``."""
    from torchvision import datasets

    cls = datasets.FashionMNIST if name == "fashionmnist" else datasets.MNIST
    folder = cls.__name__
    gz_names = [os.path.basename(url) for url, _ in cls.resources]
    raw_names = [os.path.splitext(g)[0] for g in gz_names]
    candidates = [root]
    if root.name == folder:
        candidates.append(root.parent)
    if root.name == "raw":
        candidates.append(root.parent.parent)
    raw_dirs = [(base, base / folder / "raw") for base in candidates]
    raw_dirs.append((root, root))  # root holds the files themselves

    use: Path | None = None
    for base, raw in raw_dirs:
        if all((raw / r).is_file() for r in raw_names) and raw == base / folder / "raw":
            use = base
            break
        if all((raw / g).is_file() for g in gz_names):
            use = _gunzip_into_cache(folder, raw, gz_names, cache)
            break
        if all((raw / r).is_file() for r in raw_names):  # bare unpacked files: copy them
            use = _gunzip_into_cache(folder, raw, raw_names, cache)
            break
    if use is None:
        if not download:
            raise FileNotFoundError(
                f"dataset {name!r}: no {folder} files under {root} (looked for "
                f"{folder}/raw/{{{','.join(gz_names)}}} with or without .gz); set dataset.root "
                "to the directory holding them, or dataset.download: true"
            )
        use = root
    train = cls(str(use), train=True, download=download)
    test = cls(str(use), train=False, download=download)
    return _from_torchvision(name, train, test, list(train.classes))


def _gunzip_into_cache(folder: str, src: Path, names: list[str], cache: Path) -> Path:
    """Copy (``.gz``: decompress) ``src/<names>`` into ``<cache>/<folder>/raw/`` once; a stamp
    of the sources' sizes and mtimes decides whether an existing copy is current."""
    dest = cache / folder / "raw"
    stamp = {
        "source": str(src.resolve()),
        "files": {n: [(src / n).stat().st_size, (src / n).stat().st_mtime_ns] for n in names},
    }
    stamp_path = dest / ".source.json"

    def current() -> bool:
        try:
            return json.loads(stamp_path.read_text()) == stamp and all(
                (dest / n.removesuffix(".gz")).is_file() for n in names
            )
        except (OSError, ValueError):
            return False

    if current():
        return cache
    with file_lock(cache / f".{folder}.lock"):
        if current():
            return cache
        dest.mkdir(parents=True, exist_ok=True)
        for n in names:
            out = dest / n.removesuffix(".gz")
            opener = gzip.open if n.endswith(".gz") else open
            with opener(src / n, "rb") as fin:
                write_atomic(out, lambda fout, fin=fin: shutil.copyfileobj(fin, fout, 1 << 20))
        write_bytes_atomic(stamp_path, json.dumps(stamp).encode())
    return cache


def read_cifar(name: str, root: Path, download: bool, cache: Path) -> DatasetArrays:
    """CIFAR-10/100: the torchvision layout (``cifar-10-batches-py`` / ``cifar-100-python``)
    under ``root``, else an ImageFolder zip or directory: ``root`` itself, or ``<root>/cifar10*``
    (``.zip`` or directory; for cifar10 not ``cifar100*``)."""
    from torchvision import datasets

    cls = datasets.CIFAR10 if name == "cifar10" else datasets.CIFAR100
    tv_folder = cls.base_folder
    bases = [root] + ([root.parent] if root.name == tv_folder else [])
    for base in bases:
        if (base / tv_folder).is_dir():
            train = cls(str(base), train=True, download=download)
            test = cls(str(base), train=False, download=download)
            return _from_torchvision(name, train, test, list(train.classes))
    candidates = [root]
    if root.is_dir():
        for p in sorted(root.iterdir()):
            low = p.name.lower().replace("-", "").replace("_", "")
            if not low.startswith(name) or (name == "cifar10" and low.startswith("cifar100")):
                continue
            if (p.is_file() and p.suffix.lower() == ".zip") or p.is_dir():
                candidates.append(p)
    for p in candidates:
        if p.exists() and (
            _cached_zip(p, cache, name) is not None or _imagefolder_layout(p) is not None
        ):
            arrays = load_imagefolder(p, cache, name=name)
            arrays.mean, arrays.std = NORMALIZATION[name]
            return arrays
    if download:
        train = cls(str(root), train=True, download=True)
        test = cls(str(root), train=False, download=True)
        return _from_torchvision(name, train, test, list(train.classes))
    raise FileNotFoundError(
        f"dataset {name!r}: nothing found under {root} (looked for {tv_folder}/, a "
        f"{name}*.zip or {name}*/ directory with train/<class>/ and test/<class>/ images, or "
        "root itself in that layout); set dataset.root, or dataset.download: true"
    )


def read_svhn(root: Path, download: bool) -> DatasetArrays:
    from torchvision import datasets

    files = [root / "train_32x32.mat", root / "test_32x32.mat"]
    if not download and not all(f.is_file() for f in files):
        raise FileNotFoundError(
            f"dataset 'svhn': {', '.join(f.name for f in files)} not found under {root}; set "
            "dataset.root, or dataset.download: true"
        )
    try:
        train = datasets.SVHN(str(root), split="train", download=download)
        test = datasets.SVHN(str(root), split="test", download=download)
    except ImportError as exc:
        raise ImportError(f"dataset 'svhn' needs scipy to read .mat files: {exc}") from exc
    return _from_torchvision("svhn", train, test, [str(i) for i in range(10)])


# ----------------------------------------------------------------------------- ImageFolder


def _zip_key(source: Path) -> str:
    """Cache key of a zip: its resolved path, size and mtime (no need to read it)."""
    st = source.stat()
    text = f"{source.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def _source_key(layout: _Layout) -> str:
    if layout.is_zip:
        return _zip_key(layout.source)
    h = hashlib.sha1(str(layout.source.resolve()).encode())
    for split in ("train", "test"):
        for _, member in layout.files[split]:
            st = (layout.source / member).stat()
            h.update(f"{member}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _decode_all(layout: _Layout, classes: list[str]) -> dict[str, np.ndarray]:
    """Decode every image into ``N x C x H x W`` uint8 arrays (torchvision's libjpeg/libpng
    decoders, about 2x faster than PIL here; PIL for other formats and for resizing)."""
    from PIL import Image

    try:  # deprecated in torchvision 0.29 (in favour of torchcodec) but still the fastest here
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from torchvision.io import ImageReadMode, decode_image
    except ImportError:  # pragma: no cover
        ImageReadMode = decode_image = None  # noqa: N806

    index = {c: i for i, c in enumerate(classes)}
    out: dict[str, np.ndarray] = {}
    zf = zipfile.ZipFile(layout.source) if layout.is_zip else None
    try:

        def read(member: str) -> bytes:
            try:
                if zf is not None:
                    return zf.read(member)
                return (layout.source / member).read_bytes()
            except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as exc:
                raise DatasetError(
                    f"{layout.source}: member {member}: cannot be read (corrupt or "
                    f"truncated?): {exc}"
                ) from None

        first_member = layout.files["train"][0][1]
        try:
            with Image.open(io.BytesIO(read(first_member))) as first:
                gray = first.mode in ("1", "L", "LA", "I", "I;16", "F")
                width, height = first.size
        except (OSError, ValueError) as exc:  # PIL's UnidentifiedImageError is an OSError
            if isinstance(exc, DatasetError):
                raise
            raise DatasetError(
                f"{layout.source}: member {first_member}: not a readable image: {exc}"
            ) from None
        mode = "L" if gray else "RGB"
        read_mode = None
        if ImageReadMode is not None:
            read_mode = ImageReadMode.GRAY if gray else ImageReadMode.RGB
        channels = 1 if gray else 3

        def decode(data: bytes) -> np.ndarray:
            if decode_image is not None:
                try:
                    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", DeprecationWarning)
                        t = decode_image(raw, read_mode)
                    if tuple(t.shape) == (channels, height, width):
                        return t.numpy()
                except (RuntimeError, ValueError):
                    pass
            with Image.open(io.BytesIO(data)) as img:
                img = img.convert(mode)
                if img.size != (width, height):
                    img = img.resize((width, height), Image.BILINEAR)
                arr = np.asarray(img, dtype=np.uint8)
            return arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)

        for split in ("train", "test"):
            members = layout.files[split]
            x = np.empty((len(members), channels, height, width), dtype=np.uint8)
            y = np.empty(len(members), dtype=np.int64)
            for i, (cls, member) in enumerate(members):
                data = read(member)
                try:
                    x[i] = decode(data)
                except (OSError, ValueError) as exc:
                    raise DatasetError(
                        f"{layout.source}: member {member}: not a readable image: {exc}"
                    ) from None
                y[i] = index[cls]
            out[f"{split}_x"] = x
            out[f"{split}_y"] = y
    finally:
        if zf is not None:
            zf.close()
    return out


_CACHE_KEYS = ("train_x", "train_y", "test_x", "test_y")
OWN_SUFFIX = "-own"  # the cache of a device's own folder, decoded with every class it holds


def _open_cached(cache: Path, name: str) -> DatasetArrays | None:
    """The decoded arrays in ``cache`` (memory-mapped, read-only), or None if not complete."""
    meta_path = cache / "meta.json"
    if not meta_path.is_file():
        return None
    meta = json.loads(meta_path.read_text())
    loaded = {k: np.load(cache / f"{k}.npy", mmap_mode="r") for k in _CACHE_KEYS}
    channels = int(meta["input_shape"][0])
    return DatasetArrays(
        name=name,
        train_x=loaded["train_x"],
        train_y=loaded["train_y"],
        test_x=loaded["test_x"],
        test_y=loaded["test_y"],
        num_classes=len(meta["classes"]),
        input_shape=tuple(int(v) for v in meta["input_shape"]),
        mean=(0.5,) * channels,
        std=(0.5,) * channels,
        classes=list(meta["classes"]),
    )


def _cached_zip(
    source: Path, cache_dir: str | Path | None, name: str, suffix: str = ""
) -> DatasetArrays | None:
    """A zip's decoded arrays if already cached (checks only the zip's stat, not its content)."""
    if not (source.is_file() and source.suffix.lower() == ".zip"):
        return None
    key = _zip_key(source) + suffix
    return _open_cached(default_cache_dir(cache_dir) / "imagefolder" / key, name)


def load_imagefolder(
    source: str | Path,
    cache_dir: str | Path | None = None,
    *,
    name: str = "imagefolder",
    own: bool = False,
) -> DatasetArrays:
    """An ImageFolder dataset (a ``.zip`` or directory with ``train/<class>/*`` and
    ``test/<class>/*`` images, possibly under one top-level folder) as uint8 arrays.

    Class order = sorted train folder names; a test class missing from ``train/`` is a
    ``ValueError``. With ``own`` (a device's own folder, ``partition: none``) the layout may
    also be ``train/<class>/*`` alone or ``<class>/*`` (every image in the train split, the
    test split empty: the caller splits it), and the classes are every folder name found
    (sorted), in train or test. Images are converted to the first train image's mode
    (grayscale → 1 channel, anything else → RGB) and size. Decoding happens once: the
    arrays are cached as ``.npy`` under ``<cache>/imagefolder/<key>/`` (key from the source's
    path, size and mtime, plus ``-own`` with ``own``; written atomically under a file lock, so
    concurrent processes decode once) and memory-mapped read-only afterwards. Normalization
    is 0.5/0.5."""
    source = Path(source).expanduser()
    if not source.exists():
        raise FileNotFoundError(f"dataset {name!r}: {source} does not exist")
    suffix = OWN_SUFFIX if own else ""
    hit = _cached_zip(source, cache_dir, name, suffix)
    if hit is not None:
        return hit
    layout = _imagefolder_layout(source, own)
    if layout is None:
        if own:
            raise FileNotFoundError(
                f"dataset {name!r}: {source} has no images in <class>/ folders (looked for "
                "train/<class>/ with or without test/<class>/, and <class>/, at its top or "
                "under one top-level folder)"
            )
        raise FileNotFoundError(
            f"dataset {name!r}: {source} has no train/<class>/<image> and test/<class>/<image> "
            "(at its top or under one top-level folder)"
        )
    if own:
        classes = sorted({c for split in layout.files.values() for c, _ in split})
    else:
        classes = sorted({c for c, _ in layout.files["train"]})
        unknown = sorted({c for c, _ in layout.files["test"]} - set(classes))
        if unknown:
            raise ValueError(
                f"dataset {name!r}: {source}: test classes {unknown} are not in train/"
            )
    cache = default_cache_dir(cache_dir) / "imagefolder" / (_source_key(layout) + suffix)
    arrays = _open_cached(cache, name)
    if arrays is not None:
        return arrays
    with file_lock(cache.parent / f"{cache.name}.lock"):
        if not (cache / "meta.json").is_file():
            decoded = _decode_all(layout, classes)
            cache.mkdir(parents=True, exist_ok=True)
            for k in _CACHE_KEYS:
                atomic_save_npy(cache / f"{k}.npy", decoded[k])
            meta = {
                "source": str(source.resolve()),
                "classes": classes,
                "input_shape": list(decoded["train_x"].shape[1:]),
            }
            write_bytes_atomic(cache / "meta.json", json.dumps(meta).encode())
    arrays = _open_cached(cache, name)
    assert arrays is not None
    return arrays


__all__ = [
    "IMAGE_EXTENSIONS",
    "NORMALIZATION",
    "SYNTHETIC_NOISE",
    "load_imagefolder",
    "read_cifar",
    "read_mnist_like",
    "read_svhn",
    "read_synthetic",
]
