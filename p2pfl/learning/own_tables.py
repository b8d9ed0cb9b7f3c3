"""A device's own tables: ``dataset.name: csv`` or ``parquet`` (pandas; Parquet through
pyarrow), under ``dataset.partition: none``.

Contract (:func:`read_table`): the ``dataset.label`` column holds the labels (indices into
``dataset.classes``, or its class names); every other column is a feature and must be
numeric (bool, int or float) and finite. The node's root is the file itself, or a directory
with ``train.<ext>`` (and ``test.<ext>``); without a test file ``dataset.test_fraction`` is
held out (:func:`p2pfl.learning.own_data.split_fraction`). Features are standardised per
column with the mean and std of the node's own train split, or of the JSON file
``dataset.stats``, never of a peer's. Every problem is a
:class:`~p2pfl.learning.own_rules.DatasetError` naming the file, with the field to fix; the
rules that need no torch (the file, its columns, the labels, the stats) are
:mod:`p2pfl.learning.own_rules`, which a site's binding check applies too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from p2pfl.config.schema import DatasetConfig
from p2pfl.learning.arrays import NodeData
from p2pfl.learning.own_data import (
    node_data,
    split_fraction,
    split_rng,
    split_values,
    value_node_data,
)
from p2pfl.learning.own_rules import (
    frame_xy,
    map_labels,
    own_files,
    read_frame,
    read_stats,
    swarm_classes,
    value_labels,
)


def split_by_row_hash(x: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """``(train, test)`` sorted index arrays: the rows whose features hash (xxh64 of their
    float64 values) below ``fraction`` of the hash space are held out. A row's side depends
    on its values only, so rows appended to the file never move an old row across (the
    held-out data a watched binding's models are compared on stays held out). At least one
    row on each side when there are two."""
    import xxhash

    rows = np.ascontiguousarray(x, dtype=np.float64)
    hashes = np.array([xxhash.xxh64_intdigest(r.tobytes()) for r in rows], dtype=np.uint64)
    test = hashes < np.uint64(int(fraction * 2**64))
    if len(rows) >= 2 and not test.any():
        test[int(np.argmin(hashes))] = True
    if len(rows) >= 2 and test.all():
        test[int(np.argmax(hashes))] = False
    return np.flatnonzero(~test), np.flatnonzero(test)


def read_table(cfg: DatasetConfig, node_id: str, seed: int, root: str | None) -> NodeData:
    """A device's own ``csv`` / ``parquet`` file(s): the ``dataset.label`` column is the
    label, every other column a numeric feature (float32 ``N x D``, input shape ``(D,)``),
    standardised with the stats of the node's own train split or of ``dataset.stats``."""
    kind = cfg.name
    ext = ".csv" if kind == "csv" else ".parquet"
    train_path, test_path = own_files(root, kind, ext, cfg.test_root_for(node_id))
    values = cfg.targets == "values"
    names = [] if values else swarm_classes(cfg, str(train_path))
    counted = isinstance(cfg.classes, int)

    def labels_of(raw: Any, path: Path) -> np.ndarray:
        if values:
            return value_labels(raw, cfg.label, path)
        return map_labels(raw, names, str(path), counted=counted)

    x, raw_y, features = frame_xy(read_frame(kind, train_path), cfg.label, train_path, None)
    y = labels_of(raw_y, train_path)
    if test_path is not None:
        tx, raw_ty, _ = frame_xy(read_frame(kind, test_path), cfg.label, test_path, features)
        ty = labels_of(raw_ty, test_path)
    elif cfg.test_split == "row_hash":
        tr, te = split_by_row_hash(x, cfg.test_fraction)
        x, tx, y, ty = x[tr], x[te], y[tr], y[te]
    elif values:  # no classes to stratify by: a seeded draw of the rows
        tr, te = split_values(len(y), cfg.test_fraction, split_rng(seed, node_id))
        x, tx, y, ty = x[tr], x[te], y[tr], y[te]
    else:
        tr, te = split_fraction(y, cfg.test_fraction, len(names), split_rng(seed, node_id))
        x, tx, y, ty = x[tr], x[te], y[tr], y[te]
    if cfg.stats:
        mean, std = read_stats(cfg.stats, node_id, features)
    else:
        mean, std = x.mean(axis=0), x.std(axis=0)
    std = np.where(std > 0, std, 1.0)

    def norm(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(((a - mean) / std).astype(np.float32))

    source = train_path.parent if test_path is not None and cfg.test_root is None else train_path
    spec = {
        "kind": "tabular",
        "features": list(features),
        "label": cfg.label,
        "mean": [float(v) for v in mean],
        "std": [float(v) for v in std],
    }
    if values:
        return value_node_data(norm(x), y, norm(tx), ty, (len(features),), str(source), spec)
    return node_data(norm(x), y, norm(tx), ty, names, (len(features),), str(source), spec)


__all__ = ["read_table"]
