"""A device's own data (``dataset.partition: none``): each node trains and tests on what is
at its own root (``dataset.root`` or the device's ``data_root``, ``{id}`` replaced by the
node id), with no partition and nothing read from a peer.

Contract:

* Readers: ``npz`` (:func:`read_npz`: ``x_train, y_train, x_test, y_test``), an ImageFolder
  zip or directory (:func:`read_imagefolder`) and the built-in datasets whole
  (:func:`whole_node_data`) here; ``csv`` and ``parquet`` in :mod:`p2pfl.learning.own_tables`,
  a user function ``package.module:function`` in :mod:`p2pfl.learning.own_functions`.
  :func:`p2pfl.learning.data.load_node_data` picks one. This module holds what they share:
  the swarm's labels (:func:`map_labels`), the held-out split (:func:`split_fraction`), the
  node's files (:func:`own_files`), arrays checked into a :class:`NodeData`
  (:func:`from_four_arrays`, :func:`node_data`).
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
  is the configuration field to fix; :func:`p2pfl.check.preflight.check_node_data` adds
  the node id and the topology file.
"""

from __future__ import annotations

import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from p2pfl.config.schema import DatasetConfig
from p2pfl.learning.arrays import (
    DatasetArrays,
    DatasetError,
    NodeData,
    array_spec,
    label_hist,
)
from p2pfl.learning.partition import stable_rng, subsample_like
from p2pfl.learning.readers import load_imagefolder
from p2pfl.learning.user_code import describe

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


def split_rng(seed: int, node_id: str) -> np.random.Generator:
    return stable_rng(seed, "split", node_id)


def node_data(
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
    return node_data(
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
        tr, te = split_fraction(all_y, cfg.test_fraction, len(names), split_rng(seed, node_id))
        every = np.arange(len(all_y), dtype=np.int64)
        train = (arrays.train_x, every[tr], all_y)
        test = (arrays.train_x, every[te], all_y)
    return _from_dataset_arrays(
        arrays, cfg, node_id, seed, train=train, test=test, names=names, source=str(path)
    )


# ----------------------------------------------------------------------------- files


def own_files(root: str | None, kind: str, ext: str) -> tuple[Path, Path | None]:
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


def from_four_arrays(
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
    return node_data(
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
    path, _ = own_files(root, "npz", ".npz")
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
    return from_four_arrays(parts, names, str(path), counted, str(path))


__all__ = [
    "NPZ_KEYS",
    "from_four_arrays",
    "map_labels",
    "node_data",
    "own_files",
    "read_imagefolder",
    "read_npz",
    "split_fraction",
    "split_rng",
    "swarm_classes",
    "whole_node_data",
]
