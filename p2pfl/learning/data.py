"""Datasets and per-node train/test splits: the entry points.

Contract:

* :func:`load_arrays` returns a whole built-in dataset as numpy arrays
  (:class:`~p2pfl.learning.arrays.DatasetArrays`, read by :mod:`p2pfl.learning.readers`):
  images stay ``uint8`` in ``N x C x H x W`` layout (possibly a read-only memory map or view),
  synthetic data is ``float32``. Labels are ``int64``. Loaded once per process.
* Partitioning (:func:`p2pfl.learning.partition.partition_indices`) lives in
  :mod:`p2pfl.learning.partition`: a deterministic function of the seed, dataset, spec and
  node count, so every node computes the same partition on its own and keeps its own shard:
  node index = position of its id in the swarm's node list.
* :func:`load_node_data` returns one node's data (:class:`~p2pfl.learning.arrays.NodeData`)
  as float32 tensors, normalized per dataset; only that node's rows are converted to float.
  Under a partition its test split is drawn from the global test set following the node's
  own train label distribution. Under ``partition: none`` it is everything at the node's own
  root (:mod:`p2pfl.learning.own_data`): a built-in dataset whole, an ImageFolder, the
  device's csv / parquet / npz files or a user's dataset function.

Files are never downloaded unless ``DatasetConfig.download`` is true; missing files raise
``FileNotFoundError`` naming the dataset and the root; files that cannot be used raise
:class:`DatasetError` naming the file. Derived files (gunzipped IDX files, decoded JPEG
arrays) go to a cache directory (:mod:`p2pfl.learning.cache`): the ``cache_dir`` argument,
else ``$P2PFL_CACHE``, else ``~/.cache/p2pfl``. Writes to the cache are atomic and guarded by
a file lock, so many node processes started together do the work once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from p2pfl.config.schema import FILE_DATASETS, DatasetConfig, is_import_path
from p2pfl.learning.arrays import DatasetArrays, DatasetError, NodeData, readonly
from p2pfl.learning.cache import default_cache_dir
from p2pfl.learning.own_data import read_imagefolder, read_npz, whole_node_data
from p2pfl.learning.own_functions import read_function
from p2pfl.learning.own_tables import read_table
from p2pfl.learning.partition import (
    partition_indices,
    stable_rng,
    subsample_like,
    test_indices_like,
)
from p2pfl.learning.readers import (
    NORMALIZATION,
    load_imagefolder,
    read_cifar,
    read_mnist_like,
    read_svhn,
    read_synthetic,
)

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
    shards = [readonly(idx) for idx in drawn]  # shared by the process's nodes
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
    ``cfg.download`` is false, and :class:`DatasetError` (field ``dataset.partition``) for a
    device's own data (csv, parquet, npz, a dataset function), which is read only whole, by
    :func:`load_node_data` under ``partition: none``."""
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
        return read_synthetic(cfg, seed)
    root = Path(cfg.root).expanduser() if cfg.root else cache / "datasets"
    if cfg.name in ("fashionmnist", "mnist"):
        return read_mnist_like(cfg.name, root, cfg.download, cache)
    if cfg.name in ("cifar10", "cifar100"):
        return read_cifar(cfg.name, root, cfg.download, cache)
    if cfg.name == "svhn":
        return read_svhn(root, cfg.download)
    if cfg.name == "imagefolder":
        if not cfg.root:
            raise ValueError("dataset 'imagefolder' needs dataset.root (a directory or a .zip)")
        return load_imagefolder(root, cache)
    if cfg.name in FILE_DATASETS or is_import_path(cfg.name):
        raise DatasetError(
            f"dataset {cfg.name!r} is a device's own data, read whole by each node: it needs "
            "dataset.partition: none",
            field="dataset.partition",
        )
    raise ValueError(f"unknown dataset {cfg.name!r}")  # pragma: no cover


def load_node_data(
    cfg: DatasetConfig,
    node_ids: list[str],
    node_id: str,
    seed: int,
    cache_dir: str | Path | None = None,
) -> NodeData:
    """The data of node ``node_id`` (its index in ``node_ids``) under ``cfg.partition``.

    ``partition: none``: everything at the node's own root, ``cfg.root_for(node_id)``
    (:mod:`p2pfl.learning.own_data`): a built-in dataset's whole train and test sets (capped
    by ``train_per_node`` / ``test_per_node``), an ImageFolder, csv / parquet / npz files or
    a user's dataset function; their problems raise :class:`DatasetError` naming the file,
    with the field to fix.

    Otherwise train: the node's partition shard (see :func:`partition_indices`, salted with
    the dataset name), capped to ``cfg.train_per_node`` samples keeping its label
    proportions. Test:
    ``cfg.test_per_node`` samples (default ``round(n_train * |test| / |train|)``, at least 1)
    drawn from the global test set following the node's train label histogram
    (:func:`test_indices_like`). Deterministic in ``(cfg, node_ids, node_id, seed)``."""
    if node_id not in node_ids:
        raise ValueError(f"node {node_id!r} is not in the swarm's node list {node_ids}")
    if cfg.own_data:
        return _own_node_data(cfg, node_id, seed, cache_dir)
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
        classes=list(arrays.classes) or [str(i) for i in range(c)],
        source=_source(cfg, cache_dir),
        input_spec=arrays.input_spec,
    )


def _source(cfg: DatasetConfig, cache_dir: str | Path | None) -> str:
    """What a built-in dataset is read from: its root (default ``<cache>/datasets``)."""
    if cfg.name == "synthetic":
        return "synthetic"
    if cfg.root:
        return str(Path(cfg.root).expanduser())
    return str(default_cache_dir(cache_dir) / "datasets")


def _own_node_data(
    cfg: DatasetConfig, node_id: str, seed: int, cache_dir: str | Path | None
) -> NodeData:
    """``partition: none``: the node's own root, whole: its files (csv, parquet, npz, an
    image folder), the user's function, or a built-in dataset whole. A
    :class:`DatasetError` names the file and the field to fix."""
    root = cfg.root_for(node_id)
    if cfg.name in ("csv", "parquet"):
        return read_table(cfg, node_id, seed, root)
    if cfg.name == "npz":
        return read_npz(cfg, node_id, seed, root)
    if is_import_path(cfg.name):
        return read_function(cfg, node_id, seed, root)
    if cfg.name == "imagefolder":
        return read_imagefolder(cfg, node_id, seed, root, cache_dir)
    node_cfg = cfg.model_copy(update={"root": cfg.root_for(node_id)})
    arrays = load_arrays(node_cfg, seed, cache_dir)
    return whole_node_data(arrays, cfg, node_id, seed, _source(node_cfg, cache_dir))


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
