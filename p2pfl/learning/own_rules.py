"""The rules a device's own data must meet, without torch: what the node's readers
(:mod:`p2pfl.learning.own_data`, :mod:`p2pfl.learning.own_tables`) apply as they load it, and
what a site daemon and ``p2pfl validate --site`` apply to a site's data bindings before the
site consents to a run (:mod:`p2pfl.sites.policy.binding_check`). One set of rules, so a binding
that passes the check is one the worker reads.

Contract: numpy, the standard library, and pandas / pyarrow imported when a table is read;
never torch. Every problem is a :class:`DatasetError` naming the file, whose ``field`` is the
configuration field to fix (``dataset.root`` unless said otherwise).

- the node's files: :func:`own_files` (a file, or a directory with ``train<ext>`` and
  ``test<ext>``);
- the swarm's label space: :func:`swarm_classes`, :func:`map_labels` (the labels as indices
  into ``dataset.classes``), :func:`class_folders` (an image folder's class folders in it);
- tables: :func:`read_frame` (whole) or :func:`frame_chunks` (a bounded number of rows at a
  time), :func:`frame_xy` (the label column, numeric features), :func:`read_stats`;
- arrays (npz, a dataset function's output): :func:`load_npz`, :func:`four_arrays`.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from p2pfl.config.dataset_schema import DatasetConfig
from p2pfl.config.suggest import did_you_mean
from p2pfl.errors import P2PFLError
from p2pfl.learning.user_code import describe

NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")
SHOWN = 5  # offending labels shown in an error
CHUNK_ROWS = 50_000  # rows of a table read at once by frame_chunks


class DatasetError(P2PFLError, ValueError):
    """A dataset's files are there but cannot be used: a corrupt or truncated zip, an
    undecodable image, a data file without its label column, a label outside the swarm's
    classes. The message names the file (and the zip member or the column); ``field`` is
    the configuration field to fix (``dataset.root`` unless the reader says otherwise)."""

    def __init__(self, message: str, *, field: str = "dataset.root"):
        super().__init__(message)
        self.field = field


# ----------------------------------------------------------------------------- labels


def classes_text(names: list[str], counted: bool) -> str:
    """``labels 0..C-1`` or ``classes ['a', 'b'] or their indices``, for messages."""
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


def numbered_names(names: list[str]) -> dict[int, int] | None:
    """``{number: index}`` when the class names are whole numbers other than the indices
    themselves (``classes: [1, 0]`` or ``[2, 4]``): a number label is then the class of that
    name; None otherwise (a number label is an index, the same thing for ``[0, 1, ...]``)."""
    try:
        numbers = [int(n) for n in names]
    except ValueError:
        return None
    if [str(n) for n in numbers] != list(names) or numbers == list(range(len(names))):
        return None
    return {n: i for i, n in enumerate(numbers)}


def label_indices(values: Any, names: list[str]) -> tuple[np.ndarray, list[Any]]:
    """``(indices, bad)``: ``values`` as int64 indices into ``names`` (0 where a value is
    bad) and the distinct values that are none (sorted), as :func:`map_labels` reads them."""
    v = np.asarray(values)
    c = len(names)
    if v.dtype.kind == "b":
        v = v.astype(np.int64)
    numbered = numbered_names(names)
    if numbered is not None and v.dtype.kind in "iuf":  # a number label is the class it names
        flat = v.reshape(-1)
        ok = np.isfinite(flat) if v.dtype.kind == "f" else np.ones(flat.shape, bool)
        keys = np.where(ok, flat, -1).astype(np.int64) if v.dtype.kind == "f" else flat
        ok &= (flat == keys) & np.isin(keys, list(numbered))
        lut = {k: i for k, i in numbered.items()}
        out = np.array([lut.get(int(k), 0) for k in keys], dtype=np.int64) if len(keys) else keys
        bad = [int(b) if float(b).is_integer() else float(b) for b in np.unique(flat[~ok])]
        return np.where(ok, out, 0).astype(np.int64), bad
    if v.dtype.kind in "iu":
        out = v.astype(np.int64)
        bad = np.unique(v[(out < 0) | (out >= c)])
        out = np.where((out < 0) | (out >= c), 0, out)
        return out.reshape(-1), [int(b) for b in bad]
    if v.dtype.kind == "f":
        ok = np.isfinite(v) & (v == np.round(v)) & (v >= 0) & (v < c)
        out = np.where(ok, v, 0).astype(np.int64)
        bad_list = [int(b) if float(b).is_integer() else float(b) for b in np.unique(v[~ok])]
        return out.reshape(-1), bad_list
    index = {n: i for i, n in enumerate(names)}
    uniq, inverse = np.unique(v.astype(str), return_inverse=True)
    lut = np.full(len(uniq), -1, dtype=np.int64)
    for j, u in enumerate(uniq):
        if u in index:
            lut[j] = index[u]
        elif u.strip().lstrip("-").isdigit() and 0 <= int(u) < c:
            lut[j] = int(u)
    bad_list = [str(u) for u in uniq[lut < 0]]
    out = np.maximum(lut, 0)[inverse.reshape(-1)] if len(uniq) else np.zeros(0, np.int64)
    return out.reshape(-1), bad_list


def labels_error(where: str, bad: list[Any], names: list[str], counted: bool) -> DatasetError:
    """The error on ``dataset.classes`` for labels ``bad`` of ``where`` outside ``names``."""
    shown = ", ".join(repr(b) if isinstance(b, str) else str(b) for b in bad[:SHOWN])
    more = f" and {len(bad) - SHOWN} more" if len(bad) > SHOWN else ""
    return DatasetError(
        f"{where}: labels outside dataset.classes ({classes_text(names, counted)}): {shown}{more}",
        field="dataset.classes",
    )


def map_labels(values: Any, names: list[str], where: str, *, counted: bool = False) -> np.ndarray:
    """``values`` as int64 indices into ``names``: ints (or integral floats, bools) in
    ``[0, len(names))``, or strings that are a class name or such an index. Anything else
    is a :class:`DatasetError` on ``dataset.classes`` naming ``where`` and up to
    :data:`SHOWN` offending values. ``counted``: the classes were given as a count."""
    out, bad = label_indices(values, names)
    if bad:
        raise labels_error(where, bad, names, counted)
    return out


def class_folders(path: Path, folders: Sequence[str], cfg: DatasetConfig) -> list[str]:
    """The classes of an image folder whose class folders are ``folders``: their names,
    sorted, without ``dataset.classes``; else ``dataset.classes``, and a
    :class:`DatasetError` on it naming the folders not in it."""
    names = cfg.class_names
    if names is None:
        return sorted(set(folders))
    unknown = [c for c in dict.fromkeys(folders) if c not in names]
    if unknown:
        shown = ", ".join(repr(u) for u in unknown[:SHOWN])
        counted = isinstance(cfg.classes, int)
        raise DatasetError(
            f"{path}: class folders not in dataset.classes "
            f"({classes_text(names, counted)}): {shown}",
            field="dataset.classes",
        )
    return names


# ----------------------------------------------------------------------------- files


def own_files(
    root: str | None, kind: str, ext: str, test_root: str | None = None
) -> tuple[Path, Path | None]:
    """``(train file, test file or None)`` at ``root``: the file itself, or a directory
    holding ``train<ext>`` and ``test<ext>``, or ``train<ext>`` alone, or one ``*<ext>``;
    ``test_root`` (``dataset.test_root``, ``{id}`` replaced), when given, is the test file,
    whatever the folder holds."""
    train, test = _own_train_test(root, kind, ext)
    if test_root is None:
        return train, test
    given = Path(test_root).expanduser()
    if not given.is_file():
        why = "is a directory, not a file" if given.is_dir() else "does not exist"
        raise DatasetError(f"{given} {why}", field="dataset.test_root")
    return train, given


def _own_train_test(root: str | None, kind: str, ext: str) -> tuple[Path, Path | None]:
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


# ----------------------------------------------------------------------------- tables


def _pandas(kind: str, path: Path) -> Any:
    try:
        import pandas as pd
    except ImportError as exc:  # pragma: no cover - pandas is installed with p2pfl
        raise DatasetError(f"{path}: reading {kind} files needs pandas: {exc}") from None
    if path.stat().st_size == 0:
        raise DatasetError(f"{path}: empty file (0 bytes)")
    return pd


def read_frame(kind: str, path: Path) -> Any:
    """The whole ``csv`` or ``parquet`` file at ``path`` as a data frame (Parquet through
    pyarrow); an empty or unreadable file is a :class:`DatasetError` naming it."""
    pd = _pandas(kind, path)
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


def frame_chunks(kind: str, path: Path, rows: int | None = None) -> Iterator[Any]:
    """The ``csv`` or ``parquet`` file at ``path`` as data frames of at most ``rows`` rows
    (default :data:`CHUNK_ROWS`), in order: :func:`read_frame`'s rules with a bounded memory
    (a CSV column's type is inferred per chunk, so a column that is not numeric somewhere
    is so in some chunk)."""
    rows = rows or CHUNK_ROWS
    pd = _pandas(kind, path)
    seen = 0
    try:
        if kind == "csv":
            chunks: Any = pd.read_csv(path, chunksize=rows)
        else:
            import pyarrow.parquet as pq

            chunks = (b.to_pandas() for b in pq.ParquetFile(path).iter_batches(batch_size=rows))
        for df in chunks:
            seen += len(df)
            yield df
    except pd.errors.EmptyDataError:
        raise DatasetError(f"{path}: empty file (no columns, no rows)") from None
    except DatasetError:
        raise
    except Exception as exc:  # a parser's or pyarrow's error: the file is not what it says
        raise DatasetError(f"{path}: cannot be read as {kind}: {describe(exc)}") from None
    if seen == 0:
        raise DatasetError(f"{path}: empty file (no rows)")


def columns_text(columns: Sequence[Any]) -> str:
    """Up to 20 column names, comma-separated (and how many in all beyond that)."""
    cols = [str(c) for c in columns]
    return ", ".join(cols[:20]) + (f", … ({len(cols)} in all)" if len(cols) > 20 else "")


def label_columns(label: str | list[str]) -> list[str]:
    """``dataset.label`` as a list of columns (one, or the columns of value labels)."""
    return [label] if isinstance(label, str) else list(label)


def frame_columns(
    df: Any, label: str | list[str], path: Path, features: list[str] | None
) -> list[str]:
    """The feature columns of a data frame (every column but the label column(s);
    ``features``: the train file's, which another file of the node must have), checked
    numeric (bool, int or float); a :class:`DatasetError` otherwise (on ``dataset.label``
    for a missing label column, with the columns there and the nearest names)."""
    from pandas.api import types as pt

    columns = [str(c) for c in df.columns]
    labels = label_columns(label)
    for name in labels:
        if name not in columns:
            hint = did_you_mean(name, columns)
            raise DatasetError(
                f"{path}: no label column {name!r} (its columns: {columns_text(columns)}"
                + (f"; {hint})" if hint else ")"),
                field="dataset.label",
            )
    df.columns = columns
    mine = [c for c in columns if c not in labels]
    if features is None:
        features = mine
        if not features:
            raise DatasetError(f"{path}: no feature columns beside the label column {label!r}")
    elif set(mine) != set(features):
        missing = [c for c in features if c not in mine]
        extra = [c for c in mine if c not in features]
        raise DatasetError(
            f"{path}: its feature columns differ from the train file's"
            + (f"; missing: {columns_text(missing)}" if missing else "")
            + (f"; not in the train file: {columns_text(extra)}" if extra else "")
        )
    for col in features:
        s = df[col]
        if not (pt.is_bool_dtype(s) or pt.is_integer_dtype(s) or pt.is_float_dtype(s)):
            raise DatasetError(
                f"{path}: column {col!r} is not numeric ({s.dtype}): every column but the "
                f"label {label!r} is a feature and must be a number (bool, int or float)"
            )
    return features


def nonfinite(x: np.ndarray) -> tuple[np.ndarray, int]:
    """``(columns with a NaN or infinite value, as a bool mask; rows with one)`` of ``x``."""
    bad = ~np.isfinite(x)
    return bad.any(axis=0), int(bad.any(axis=1).sum())


def nonfinite_error(path: Path, columns: Sequence[str], rows: int) -> DatasetError:
    return DatasetError(
        f"{path}: missing (NaN) or infinite values in column(s) {columns_text(columns)} "
        f"({rows} row(s))"
    )


def frame_xy(
    df: Any, label: str | list[str], path: Path, features: list[str] | None
) -> tuple[Any, ...]:
    """``(x float64 N x D, raw labels, feature names)`` of a data frame, checked
    (:func:`frame_columns`, then every feature value finite); the raw labels of a list of
    label columns are their ``N x k`` array."""
    features = frame_columns(df, label, path, features)
    x = df[features].to_numpy(dtype=np.float64, na_value=np.nan)
    cols, rows = nonfinite(x)
    if rows:
        raise nonfinite_error(path, [features[j] for j in np.flatnonzero(cols)], rows)
    return x, df[label].to_numpy(), features


def value_labels(raw: Any, label: str | list[str], path: Path) -> np.ndarray:
    """Labels that are values (``dataset.targets: values``): float32 ``N`` (one column) or
    ``N x k``; a :class:`DatasetError` on ``dataset.label`` naming the column that is not a
    finite number."""
    columns = label_columns(label)
    try:
        y = np.asarray(raw, dtype=np.float64)
    except (TypeError, ValueError):
        raise DatasetError(
            f"{path}: label column(s) {columns_text(columns)} must hold numbers "
            "(dataset.targets: values)",
            field="dataset.label",
        ) from None
    bad = ~np.isfinite(y.reshape(len(y), -1))
    if bad.any():
        named = [columns[j] for j in np.flatnonzero(bad.any(axis=0))]
        raise DatasetError(
            f"{path}: missing (NaN) or infinite labels in column(s) {columns_text(named)} "
            f"({int(bad.any(axis=1).sum())} row(s))",
            field="dataset.label",
        )
    return y.astype(np.float32)


def read_stats(stats: str, node_id: str, features: list[str]) -> tuple[np.ndarray, np.ndarray]:
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
                f"{path}: no {key} for column(s) {columns_text(missing)}", field="dataset.stats"
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


# ----------------------------------------------------------------------------- arrays


def float_inputs(x: Any, where: str, may_be_empty: bool = False) -> tuple[np.ndarray, bool]:
    """``x`` (a numpy array) as float32 (uint8 divided by 255: then ``True``), checked
    numeric, with samples, and finite."""
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


def four_arrays(
    parts: Sequence[Any], names: list[str], where: str, counted: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, bool]:
    """``(x, y, x_test, y_test, scaled)`` of numpy ``(x_train, y_train, x_test, y_test)``:
    inputs as float32 (:func:`float_inputs`), labels as indices into ``names``, as many
    labels as inputs, train and test samples of one shape."""
    x, scaled = float_inputs(parts[0], f"{where}: x_train")
    tx, _ = float_inputs(parts[2], f"{where}: x_test", may_be_empty=True)
    ys = []
    for key, raw in (("y_train", parts[1]), ("y_test", parts[3])):
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
    return x, y, tx, ty, scaled


def load_npz(path: Path) -> list[np.ndarray]:
    """The arrays :data:`NPZ_KEYS` of the ``.npz`` file at ``path`` (no pickles), or a
    :class:`DatasetError` naming it and what is missing."""
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
            return [z[k] for k in NPZ_KEYS]
    except DatasetError:
        raise
    except Exception as exc:  # not a zip, a truncated one, object arrays (pickles)
        raise DatasetError(f"{path}: not a readable .npz: {describe(exc)}") from None


__all__ = [
    "CHUNK_ROWS",
    "NPZ_KEYS",
    "DatasetError",
    "class_folders",
    "classes_text",
    "columns_text",
    "float_inputs",
    "four_arrays",
    "frame_chunks",
    "frame_columns",
    "frame_xy",
    "label_columns",
    "label_indices",
    "labels_error",
    "load_npz",
    "map_labels",
    "nonfinite",
    "nonfinite_error",
    "own_files",
    "value_labels",
    "read_frame",
    "read_stats",
    "swarm_classes",
]
