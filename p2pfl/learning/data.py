"""Datasets and per-node train/test splits.

Contract:

* :func:`load_arrays` returns a whole dataset as numpy arrays (:class:`DatasetArrays`):
  images stay ``uint8`` in ``N x C x H x W`` layout (possibly a read-only memory map or view),
  synthetic data is ``float32``. Labels are ``int64``.
* Partitioning (:func:`p2pfl.learning.partition.partition_indices`) lives in
  :mod:`p2pfl.learning.partition`: a deterministic function of the seed, dataset, spec and
  node count, so every node computes the same partition on its own and keeps its own shard:
  node index = position of its id in the swarm's node list.
* :func:`load_node_data` returns one node's shard (:class:`NodeData`) as float32 tensors,
  normalized per dataset; only that shard is converted to float. Its test split is drawn from
  the global test set following the node's own train label distribution.

Files are never downloaded unless ``DatasetConfig.download`` is true; missing files raise
``FileNotFoundError`` naming the dataset and the root. Derived files (gunzipped IDX files,
decoded JPEG arrays) go to a cache directory: the ``cache_dir`` argument, else ``$P2PFL_CACHE``,
else ``~/.cache/p2pfl``. Writes to the cache are atomic and guarded by a file lock, so many
node processes started together do the work once.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import shutil
import threading
import warnings
import zipfile
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from p2pfl.config.schema import DatasetConfig
from p2pfl.errors import P2PFLError
from p2pfl.learning.partition import (
    partition_indices,
    stable_rng,
    subsample_like,
    test_indices_like,
)

try:  # POSIX only; elsewhere concurrent cache writers simply race (still atomic renames)
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

# (mean, std) per channel for (x / 255 - mean) / std
NORMALIZATION: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "mnist": ((0.1307,), (0.3081,)),
    "fashionmnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "svhn": ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
}
IMAGE_EXTENSIONS = (
    ".jpg",
    ".jpeg",
    ".png",
    ".bmp",
    ".gif",
    ".ppm",
    ".pgm",
    ".tif",
    ".tiff",
    ".webp",
)
SYNTHETIC_NOISE = 1.0  # std of the per-sample gaussian noise around a class prototype


# ----------------------------------------------------------------------------- containers


@dataclass
class DatasetArrays:
    """A whole dataset. ``*_x``: ``N x C x H x W`` uint8 images (treat as read-only: they may
    be memory maps or views shared by every node of a process) or float32 ``N x ...`` arrays
    (synthetic); ``*_y``: int64 labels in ``[0, num_classes)``."""

    name: str
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    num_classes: int
    input_shape: tuple[int, ...]
    mean: tuple[float, ...] | None = None  # None: already float, no normalization
    std: tuple[float, ...] | None = None
    classes: list[str] = field(default_factory=list)

    def to_tensor(self, x: np.ndarray, idx: np.ndarray) -> torch.Tensor:
        """Rows ``idx`` of ``x`` as a new float32 tensor, normalized as ``(x/255 - mean)/std``
        for uint8 images (only these rows are read and converted)."""
        rows = np.ascontiguousarray(x[np.asarray(idx, dtype=np.int64)])
        t = torch.from_numpy(rows)
        if self.mean is None or self.std is None:
            return t.to(torch.float32, copy=True)
        t = t.to(torch.float32).div_(255.0)
        shape = (1, -1) + (1,) * (t.dim() - 2)
        mean = torch.tensor(self.mean, dtype=torch.float32).view(shape)
        std = torch.tensor(self.std, dtype=torch.float32).view(shape)
        return t.sub_(mean).div_(std)


@dataclass
class NodeData:
    """One node's data: its train shard and its test split, ready for training."""

    train_x: torch.Tensor  # float32, N x C x H x W (normalized), or N x D
    train_y: torch.Tensor  # int64
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    input_shape: tuple[int, ...]
    train_hist: list[int]  # label histogram of this node's train split, length num_classes
    test_hist: list[int]


# ----------------------------------------------------------------------------- helpers


def default_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir``, else ``$P2PFL_CACHE``, else ``~/.cache/p2pfl``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("P2PFL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "p2pfl"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive inter-process lock on ``path`` (created if needed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        if fcntl is not None:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.{threading.get_ident()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _atomic_save_npy(path: Path, arr: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.{threading.get_ident()}")
    with open(tmp, "wb") as fh:
        np.save(fh, arr)
    os.replace(tmp, path)


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


# ----------------------------------------------------------------------------- loaders


def _synthetic(cfg: DatasetConfig, seed: int) -> DatasetArrays:
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
        train_x=_readonly(tx),
        train_y=_readonly(ty),
        test_x=_readonly(vx),
        test_y=_readonly(vy),
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
        return _readonly(x), _readonly(y.astype(np.int64))

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


def _mnist_like(name: str, root: Path, download: bool, cache: Path) -> DatasetArrays:
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
    with _file_lock(cache / f".{folder}.lock"):
        if current():
            return cache
        dest.mkdir(parents=True, exist_ok=True)
        for n in names:
            out = dest / n.removesuffix(".gz")
            tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
            opener = gzip.open if n.endswith(".gz") else open
            with opener(src / n, "rb") as fin, open(tmp, "wb") as fout:
                shutil.copyfileobj(fin, fout, 1 << 20)
            os.replace(tmp, out)
        _atomic_write_bytes(stamp_path, json.dumps(stamp).encode())
    return cache


def _cifar(name: str, root: Path, download: bool, cache: Path) -> DatasetArrays:
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


def _svhn(root: Path, download: bool) -> DatasetArrays:
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


@dataclass
class _Layout:
    """Where ``train/<class>/*`` and ``test/<class>/*`` are, inside a zip or a directory."""

    source: Path
    is_zip: bool
    files: dict[str, list[tuple[str, str]]]  # split -> [(class, member path)]


def _is_image(name: str) -> bool:
    base = name.rsplit("/", 1)[-1]
    return not base.startswith(".") and base.lower().endswith(IMAGE_EXTENSIONS)


def _split_members(names: list[str], prefix: str) -> dict[str, list[tuple[str, str]]]:
    files: dict[str, list[tuple[str, str]]] = {"train": [], "test": []}
    for nm in names:
        if not nm.startswith(prefix) or not _is_image(nm):
            continue
        parts = nm[len(prefix) :].split("/")
        if len(parts) == 3 and parts[0] in files and parts[1]:
            files[parts[0]].append((parts[1], nm))
    return files


def _imagefolder_layout(source: Path) -> _Layout | None:
    """The layout of ``source`` (a ``.zip`` or a directory) if it has ``train/<class>/<img>``
    and ``test/<class>/<img>``, at the top or under one top-level folder; else ``None``."""
    if source.is_file() and source.suffix.lower() == ".zip":
        try:
            with zipfile.ZipFile(source) as zf:
                names = [n for n in zf.namelist() if not n.startswith("__MACOSX/")]
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            raise DatasetError(
                f"{source}: not a readable zip (corrupt or truncated?): {exc}"
            ) from None
        tops = {n.split("/", 1)[0] for n in names if "/" in n}
        for prefix in ["", *sorted(t + "/" for t in tops)]:
            files = _split_members(names, prefix)
            if files["train"] and files["test"]:
                return _Layout(source, True, files)
        return None
    if source.is_dir():
        subdirs = [p for p in sorted(source.iterdir()) if p.is_dir() and not p.name.startswith(".")]
        for base in [source, *subdirs]:
            if (base / "train").is_dir() and (base / "test").is_dir():
                names = [
                    str(p.relative_to(source)).replace(os.sep, "/")
                    for split in ("train", "test")
                    for p in sorted((base / split).glob("*/*"))
                    if p.is_file()
                ]
                rel = base.relative_to(source)
                prefix = "" if str(rel) == "." else str(rel).replace(os.sep, "/") + "/"
                files = _split_members(names, prefix)
                if files["train"] and files["test"]:
                    return _Layout(source, False, files)
        return None
    return None


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


class DatasetError(P2PFLError, ValueError):
    """A dataset's files are there but cannot be read: a corrupt or truncated zip, an
    undecodable image. The message names the file (and the zip member)."""


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


def _cached_zip(source: Path, cache_dir: str | Path | None, name: str) -> DatasetArrays | None:
    """A zip's decoded arrays if already cached (checks only the zip's stat, not its content)."""
    if not (source.is_file() and source.suffix.lower() == ".zip"):
        return None
    return _open_cached(default_cache_dir(cache_dir) / "imagefolder" / _zip_key(source), name)


def load_imagefolder(
    source: str | Path, cache_dir: str | Path | None = None, *, name: str = "imagefolder"
) -> DatasetArrays:
    """An ImageFolder dataset (a ``.zip`` or directory with ``train/<class>/*`` and
    ``test/<class>/*`` images, possibly under one top-level folder) as uint8 arrays.

    Class order = sorted train folder names. Images are converted to the first train image's
    mode (grayscale → 1 channel, anything else → RGB) and size. Decoding happens once: the
    arrays are cached as ``.npy`` under ``<cache>/imagefolder/<key>/`` (key from the source's
    path, size and mtime; written atomically under a file lock, so concurrent processes
    decode once) and memory-mapped read-only afterwards. Normalization is 0.5/0.5."""
    source = Path(source).expanduser()
    if not source.exists():
        raise FileNotFoundError(f"dataset {name!r}: {source} does not exist")
    hit = _cached_zip(source, cache_dir, name)
    if hit is not None:
        return hit
    layout = _imagefolder_layout(source)
    if layout is None:
        raise FileNotFoundError(
            f"dataset {name!r}: {source} has no train/<class>/<image> and test/<class>/<image> "
            "(at its top or under one top-level folder)"
        )
    classes = sorted({c for c, _ in layout.files["train"]})
    unknown = sorted({c for c, _ in layout.files["test"]} - set(classes))
    if unknown:
        raise ValueError(f"dataset {name!r}: {source}: test classes {unknown} are not in train/")
    cache = default_cache_dir(cache_dir) / "imagefolder" / _source_key(layout)
    arrays = _open_cached(cache, name)
    if arrays is not None:
        return arrays
    with _file_lock(cache.parent / f"{cache.name}.lock"):
        if not (cache / "meta.json").is_file():
            decoded = _decode_all(layout, classes)
            cache.mkdir(parents=True, exist_ok=True)
            for k in _CACHE_KEYS:
                _atomic_save_npy(cache / f"{k}.npy", decoded[k])
            meta = {
                "source": str(source.resolve()),
                "classes": classes,
                "input_shape": list(decoded["train_x"].shape[1:]),
            }
            _atomic_write_bytes(cache / "meta.json", json.dumps(meta).encode())
    arrays = _open_cached(cache, name)
    assert arrays is not None
    return arrays


# ----------------------------------------------------------------------------- entry points

_ARRAYS: dict[tuple[Any, ...], DatasetArrays] = {}
_ARRAYS_LOCKS: dict[tuple[Any, ...], threading.Lock] = {}
_ARRAYS_GUARD = threading.Lock()
# the latest partitions drawn in this process: (arrays, nodes, spec, seed, min) -> shards
_SHARDS: OrderedDict[tuple[Any, ...], tuple[DatasetArrays, list[np.ndarray]]] = OrderedDict()
_SHARDS_KEPT = 4


def clear_cache() -> None:
    """Forget the datasets kept in memory by :func:`load_arrays` and the partitions drawn
    from them."""
    with _ARRAYS_GUARD:
        _ARRAYS.clear()
        _ARRAYS_LOCKS.clear()
        _SHARDS.clear()


def _shards(
    arrays: DatasetArrays, k: int, spec: str, seed: int, cfg: DatasetConfig
) -> list[np.ndarray]:
    """:func:`partition_indices` of ``arrays``' train labels over ``k`` nodes, drawn once per
    process: the many nodes a process packs all need the same partition, and drawing it is
    O(samples + nodes) each time. The key holds ``arrays`` itself (compared by identity),
    so a dataset loaded again after :func:`clear_cache` gets its own draw."""
    key = (id(arrays), k, spec, seed, cfg.min_samples, cfg.name)
    with _ARRAYS_GUARD:
        hit = _SHARDS.get(key)
        if hit is not None and hit[0] is arrays:
            _SHARDS.move_to_end(key)
            return hit[1]
    c = arrays.num_classes
    drawn = partition_indices(arrays.train_y, k, spec, seed, c, cfg.min_samples, salt=cfg.name)
    shards = [_readonly(idx) for idx in drawn]  # shared by the process's nodes
    with _ARRAYS_GUARD:
        _SHARDS[key] = (arrays, shards)
        while len(_SHARDS) > _SHARDS_KEPT:
            _SHARDS.popitem(last=False)
    return shards


def load_arrays(
    cfg: DatasetConfig, seed: int, cache_dir: str | Path | None = None
) -> DatasetArrays:
    """The whole dataset named by ``cfg`` (train and test) as numpy arrays.

    Loaded once per process (many nodes in one process share it; the arrays are read-only).
    ``seed`` matters only for ``synthetic``. ``cfg.root`` defaults to ``<cache>/datasets``.
    Raises ``FileNotFoundError`` naming the dataset and root when its files are missing and
    ``cfg.download`` is false."""
    cache = default_cache_dir(cache_dir)
    if cfg.name == "synthetic":
        key: tuple[Any, ...] = (
            "synthetic",
            seed,
            cfg.num_classes,
            tuple(cfg.input_shape),
            cfg.synthetic_train,
            cfg.synthetic_test,
        )
    else:
        root = Path(cfg.root).expanduser() if cfg.root else cache / "datasets"
        key = (cfg.name, str(root.resolve()), str(cache.resolve()), cfg.download)
    with _ARRAYS_GUARD:
        if key in _ARRAYS:
            return _ARRAYS[key]
        lock = _ARRAYS_LOCKS.setdefault(key, threading.Lock())
    with lock:
        with _ARRAYS_GUARD:
            if key in _ARRAYS:
                return _ARRAYS[key]
        arrays = _load_arrays_uncached(cfg, seed, cache)
        with _ARRAYS_GUARD:
            _ARRAYS[key] = arrays
        return arrays


def _load_arrays_uncached(cfg: DatasetConfig, seed: int, cache: Path) -> DatasetArrays:
    if cfg.name == "synthetic":
        return _synthetic(cfg, seed)
    root = Path(cfg.root).expanduser() if cfg.root else cache / "datasets"
    if cfg.name in ("fashionmnist", "mnist"):
        return _mnist_like(cfg.name, root, cfg.download, cache)
    if cfg.name in ("cifar10", "cifar100"):
        return _cifar(cfg.name, root, cfg.download, cache)
    if cfg.name == "svhn":
        return _svhn(root, cfg.download)
    if cfg.name == "imagefolder":
        if not cfg.root:
            raise ValueError("dataset 'imagefolder' needs dataset.root (a directory or a .zip)")
        return load_imagefolder(root, cache)
    raise ValueError(f"unknown dataset {cfg.name!r}")  # pragma: no cover


def load_node_data(
    cfg: DatasetConfig,
    node_ids: list[str],
    node_id: str,
    seed: int,
    cache_dir: str | Path | None = None,
) -> NodeData:
    """The shard of node ``node_id`` (its index in ``node_ids``) under ``cfg.partition``.

    Train: the node's partition shard (see :func:`partition_indices`, salted with the dataset
    name), capped to ``cfg.train_per_node`` samples keeping its label proportions. Test:
    ``cfg.test_per_node`` samples (default ``round(n_train * |test| / |train|)``, at least 1)
    drawn from the global test set following the node's train label histogram
    (:func:`test_indices_like`). Deterministic in ``(cfg, node_ids, node_id, seed)``."""
    if node_id not in node_ids:
        raise ValueError(f"node {node_id!r} is not in the swarm's node list {node_ids}")
    arrays = load_arrays(cfg, seed, cache_dir)
    k = len(node_ids)
    i = node_ids.index(node_id)
    c = arrays.num_classes
    spec = cfg.partition.strip().replace(" ", "")
    idx = _shards(arrays, k, spec, seed, cfg)[i]
    if cfg.train_per_node is not None and len(idx) > cfg.train_per_node:
        rng = stable_rng(seed, cfg.name, spec, k, i, "cap")
        idx = subsample_like(arrays.train_y, idx, cfg.train_per_node, c, rng)
    train_y = np.asarray(arrays.train_y[idx], dtype=np.int64)
    train_hist = np.bincount(train_y, minlength=c)
    n_test = cfg.test_per_node or max(
        1, round(len(idx) * len(arrays.test_y) / max(1, len(arrays.train_y)))
    )
    n_test = min(n_test, len(arrays.test_y))
    rng = stable_rng(seed, cfg.name, spec, k, i, "test")
    tidx = test_indices_like(arrays.test_y, train_hist, n_test, rng)
    test_y = np.asarray(arrays.test_y[tidx], dtype=np.int64)
    return NodeData(
        train_x=arrays.to_tensor(arrays.train_x, idx),
        train_y=torch.from_numpy(train_y.copy()),
        test_x=arrays.to_tensor(arrays.test_x, tidx),
        test_y=torch.from_numpy(test_y.copy()),
        num_classes=c,
        input_shape=tuple(arrays.input_shape),
        train_hist=[int(v) for v in train_hist],
        test_hist=[int(v) for v in np.bincount(test_y, minlength=c)],
    )


__all__ = [
    "NORMALIZATION",
    "DatasetArrays",
    "DatasetError",
    "NodeData",
    "clear_cache",
    "default_cache_dir",
    "load_arrays",
    "load_imagefolder",
    "load_node_data",
]
