"""A device's own data (``dataset.partition: none``): each node trains and tests on what is
at its own root (``dataset.root`` or the device's ``data_root``, ``{id}`` replaced by the
node id), with no partition and nothing read from a peer.

Contract:

* Readers: ``csv`` and ``parquet`` (:func:`read_table`, pandas; the ``dataset.label`` column
  is the label, every other column a numeric feature), ``npz`` (:func:`read_npz`: ``x_train,
  y_train, x_test, y_test``), a user function ``package.module:function``
  (:func:`read_function`: four arrays, or two map-style torch Datasets kept as datasets and
  read item by item), an ImageFolder zip or directory (:func:`read_imagefolder`), and the
  built-in datasets whole (:func:`whole_node_data`). :func:`load_own_data` picks one.
* The label space is the swarm's (``dataset.classes``): every node's labels are indices into
  it, ``num_classes`` is its length (required for files and functions; for image folders
  and built-ins, the dataset's own classes when it is not set). A node lacking some classes
  is normal; a label outside them is a :class:`DatasetError` naming the file and up to 5 of
  the labels.
* Without a test split of its own (one file, a folder of class folders) a node holds out
  ``dataset.test_fraction`` of its data: stratified by class, drawn by
  ``stable_rng(seed, "split", node_id)``, so the same files always give the same split.
* Tabular features are normalised with per-feature mean and std (std 0 → 1) from the node's
  own train split, or from the JSON file ``dataset.stats``; never from a peer.
* Every problem is a :class:`DatasetError` naming the file (or the function) whose ``field``
  is the configuration field to fix; :func:`p2pfl.config.preflight.check_node_data` adds
  the node id and the topology file.
"""

from __future__ import annotations

import json
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from p2pfl.config.schema import DatasetConfig, is_import_path
from p2pfl.learning.arrays import (
    DatasetArrays,
    DatasetError,
    NodeData,
    array_spec,
    label_hist,
)
from p2pfl.learning.partition import stable_rng, subsample_like
from p2pfl.learning.readers import load_imagefolder
from p2pfl.learning.user_code import UserCodeError, describe, import_object

NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")
SHOWN = 5  # offending labels shown in an error


# ----------------------------------------------------------------------------- labels


def _classes_text(names: list[str], counted: bool) -> str:
    if counted:
        return f"labels 0..{len(names) - 1}"
    shown = ", ".join(repr(n) for n in names[:10])
    return f"classes [{shown}{', …' if len(names) > 10 else ''}] or their indices"


def swarm_classes(cfg: DatasetConfig, where: str) -> list[str]:
    """``dataset.classes`` as names, or a :class:`DatasetError` on ``dataset.classes`` (a
    device's own files and functions need the swarm's label space)."""
    names = cfg.class_names
    if names is None:
        raise DatasetError(
            f"{where}: dataset {cfg.name!r} needs dataset.classes, the swarm's label space "
            "(a count, or the class names), the same on every node",
            field="dataset.classes",
        )
    return names


def map_labels(values: Any, names: list[str], where: str, *, counted: bool = False) -> np.ndarray:
    """``values`` as int64 indices into ``names``: ints (or integral floats, bools) in
    ``[0, len(names))``, or strings that are a class name or such an index. Anything else
    is a :class:`DatasetError` on ``dataset.classes`` naming ``where`` and up to
    :data:`SHOWN` offending values. ``counted``: the classes were given as a count."""
    v = np.asarray(values)
    c = len(names)
    if v.dtype.kind == "b":
        v = v.astype(np.int64)
    if v.dtype.kind in "iu":
        out = v.astype(np.int64)
        bad = np.unique(v[(out < 0) | (out >= c)])
        bad_list = [int(b) for b in bad]
    elif v.dtype.kind == "f":
        ok = np.isfinite(v) & (v == np.round(v)) & (v >= 0) & (v < c)
        out = np.where(ok, v, 0).astype(np.int64)
        bad_list = [int(b) if float(b).is_integer() else float(b) for b in np.unique(v[~ok])]
    else:
        index = {n: i for i, n in enumerate(names)}
        uniq, inverse = np.unique(v.astype(str), return_inverse=True)
        lut = np.full(len(uniq), -1, dtype=np.int64)
        for j, u in enumerate(uniq):
            if u in index:
                lut[j] = index[u]
            elif u.strip().lstrip("-").isdigit() and 0 <= int(u) < c:
                lut[j] = int(u)
        bad_list = [str(u) for u in uniq[lut < 0]]
        out = lut[inverse.reshape(-1)] if len(uniq) else np.zeros(0, np.int64)
    if bad_list:
        shown = ", ".join(repr(b) if isinstance(b, str) else str(b) for b in bad_list[:SHOWN])
        more = f" and {len(bad_list) - SHOWN} more" if len(bad_list) > SHOWN else ""
        raise DatasetError(
            f"{where}: labels outside dataset.classes ({_classes_text(names, counted)}): "
            f"{shown}{more}",
            field="dataset.classes",
        )
    return out.reshape(-1)


def split_fraction(
    labels: np.ndarray, fraction: float, num_classes: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """``(train, test)`` sorted index arrays: ``round(n * fraction)`` samples held out for
    test (at least 1 and at most ``n - 1``; none when ``n < 2``), stratified by class
    (largest remainder per class, random within a class by ``rng``)."""
    n = len(labels)
    every = np.arange(n, dtype=np.int64)
    if n < 2:
        return every, np.zeros(0, np.int64)
    n_test = min(n - 1, max(1, round(n * fraction)))
    test = subsample_like(np.asarray(labels, dtype=np.int64), every, n_test, num_classes, rng)
    train = np.setdiff1d(every, test, assume_unique=True)
    return train, test


def _split_rng(seed: int, node_id: str) -> np.random.Generator:
    return stable_rng(seed, "split", node_id)


def _node_data(
    train_x: torch.Tensor | None,
    train_y: np.ndarray,
    test_x: torch.Tensor | None,
    test_y: np.ndarray,
    names: list[str],
    input_shape: tuple[int, ...],
    source: str,
    input_spec: dict[str, Any],
    **sets: Any,
) -> NodeData:
    c = len(names)
    return NodeData(
        train_x=train_x,
        train_y=torch.from_numpy(np.array(train_y, dtype=np.int64)),
        test_x=test_x,
        test_y=torch.from_numpy(np.array(test_y, dtype=np.int64)),
        num_classes=c,
        input_shape=tuple(int(v) for v in input_shape),
        train_hist=label_hist(train_y, c),
        test_hist=label_hist(test_y, c),
        classes=list(names),
        source=source,
        input_spec=input_spec,
        **sets,
    )


# ----------------------------------------------------------------------------- built-ins


def _capped(
    labels: np.ndarray, idx: np.ndarray, cap: int | None, c: int, rng: np.random.Generator
) -> np.ndarray:
    return idx if cap is None or len(idx) <= cap else subsample_like(labels, idx, cap, c, rng)


def _from_dataset_arrays(
    arrays: DatasetArrays,
    cfg: DatasetConfig,
    node_id: str,
    seed: int,
    *,
    train: tuple[np.ndarray, np.ndarray, np.ndarray],
    test: tuple[np.ndarray, np.ndarray, np.ndarray],
    names: list[str],
    source: str,
) -> NodeData:
    """The rows ``idx`` of ``(x, idx, labels)`` for train and test, capped to
    ``train_per_node`` / ``test_per_node`` keeping label proportions, as tensors."""
    c = len(names)
    (tx, tidx, ty), (vx, vidx, vy) = train, test
    tidx = _capped(ty, tidx, cfg.train_per_node, c, stable_rng(seed, cfg.name, node_id, "cap"))
    vidx = _capped(vy, vidx, cfg.test_per_node, c, stable_rng(seed, cfg.name, node_id, "test"))
    return _node_data(
        arrays.to_tensor(tx, tidx),
        ty[tidx],
        arrays.to_tensor(vx, vidx),
        vy[vidx],
        names,
        tuple(arrays.input_shape),
        source,
        arrays.input_spec,
    )


def whole_node_data(
    arrays: DatasetArrays, cfg: DatasetConfig, node_id: str, seed: int, source: str
) -> NodeData:
    """A built-in dataset whole (``partition: none``): its entire train and test sets, capped
    by ``train_per_node`` / ``test_per_node``. With ``dataset.classes`` its labels (indices)
    must fall inside it and ``num_classes`` is its length."""
    names = cfg.class_names
    train_y = np.asarray(arrays.train_y, dtype=np.int64)
    test_y = np.asarray(arrays.test_y, dtype=np.int64)
    if names is None:
        names = list(arrays.classes) or [str(i) for i in range(arrays.num_classes)]
    else:
        counted = isinstance(cfg.classes, int)
        train_y = map_labels(train_y, names, f"{source} (train)", counted=counted)
        test_y = map_labels(test_y, names, f"{source} (test)", counted=counted)
    return _from_dataset_arrays(
        arrays,
        cfg,
        node_id,
        seed,
        train=(arrays.train_x, np.arange(len(train_y), dtype=np.int64), train_y),
        test=(arrays.test_x, np.arange(len(test_y), dtype=np.int64), test_y),
        names=names,
        source=source,
    )


def read_imagefolder(
    cfg: DatasetConfig,
    node_id: str,
    seed: int,
    root: str | None,
    cache_dir: str | Path | None = None,
) -> NodeData:
    """A device's own ImageFolder zip or directory: ``train/`` and ``test/`` class folders,
    or only ``train/<class>/`` or ``<class>/`` folders, of which ``dataset.test_fraction``
    is held out (stratified, deterministic). With ``dataset.classes`` the folder names are
    mapped to its indices (a folder not in it is an error naming it); else the classes are
    the folder names found, sorted."""
    if not root:
        raise DatasetError(
            "dataset 'imagefolder' needs dataset.root (a directory or a .zip)",
            field="dataset.root",
        )
    path = Path(root).expanduser()
    arrays = load_imagefolder(path, cache_dir, own=True)
    names = cfg.class_names
    if names is None:
        names = list(arrays.classes)
        lut = np.arange(len(names), dtype=np.int64)
    else:
        index = {n: i for i, n in enumerate(names)}
        unknown = [c for c in arrays.classes if c not in index]
        if unknown:
            shown = ", ".join(repr(u) for u in unknown[:SHOWN])
            counted = isinstance(cfg.classes, int)
            raise DatasetError(
                f"{path}: class folders not in dataset.classes "
                f"({_classes_text(names, counted)}): {shown}",
                field="dataset.classes",
            )
        lut = np.array([index[c] for c in arrays.classes], dtype=np.int64)
    all_y = lut[np.asarray(arrays.train_y, dtype=np.int64)]
    if len(arrays.test_y):
        every = np.arange(len(all_y), dtype=np.int64)
        train = (arrays.train_x, every, all_y)
        test_y = lut[np.asarray(arrays.test_y, dtype=np.int64)]
        test = (arrays.test_x, np.arange(len(test_y), dtype=np.int64), test_y)
    else:
        tr, te = split_fraction(all_y, cfg.test_fraction, len(names), _split_rng(seed, node_id))
        every = np.arange(len(all_y), dtype=np.int64)
        train = (arrays.train_x, every[tr], all_y)
        test = (arrays.train_x, every[te], all_y)
    return _from_dataset_arrays(
        arrays, cfg, node_id, seed, train=train, test=test, names=names, source=str(path)
    )


# ----------------------------------------------------------------------------- tables


def _own_files(root: str | None, kind: str, ext: str) -> tuple[Path, Path | None]:
    """``(train file, test file or None)`` at ``root``: the file itself, or a directory
    holding ``train<ext>`` and ``test<ext>``, or ``train<ext>`` alone, or one ``*<ext>``."""
    if not root:
        raise DatasetError(
            f"dataset {kind!r} needs dataset.root: the node's {ext} file, or a directory "
            f"with train{ext} and test{ext} ('{{id}}' is replaced by the node id)",
            field="dataset.root",
        )
    path = Path(root).expanduser()
    if path.is_file():
        return path, None
    if not path.is_dir():
        raise DatasetError(f"{path} does not exist", field="dataset.root")
    train, test = path / f"train{ext}", path / f"test{ext}"
    if train.is_file():
        return train, (test if test.is_file() else None)
    found = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() == ext)
    if len(found) == 1:
        return found[0], None
    what = f"{len(found)} {ext} files" if found else f"no {ext} file"
    raise DatasetError(
        f"{path}: a directory with {what} and no train{ext}: give the file, or name them "
        f"train{ext} (and test{ext})",
        field="dataset.root",
    )


def _read_frame(kind: str, path: Path) -> Any:
    try:
        import pandas as pd
    except ImportError as exc:  # pragma: no cover - pandas is installed with p2pfl
        raise DatasetError(f"{path}: reading {kind} files needs pandas: {exc}") from None
    if path.stat().st_size == 0:
        raise DatasetError(f"{path}: empty file (0 bytes)")
    try:
        if kind == "csv":
            df = pd.read_csv(path)
        else:
            df = pd.read_parquet(path, engine="pyarrow")
    except pd.errors.EmptyDataError:
        raise DatasetError(f"{path}: empty file (no columns, no rows)") from None
    except Exception as exc:  # a parser's or pyarrow's error: the file is not what it says
        raise DatasetError(f"{path}: cannot be read as {kind}: {describe(exc)}") from None
    if len(df) == 0:
        raise DatasetError(f"{path}: empty file (no rows)")
    return df


def _columns_text(columns: Sequence[Any]) -> str:
    cols = [str(c) for c in columns]
    return ", ".join(cols[:20]) + (f", … ({len(cols)} in all)" if len(cols) > 20 else "")


def _frame_xy(df: Any, label: str, path: Path, features: list[str] | None) -> tuple[Any, ...]:
    """``(x float64 N x D, raw labels, feature names)`` of a data frame, checked."""
    from pandas.api import types as pt

    columns = [str(c) for c in df.columns]
    if label not in columns:
        raise DatasetError(
            f"{path}: no label column {label!r} (its columns: {_columns_text(columns)})",
            field="dataset.label",
        )
    df.columns = columns
    mine = [c for c in columns if c != label]
    if features is None:
        features = mine
        if not features:
            raise DatasetError(f"{path}: no feature columns beside the label column {label!r}")
    elif set(mine) != set(features):
        missing = [c for c in features if c not in mine]
        extra = [c for c in mine if c not in features]
        raise DatasetError(
            f"{path}: its feature columns differ from the train file's"
            + (f"; missing: {_columns_text(missing)}" if missing else "")
            + (f"; not in the train file: {_columns_text(extra)}" if extra else "")
        )
    for col in features:
        s = df[col]
        if not (pt.is_bool_dtype(s) or pt.is_integer_dtype(s) or pt.is_float_dtype(s)):
            raise DatasetError(
                f"{path}: column {col!r} is not numeric ({s.dtype}): every column but the "
                f"label {label!r} is a feature and must be a number (bool, int or float)"
            )
    x = df[features].to_numpy(dtype=np.float64, na_value=np.nan)
    bad = ~np.isfinite(x)
    if bad.any():
        cols = [features[j] for j in np.flatnonzero(bad.any(axis=0))]
        rows = int(bad.any(axis=1).sum())
        raise DatasetError(
            f"{path}: missing (NaN) or infinite values in column(s) {_columns_text(cols)} "
            f"({rows} row(s))"
        )
    return x, df[label].to_numpy(), features


def _read_stats(stats: str, node_id: str, features: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Per-feature ``(mean, std)`` from a JSON file ``{"mean": {col: v}, "std": {col: v}}``."""
    path = Path(stats.replace("{id}", node_id)).expanduser()
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise DatasetError(
            f"{path}: cannot read the stats file: {exc}", field="dataset.stats"
        ) from None
    except ValueError as exc:
        raise DatasetError(f"{path}: not JSON: {exc}", field="dataset.stats") from None
    out = []
    for key in ("mean", "std"):
        table = data.get(key) if isinstance(data, dict) else None
        if not isinstance(table, dict):
            raise DatasetError(
                f'{path}: expected {{"mean": {{column: value}}, "std": {{column: value}}}}',
                field="dataset.stats",
            )
        missing = [f for f in features if f not in table]
        if missing:
            raise DatasetError(
                f"{path}: no {key} for column(s) {_columns_text(missing)}", field="dataset.stats"
            )
        try:
            values = np.array([float(table[f]) for f in features], dtype=np.float64)
        except (TypeError, ValueError):
            raise DatasetError(
                f"{path}: {key}: values must be numbers", field="dataset.stats"
            ) from None
        if not np.isfinite(values).all() or (key == "std" and (values < 0).any()):
            raise DatasetError(
                f"{path}: {key}: values must be finite" + (" and >= 0" if key == "std" else ""),
                field="dataset.stats",
            )
        out.append(values)
    return out[0], out[1]


def read_table(cfg: DatasetConfig, node_id: str, seed: int, root: str | None) -> NodeData:
    """A device's own ``csv`` / ``parquet`` file(s): the ``dataset.label`` column is the
    label, every other column a numeric feature (float32 ``N x D``, input shape ``(D,)``),
    standardised with the stats of the node's own train split or of ``dataset.stats``."""
    kind = cfg.name
    ext = ".csv" if kind == "csv" else ".parquet"
    train_path, test_path = _own_files(root, kind, ext)
    names = swarm_classes(cfg, str(train_path))
    counted = isinstance(cfg.classes, int)
    x, raw_y, features = _frame_xy(_read_frame(kind, train_path), cfg.label, train_path, None)
    y = map_labels(raw_y, names, str(train_path), counted=counted)
    if test_path is not None:
        tx, raw_ty, _ = _frame_xy(_read_frame(kind, test_path), cfg.label, test_path, features)
        ty = map_labels(raw_ty, names, str(test_path), counted=counted)
    else:
        tr, te = split_fraction(y, cfg.test_fraction, len(names), _split_rng(seed, node_id))
        x, tx, y, ty = x[tr], x[te], y[tr], y[te]
    if cfg.stats:
        mean, std = _read_stats(cfg.stats, node_id, features)
    else:
        mean, std = x.mean(axis=0), x.std(axis=0)
    std = np.where(std > 0, std, 1.0)

    def norm(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(((a - mean) / std).astype(np.float32))

    source = train_path.parent if test_path is not None else train_path
    spec = {
        "kind": "tabular",
        "features": list(features),
        "label": cfg.label,
        "mean": [float(v) for v in mean],
        "std": [float(v) for v in std],
    }
    return _node_data(norm(x), y, norm(tx), ty, names, (len(features),), str(source), spec)


# ----------------------------------------------------------------------------- arrays


def _float_inputs(x: Any, where: str, may_be_empty: bool = False) -> tuple[np.ndarray, bool]:
    """``x`` as a float32 array (uint8 divided by 255: then ``True``), checked finite."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    x = np.asarray(x)
    if x.dtype.kind not in "biuf":
        raise DatasetError(f"{where}: not numeric ({x.dtype})")
    if x.ndim < 1 or (len(x) == 0 and not may_be_empty):
        raise DatasetError(f"{where}: no samples (shape {list(x.shape)})")
    scaled = x.dtype == np.uint8
    out = x.astype(np.float32) / 255.0 if scaled else x.astype(np.float32, copy=False)
    if not np.isfinite(out).all():
        raise DatasetError(f"{where}: missing (NaN) or infinite values")
    return out, scaled


def _from_four_arrays(
    parts: Sequence[Any], names: list[str], where: str, counted: bool, source: str
) -> NodeData:
    """NodeData from ``(x_train, y_train, x_test, y_test)`` (numpy or torch)."""
    x, scaled = _float_inputs(parts[0], f"{where}: x_train")
    tx, _ = _float_inputs(parts[2], f"{where}: x_test", may_be_empty=True)
    ys = []
    for key, raw in (("y_train", parts[1]), ("y_test", parts[3])):
        if isinstance(raw, torch.Tensor):
            raw = raw.detach().cpu().numpy()
        ys.append(
            map_labels(np.asarray(raw).reshape(-1), names, f"{where}: {key}", counted=counted)
        )
    y, ty = ys
    if len(tx) == 0:
        tx = np.zeros((0, *x.shape[1:]), dtype=np.float32)
    for key, xs, ls in (("train", x, y), ("test", tx, ty)):
        if len(xs) != len(ls):
            raise DatasetError(f"{where}: x_{key} has {len(xs)} rows but y_{key} {len(ls)}")
    if tx.shape[1:] != x.shape[1:]:
        raise DatasetError(
            f"{where}: x_test's samples are {list(tx.shape[1:])}, x_train's {list(x.shape[1:])}"
        )
    spec = array_spec(tuple(x.shape[1:]))
    if scaled:
        spec["scale"] = 255.0
    return _node_data(
        torch.from_numpy(np.ascontiguousarray(x)),
        y,
        torch.from_numpy(np.ascontiguousarray(tx)),
        ty,
        names,
        tuple(x.shape[1:]),
        source,
        spec,
    )


def read_npz(cfg: DatasetConfig, node_id: str, seed: int, root: str | None) -> NodeData:
    """A device's own ``.npz`` with ``x_train, y_train, x_test, y_test``: x used as float32
    as given (uint8 divided by 255), labels into ``dataset.classes``."""
    path, _ = _own_files(root, "npz", ".npz")
    names = swarm_classes(cfg, str(path))
    if not zipfile.is_zipfile(path):
        raise DatasetError(f"{path}: not an .npz file (a zip of .npy arrays: numpy.savez)")
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in NPZ_KEYS if k not in z.files]
            if missing:
                raise DatasetError(
                    f"{path}: no {', '.join(repr(m) for m in missing)} array (an npz needs "
                    f"{', '.join(NPZ_KEYS)}; it has {', '.join(z.files) or 'none'})"
                )
            parts = [z[k] for k in NPZ_KEYS]
    except DatasetError:
        raise
    except Exception as exc:  # not a zip, a truncated one, object arrays (pickles)
        raise DatasetError(f"{path}: not a readable .npz: {describe(exc)}") from None
    counted = isinstance(cfg.classes, int)
    return _from_four_arrays(parts, names, str(path), counted, str(path))


# ----------------------------------------------------------------------------- functions


def _plain(v: Any) -> Any:
    """A label as a plain Python value (a one-element tensor or array: its element)."""
    if isinstance(v, torch.Tensor | np.ndarray):
        if (v.numel() if isinstance(v, torch.Tensor) else v.size) != 1:
            raise TypeError(f"a label must be one value, got shape {list(v.shape)}")
        return v.reshape(-1)[0].item()
    if isinstance(v, np.generic):
        return v.item()
    return v


def as_input(x: Any) -> torch.Tensor:
    """One item's input as a float32 tensor (uint8 divided by 255)."""
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
    if t.dtype == torch.uint8:
        return t.to(torch.float32).div_(255.0)
    return t if t.dtype == torch.float32 else t.to(torch.float32)


class LabelledDataset(torch.utils.data.Dataset):
    """A user's map-style dataset read item by item: item ``i`` is ``(x, label)`` with ``x``
    the dataset's own input (as float32, uint8 divided by 255) and ``label`` the int64
    index its label maps to in the swarm's classes (read once, when the node loads)."""

    def __init__(self, dataset: Any, labels: torch.Tensor):
        self.dataset = dataset
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return as_input(self.dataset[i][0]), self.labels[i]


def _is_dataset(obj: Any) -> bool:
    return (
        not isinstance(obj, torch.Tensor | np.ndarray)
        and hasattr(obj, "__getitem__")
        and hasattr(obj, "__len__")
    )


def _dataset_labels(ds: Any, where: str) -> np.ndarray:
    """The raw labels of ``ds``: its ``targets`` attribute when it has one, else its items'
    second element, read one item at a time (no input kept)."""
    targets = getattr(ds, "targets", None)
    if targets is not None:
        if isinstance(targets, torch.Tensor):
            targets = targets.detach().cpu().numpy()
        arr = np.asarray(targets).reshape(-1)
        if len(arr) != len(ds):
            raise DatasetError(
                f"{where}: {len(arr)} targets for {len(ds)} items", field="dataset.name"
            )
        return arr
    labels = []
    i = 0
    try:
        for i in range(len(ds)):
            labels.append(_plain(ds[i][1]))
    except Exception as exc:
        raise DatasetError(
            f"{where}: item {i} is not an (x, y) pair: {describe(exc)}", field="dataset.name"
        ) from None
    return np.asarray(labels)


def _first_input(ds: Any, where: str) -> tuple[tuple[int, ...], bool]:
    """The input shape of ``ds``'s first item, and whether its x is uint8 (divided by 255)."""
    try:
        x = ds[0][0]
        raw = x if isinstance(x, torch.Tensor) else np.asarray(x)
        return tuple(as_input(x).shape), raw.dtype in (torch.uint8, np.uint8)
    except Exception as exc:
        raise DatasetError(
            f"{where}: its first item's x is not an array: {describe(exc)}", field="dataset.name"
        ) from None


def read_function(cfg: DatasetConfig, node_id: str, seed: int, root: str | None) -> NodeData:
    """A user's dataset function ``package.module:function``, called as
    ``fn(node_id=node_id, root=root)``. It returns ``(x_train, y_train, x_test, y_test)``
    (numpy or torch; as for npz) or ``(train, test)`` map-style torch Datasets of ``(x, y)``
    items, kept as datasets (:class:`LabelledDataset`): their labels are read once (a
    ``targets`` attribute, else item by item), the input shape from the first item."""
    path = cfg.name
    what = f"dataset function {path!r}"
    try:
        fn = import_object(path, "dataset function")
    except UserCodeError as exc:
        raise DatasetError(str(exc), field="dataset.name") from None
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    file = getattr(module, "__file__", None)
    where = f"{what} ({file})" if file else what
    names = swarm_classes(cfg, where)
    counted = isinstance(cfg.classes, int)
    try:
        out = fn(node_id=node_id, root=root)
    except Exception as exc:
        raise DatasetError(
            f"{where} raised {describe(exc)} (called with node_id={node_id!r}, root={root!r})",
            field="dataset.name",
        ) from None
    if isinstance(out, tuple | list) and len(out) == 4 and not any(map(_is_dataset, out)):
        try:
            return _from_four_arrays(out, names, where, counted, path)
        except DatasetError as exc:  # the function's output is wrong, or its labels are
            field = exc.field if exc.field == "dataset.classes" else "dataset.name"
            raise DatasetError(str(exc), field=field) from None
    if isinstance(out, tuple | list) and len(out) == 2 and all(map(_is_dataset, out)):
        train, test = out
        if len(train) == 0:
            raise DatasetError(f"{where}: its train dataset is empty", field="dataset.name")
        y = map_labels(
            _dataset_labels(train, f"{where} (train)"), names, f"{where} (train)", counted=counted
        )
        ty = map_labels(
            _dataset_labels(test, f"{where} (test)"), names, f"{where} (test)", counted=counted
        )
        shape, scaled = _first_input(train, f"{where} (train)")
        test_shape = _first_input(test, f"{where} (test)")[0] if len(test) else shape
        if test_shape != shape:
            raise DatasetError(
                f"{where}: its test items' x is {list(test_shape)}, its train items' {list(shape)}",
                field="dataset.name",
            )
        spec = array_spec(shape)
        if scaled:
            spec["scale"] = 255.0
        train_set = LabelledDataset(train, torch.from_numpy(y.copy()))
        test_set = LabelledDataset(test, torch.from_numpy(ty.copy()))
        return _node_data(
            None,
            y,
            None,
            ty,
            names,
            shape,
            path,
            spec,
            train_set=train_set,
            test_set=test_set,
        )
    got = f"a {len(out)}-tuple" if isinstance(out, tuple | list) else type(out).__name__
    raise DatasetError(
        f"{where} returned {got}: expected (x_train, y_train, x_test, y_test) arrays or "
        "(train, test) map-style torch Datasets of (x, y) items",
        field="dataset.name",
    )


# ----------------------------------------------------------------------------- entry point


def load_own_data(
    cfg: DatasetConfig, node_id: str, seed: int, cache_dir: str | Path | None = None
) -> NodeData:
    """Node ``node_id``'s own data at ``cfg.root_for(node_id)``: csv, parquet, npz, a user
    function or an ImageFolder (the built-in datasets go through :func:`whole_node_data`).
    Raises :class:`DatasetError` naming the file, with the field to fix."""
    root = cfg.root_for(node_id)
    if cfg.name in ("csv", "parquet"):
        return read_table(cfg, node_id, seed, root)
    if cfg.name == "npz":
        return read_npz(cfg, node_id, seed, root)
    if is_import_path(cfg.name):
        return read_function(cfg, node_id, seed, root)
    if cfg.name == "imagefolder":
        return read_imagefolder(cfg, node_id, seed, root, cache_dir)
    raise ValueError(f"dataset {cfg.name!r} is not read by load_own_data")


__all__ = [
    "NPZ_KEYS",
    "LabelledDataset",
    "as_input",
    "load_own_data",
    "map_labels",
    "read_function",
    "read_imagefolder",
    "read_npz",
    "read_table",
    "split_fraction",
    "swarm_classes",
    "whole_node_data",
]
