"""A device's own tables: ``dataset.name: csv`` or ``parquet`` (pandas; Parquet through
pyarrow), under ``dataset.partition: none``.

Contract (:func:`read_table`): the ``dataset.label`` column holds the labels (indices into
``dataset.classes``, or its class names); every other column is a feature and must be
numeric (bool, int or float) and finite. The node's root is the file itself, or a directory
with ``train.<ext>`` (and ``test.<ext>``); without a test file ``dataset.test_fraction`` is
held out (:func:`p2pfl.learning.own_data.split_fraction`). Features are standardised per
column with the mean and std of the node's own train split, or of the JSON file
``dataset.stats``, never of a peer's. Every problem is a
:class:`~p2pfl.learning.arrays.DatasetError` naming the file, with the field to fix.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from p2pfl.config.schema import DatasetConfig
from p2pfl.learning.arrays import DatasetError, NodeData
from p2pfl.learning.own_data import (
    map_labels,
    node_data,
    own_files,
    split_fraction,
    split_rng,
    swarm_classes,
)
from p2pfl.learning.user_code import describe


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
    train_path, test_path = own_files(root, kind, ext)
    names = swarm_classes(cfg, str(train_path))
    counted = isinstance(cfg.classes, int)
    x, raw_y, features = _frame_xy(_read_frame(kind, train_path), cfg.label, train_path, None)
    y = map_labels(raw_y, names, str(train_path), counted=counted)
    if test_path is not None:
        tx, raw_ty, _ = _frame_xy(_read_frame(kind, test_path), cfg.label, test_path, features)
        ty = map_labels(raw_ty, names, str(test_path), counted=counted)
    elif cfg.test_split == "row_hash":
        tr, te = split_by_row_hash(x, cfg.test_fraction)
        x, tx, y, ty = x[tr], x[te], y[tr], y[te]
    else:
        tr, te = split_fraction(y, cfg.test_fraction, len(names), split_rng(seed, node_id))
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
    return node_data(norm(x), y, norm(tx), ty, names, (len(features),), str(source), spec)


__all__ = ["read_table"]
