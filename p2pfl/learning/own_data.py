"""A device's own data (``dataset.partition: none``): each node trains and tests on what is
at its own root (``dataset.root`` or the device's ``data_root``, ``{id}`` replaced by the
node id), with no partition and nothing read from a peer.

Contract:

* Readers: ``npz`` (:func:`read_npz`: ``x_train, y_train, x_test, y_test``), an ImageFolder
  zip or directory (:func:`read_imagefolder`) and the built-in datasets whole
  (:func:`whole_node_data`) here; ``csv`` and ``parquet`` in :mod:`p2pfl.learning.own_tables`,
  a user function ``package.module:function`` in :mod:`p2pfl.learning.own_functions`.
  :func:`p2pfl.learning.data.load_node_data` picks one. This module holds what they share:
  the held-out split (:func:`split_fraction`) and arrays checked into a :class:`NodeData`
  (:func:`from_four_arrays`, :func:`node_data`); the rules they apply that need no torch
  (the node's files, the swarm's labels, a table's columns, an npz's arrays) are
  :mod:`p2pfl.learning.own_rules`, which a site's binding check applies too.
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
  is the configuration field to fix; :func:`p2pfl.learning.node_inputs.check_node_data` adds
  the node id and the topology file.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from p2pfl.config.schema import DatasetConfig
from p2pfl.learning.arrays import (
    DatasetArrays,
    NodeData,
    array_spec,
    label_hist,
)
from p2pfl.learning.own_rules import (
    NPZ_KEYS,
    DatasetError,
    class_folders,
    four_arrays,
    load_npz,
    map_labels,
    own_files,
    swarm_classes,
)
from p2pfl.learning.partition import stable_rng, subsample_like
from p2pfl.learning.readers import load_imagefolder

# ----------------------------------------------------------------------------- splits


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


def value_node_data(
    train_x: torch.Tensor,
    train_y: np.ndarray,
    test_x: torch.Tensor,
    test_y: np.ndarray,
    input_shape: tuple[int, ...],
    source: str,
    input_spec: dict[str, Any],
) -> NodeData:
    """A node's data whose labels are values (``dataset.targets: values``): float32 labels
    (``N``, or ``N x k`` for k label columns), no classes and no histograms;
    ``num_classes`` is the label columns (a built-in value loss's outputs)."""
    columns = 1 if train_y.ndim == 1 else int(train_y.shape[1])
    return NodeData(
        train_x=train_x,
        train_y=torch.from_numpy(np.array(train_y, dtype=np.float32)),
        test_x=test_x,
        test_y=torch.from_numpy(np.array(test_y, dtype=np.float32)),
        num_classes=columns,
        input_shape=tuple(int(v) for v in input_shape),
        train_hist=[],
        test_hist=[],
        classes=[],
        source=source,
        input_spec=input_spec,
    )


def split_values(
    n: int, fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """``(train rows, test rows)``: ``fraction`` of ``n`` rows (at least one, and one left to
    train on) drawn by ``rng``, each side in row order."""
    k = min(max(1, round(fraction * n)), max(0, n - 1))
    test = np.sort(rng.permutation(n)[:k])
    train = np.setdiff1d(np.arange(n), test)
    return train, test


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
    names = class_folders(path, arrays.classes, cfg)
    index = {n: i for i, n in enumerate(names)}
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


# ----------------------------------------------------------------------------- arrays


def from_four_arrays(
    parts: Sequence[Any], names: list[str], where: str, counted: bool, source: str
) -> NodeData:
    """NodeData from ``(x_train, y_train, x_test, y_test)`` (numpy or torch), checked by
    :func:`~p2pfl.learning.own_rules.four_arrays`."""
    parts = [p.detach().cpu().numpy() if isinstance(p, torch.Tensor) else p for p in parts]
    x, y, tx, ty, scaled = four_arrays(parts, names, where, counted)
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
    parts = load_npz(path)
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
    "split_values",
    "swarm_classes",
    "value_node_data",
    "whole_node_data",
]
