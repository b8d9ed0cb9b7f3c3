"""Classify new data with a node's trained model: :func:`predict`, :func:`classify`.

The node's ``model.json`` says how its inputs were made (``input_spec``,
:mod:`p2pfl.learning.artifacts`), and the same is done to the new data:

* a CSV (or Parquet) file, for tabular data: the columns ``input_spec.features``, each
  normalised with its ``mean``/``std`` (a missing value becomes the feature's mean); the
  label column ``input_spec.label``, when the file has it, is not read for predicting but
  gives the accuracy. Labels are class names, or their indices;
* a folder of images (every image file under it, recursively) or one image file, for image
  data: converted to the model's channels (grey or RGB) and size (bilinear, as the training
  data was), scaled to [0, 1] and normalised per channel. An image in a sub-folder named
  after a class (the ImageFolder layout) counts towards the accuracy;
* a ``.npy`` array of inputs shaped as the model takes them, used as given (uint8 arrays
  divided by ``input_spec.scale`` where the spec has one, as the dataset did).

The predictions are one CSV row per input: ``row`` (CSV, 0-based) or ``file`` (relative to
the folder), ``predicted`` (the class index), ``label`` (its name) and ``p_<class>``, the
probability of each class (the softmax of the logits; for a model of one logit,
``training.loss: bce``, the sigmoid is the probability of class 1). A model of values
(``dataset.targets: values``: regression, a risk score) gives ``predicted`` (one output) or
``predicted_<i>`` (several), its outputs as they are.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from p2pfl.export.model import load_model_with_info
from p2pfl.files import atomic_path
from p2pfl.learning.artifacts import ExportError, info_path
from p2pfl.learning.readers import IMAGE_EXTENSIONS
from p2pfl.learning.task import class_probabilities

TABLE_SUFFIXES = (".csv", ".tsv", ".txt", ".parquet", ".pq")
BATCH = 256


@dataclass
class Predictions:
    """What :func:`classify` wrote: the CSV, how many inputs, and the accuracy over the
    inputs that had a label (None when none had)."""

    path: Path
    rows: int
    labelled: int = 0
    accuracy: float | None = None


def predict(
    run_dir: str | Path, node_id: str, input_path: str | Path, out_path: str | Path | None = None
) -> Path:
    """Classify ``input_path`` (a CSV file, an image folder, an image, a ``.npy`` array)
    with node ``node_id``'s trained model from ``run_dir``; write the predictions to
    ``out_path`` (default ``predictions-<node>.csv`` in the current directory) and return
    its path. :class:`~p2pfl.learning.artifacts.ExportError` names the file and what is
    wrong (a missing feature column, an unreadable image, inputs of another kind)."""
    return classify(run_dir, node_id, input_path, out_path).path


def classify(
    run_dir: str | Path, node_id: str, input_path: str | Path, out_path: str | Path | None = None
) -> Predictions:
    """:func:`predict`, returning also how many inputs there were and the accuracy."""
    src = Path(input_path)
    if not src.exists():
        raise ExportError(f"{src}: no such file or folder")
    model = Classifier.load(run_dir, node_id)
    spec, kind, info = model.spec, model.kind, model.info
    suffix = src.suffix.lower()
    if not spec and suffix != ".npy":
        raise ExportError(
            f"{info_path(run_dir, node_id)}: no input_spec (how the node's inputs were made): "
            "predict cannot prepare CSV files or images for this model; give a .npy array of "
            "inputs shaped and normalised as the model takes them"
        )
    if src.is_dir() or suffix in IMAGE_EXTENSIONS:
        inputs = _image_inputs(src, spec, info)
    elif suffix == ".npy":
        inputs = _array_inputs(src, spec, info)
    elif suffix in TABLE_SUFFIXES:
        if kind != "tabular":
            raise ExportError(
                f"{src}: node {node_id!r}'s model was not trained on tabular data "
                f"(input_spec kind {kind!r}); give {_wanted(kind)}"
            )
        inputs = table_inputs(_read_table(src), spec, info, str(src))
    else:
        raise ExportError(
            f"{src}: not a CSV / Parquet file, an image folder, an image or a .npy array"
        )
    names, x_batches, labels = inputs
    out = Path(out_path) if out_path is not None else Path.cwd() / f"predictions-{node_id}.csv"
    if model.values:  # regression, a risk score: the outputs, no class
        outputs = model.probabilities(x_batches)
        _write_values_csv(out, names, outputs)
        return Predictions(path=out, rows=len(outputs))
    p = model.probabilities(x_batches)
    pred = p.argmax(axis=1)
    classes = model.classes
    _write_csv(out, names, pred, p, classes)
    result = Predictions(path=out, rows=len(pred))
    if labels is not None:
        idx = [_label_index(v, classes) for v in labels]
        known = [(i, int(k)) for i, k in zip(idx, pred, strict=True) if i is not None]
        if known:
            result.labelled = len(known)
            result.accuracy = sum(i == k for i, k in known) / len(known)
    return result


class Classifier:
    """A node's trained model, loaded once, and how its inputs are made (``input_spec``):
    :func:`classify` and the serving endpoint (:mod:`p2pfl.sites.models.serving`) both answer
    through it, so the same rows give the same classes and probabilities."""

    def __init__(self, module: torch.nn.Module, info: dict[str, Any]):
        self.module = module
        self.info = info
        self.classes: list[str] = info["classes"] or [str(i) for i in range(info["num_classes"])]
        self.spec: dict[str, Any] = info.get("input_spec") or {}
        self.kind: str | None = self.spec.get("kind")
        self.values = info.get("targets") == "values"  # outputs are values, not classes
        self.runtime = "torch"
        self._forward: Any = None  # onnxruntime's (use_onnx); None: the torch module's

    @classmethod
    def load(cls, run_dir: str | Path, node_id: str) -> Classifier:
        return cls(*load_model_with_info(run_dir, node_id))

    def use_onnx(self, where: str) -> None:
        """Answer through the model exported to ONNX and run by onnxruntime
        (:class:`~p2pfl.export.onnx_forward.OnnxForward`) instead of the torch module; the
        same logits to float32 rounding, read as classes the same way. ``where`` names the
        model in the :class:`ExportError` of a model the exporter cannot trace."""
        from p2pfl.export.model import onnx_bytes
        from p2pfl.export.onnx_forward import OnnxForward

        forward = OnnxForward(onnx_bytes(self.module, self.info, where))
        # onnxruntime's first run prepares its kernels (half a second here): before the
        # model answers, not on its first request
        forward(np.zeros((1, *self.info["input_shape"]), dtype=np.float32))
        self._forward = forward
        self.runtime = "onnxruntime"

    def probabilities(self, x_batches: Iterable[np.ndarray]) -> np.ndarray:
        """The probability of each class for each input (float32, one row each): the
        softmax of the logits, ``[1 − σ(z), σ(z)]`` for one logit; a model of values gives
        its outputs as they are (:attr:`values`)."""
        probs: list[np.ndarray] = []
        with torch.no_grad():
            for x in x_batches:
                if self._forward is not None:
                    out = torch.from_numpy(self._forward(x))
                else:
                    out = self.module(torch.as_tensor(x, dtype=torch.float32)).float()
                if self.values:
                    probs.append(out.reshape(len(out), -1).numpy())
                else:
                    probs.append(class_probabilities(out).numpy())
        if not probs:
            return np.zeros((0, len(self.classes)), dtype=np.float32)
        return np.concatenate(probs)

    def table(self, df: Any, where: str, missing: str = "impute") -> np.ndarray:
        """The probabilities for the rows of DataFrame ``df`` (the model's feature columns,
        named as in its data; other columns ignored); ``where`` names the rows in errors;
        ``missing``: as :func:`table_inputs` takes it."""
        self._check_kind("tabular", where)
        _, batches, _ = table_inputs(df, self.spec, self.info, where, missing)
        return self.probabilities(batches)

    def records(
        self, records: list[dict[str, Any]], where: str, missing: str = "impute"
    ) -> tuple[np.ndarray, list[str]]:
        """:meth:`table` for JSON records (:func:`records_array`: the same inputs, without a
        DataFrame): (the probabilities, the record keys that are not feature columns)."""
        self._check_kind("tabular", where)
        arr, ignored = records_array(records, feature_columns(self.spec, self.info), where)
        x = model_inputs(arr, self.spec, self.info, where, missing)
        return self.probabilities(_chunks(x)), ignored

    def images(self, blobs: list[bytes], where: str) -> np.ndarray:
        """The probabilities for images given as their files' bytes (PNG, JPEG, ...)."""
        self._check_kind("image", where)
        return self.probabilities(image_batches(blobs, self.spec, self.info, where))

    def _check_kind(self, kind: str, where: str) -> None:
        """An :class:`ExportError` unless the model was trained on ``kind`` inputs."""
        if self.kind != kind:
            data = {"tabular": "tabular data", "image": "images"}[kind]
            raise ExportError(
                f"{where}: the model was not trained on {data} "
                f"(input_spec kind {self.kind!r}); give {_wanted(self.kind)}"
            )


def _wanted(kind: str | None) -> str:
    return {
        "image": "an image folder or an image",
        "tabular": "a CSV or Parquet file",
    }.get(kind or "", "a .npy array of inputs shaped and normalised as the model's")


# ----------------------------------------------------------------------------- tables


def _read_table(path: Path):
    import pandas as pd

    try:
        if path.suffix.lower() in (".parquet", ".pq"):
            return pd.read_parquet(path)
        return pd.read_csv(path, sep="\t" if path.suffix.lower() == ".tsv" else ",")
    except ImportError as exc:
        raise ExportError(f"{path}: cannot be read: {exc}") from None
    except (OSError, ValueError, pd.errors.ParserError) as exc:
        raise ExportError(f"{path}: not a readable table: {exc}") from None


def table_inputs(
    df: Any, spec: dict[str, Any], info: dict[str, Any], where: str, missing: str = "impute"
):
    """The model's inputs from DataFrame ``df``: (row names, input batches, labels or None).
    A missing value (an empty cell, a ``null``) is the training mean of its column under
    ``missing="impute"``; ``"refuse"`` raises an :class:`ExportError` naming its column and
    row (0-based) instead."""
    import pandas as pd

    features = feature_columns(spec, info)
    columns = [str(c) for c in df.columns]
    df.columns = columns
    _require_columns(features, set(columns), where)
    if all(pd.api.types.is_numeric_dtype(df[f]) for f in features):
        arr = df[features].to_numpy(dtype=np.float64)  # what to_numeric would give, sooner
    else:
        x = df[features].apply(pd.to_numeric, errors="coerce")
        bad = [f for f in features if (x[f].isna() & df[f].notna()).any()]
        if bad:
            raise ExportError(f"{where}: column(s) {', '.join(map(repr, bad))} hold non-numbers")
        arr = x.to_numpy(dtype=np.float64)
    arr = model_inputs(arr, spec, info, where, missing)
    label = spec.get("label")
    labels = df[label].tolist() if isinstance(label, str) and label in columns else None
    names = {"row": list(range(len(arr)))}
    return names, _chunks(arr), labels


def feature_columns(spec: dict[str, Any], info: dict[str, Any]) -> list[str]:
    """The feature columns the model reads (``input_spec.features``, in its order)."""
    features = spec.get("features")
    if not isinstance(features, list) or not features:
        raise ExportError(f"node {info['node']}: input_spec has no feature columns")
    return features


def _require_columns(features: list[str], present: set[str], where: str) -> None:
    """An :class:`ExportError` naming the feature columns ``present`` lacks."""
    absent = [f for f in features if f not in present]
    if absent:
        raise ExportError(
            f"{where}: missing feature column(s) {', '.join(map(repr, absent))} "
            f"(the model reads {', '.join(features)})"
        )


def model_inputs(
    arr: np.ndarray, spec: dict[str, Any], info: dict[str, Any], where: str, missing: str
) -> np.ndarray:
    """The model's input array from ``arr`` (float64, one row an input, one column a feature
    in ``spec["features"]``'s order, NaN where a value is missing): each column normalised
    with its training ``mean``/``std``, shaped as the model takes it. ``missing``: as
    :func:`table_inputs` takes it."""
    features = spec["features"]
    if missing == "refuse" and np.isnan(arr).any():
        row, col = (int(i) for i in np.argwhere(np.isnan(arr))[0])
        count = int(np.isnan(arr).sum())
        raise ExportError(
            f"{where}: column {features[col]!r} has no value at row {row} ({count} missing in "
            "all); missing values are refused, not guessed (serving.missing: impute fills "
            "them with the training mean)"
        )
    n_feat = len(features)
    mean = _vector(spec.get("mean"), n_feat, 0.0, "mean", info)
    std = _vector(spec.get("std"), n_feat, 1.0, "std", info)
    std = np.where(std > 0, std, 1.0)
    arr = np.nan_to_num((arr - mean) / std, nan=0.0).astype(np.float32)
    shape = tuple(info["input_shape"])
    if math.prod(shape) != n_feat:
        raise ExportError(
            f"node {info['node']}: {n_feat} features do not fit input shape {list(shape)}"
        )
    return arr.reshape(len(arr), *shape)


def records_array(
    records: list[dict[str, Any]], features: list[str], where: str
) -> tuple[np.ndarray, list[str]]:
    """JSON records (``{column: value}``) as :func:`table_inputs` reads a DataFrame of them,
    without building one (a served request is often one record): (float64 ``[rows,
    features]``, NaN for a ``null`` or a key a record lacks; the other keys, sorted). A value
    that is no number (a list, a word, the string ``"nan"``) is an :class:`ExportError`
    naming its column, as is a feature no record has."""
    present: set[str] = set()
    for record in records:
        present.update(record)
    _require_columns(features, present, where)
    arr = np.empty((len(records), len(features)))
    bad: set[int] = set()
    for i, record in enumerate(records):
        for j, feature in enumerate(features):
            value = record.get(feature)
            if value is None:
                arr[i, j] = math.nan
                continue
            try:
                number = float(value)
            except (TypeError, ValueError, OverflowError):
                bad.add(j)
                continue
            if isinstance(value, str) and math.isnan(number):
                bad.add(j)  # a word that reads as NaN is not a missing value
            arr[i, j] = number
    if bad:
        names = [features[j] for j in sorted(bad)]
        raise ExportError(f"{where}: column(s) {', '.join(map(repr, names))} hold non-numbers")
    return arr, sorted(str(k) for k in present - set(features))


def _vector(values: Any, n: int, default: float, field: str, info: dict[str, Any]) -> np.ndarray:
    if values is None:
        return np.full(n, default)
    try:
        vec = np.asarray(values, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        vec = np.empty(0)
    if len(vec) == 1:
        vec = np.full(n, float(vec[0]))
    if len(vec) != n:
        raise ExportError(f"node {info['node']}: input_spec.{field} does not have {n} values")
    return vec


def _chunks(arr: np.ndarray) -> Iterator[np.ndarray]:
    for i in range(0, len(arr), BATCH):
        yield arr[i : i + BATCH]


def _label_index(value: Any, classes: list[str]) -> int | None:
    """The class index of a label (a class name, or its index); None for a missing label,
    -1 for a label that is not one of the model's classes."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    text = str(value).strip()
    if text in classes:
        return classes.index(text)
    try:
        num = float(text)
    except ValueError:
        return -1
    if num.is_integer() and 0 <= int(num) < len(classes):
        return int(num)
    return -1


# ----------------------------------------------------------------------------- images


def _image_inputs(src: Path, spec: dict[str, Any], info: dict[str, Any]):
    _image_layout(spec, info, str(src))
    if src.is_dir():
        files = sorted(
            p
            for p in src.rglob("*")
            if p.is_file()
            and p.suffix.lower() in IMAGE_EXTENSIONS
            and not any(part.startswith(".") for part in p.relative_to(src).parts)
        )
        if not files:
            raise ExportError(f"{src}: no image files ({', '.join(IMAGE_EXTENSIONS)}) under it")
        rel = [p.relative_to(src) for p in files]
    else:
        files, rel = [src], [Path(src.name)]
    classes = info["classes"] or [str(i) for i in range(info["num_classes"])]
    labels = [r.parts[0] if len(r.parts) > 1 and r.parts[0] in classes else None for r in rel]
    names = {"file": [r.as_posix() for r in rel]}
    batches = image_batches(files, spec, info, str(src))
    return names, batches, labels if any(v is not None for v in labels) else None


def _image_layout(spec: dict[str, Any], info: dict[str, Any], where: str) -> tuple[int, int, int]:
    """(channels, height, width) of the model's images; an error for a model of no images."""
    if spec.get("kind") != "image":
        raise ExportError(
            f"{where}: node {info['node']}'s model was not trained on images "
            f"(input_spec kind {spec.get('kind')!r}); give {_wanted(spec.get('kind'))}"
        )
    channels = int(spec.get("channels", info["input_shape"][0]))
    if channels not in (1, 3):
        raise ExportError(f"node {info['node']}: images of {channels} channels are not read")
    size = spec.get("size") or info["input_shape"][1:]
    return channels, int(size[0]), int(size[1])


def image_batches(
    sources: list[Path] | list[bytes], spec: dict[str, Any], info: dict[str, Any], where: str
) -> Iterator[np.ndarray]:
    """The model's inputs from images (files, or their bytes): converted to its channels and
    size (bilinear), scaled to [0, 1] and normalised per channel, in batches."""
    channels, height, width = _image_layout(spec, info, where)
    mean = _vector(spec.get("mean"), channels, 0.0, "mean", info).reshape(channels, 1, 1)
    std = _vector(spec.get("std"), channels, 1.0, "std", info).reshape(channels, 1, 1)
    std = np.where(std > 0, std, 1.0)
    mode = "L" if channels == 1 else "RGB"
    for i in range(0, len(sources), BATCH):
        chunk = sources[i : i + BATCH]
        x = np.empty((len(chunk), channels, height, width), dtype=np.float32)
        for j, source in enumerate(chunk):
            name = str(source) if isinstance(source, Path) else f"{where}: image {i + j}"
            x[j] = _read_image(source, mode, width, height, name)
        yield ((x / 255.0 - mean) / std).astype(np.float32)


def _read_image(source: Path | bytes, mode: str, width: int, height: int, name: str) -> np.ndarray:
    from PIL import Image

    try:
        with Image.open(source if isinstance(source, Path) else io.BytesIO(source)) as img:
            img = img.convert(mode)
            if img.size != (width, height):
                img = img.resize((width, height), Image.BILINEAR)
            arr = np.asarray(img, dtype=np.float32)
    except (OSError, ValueError) as exc:  # PIL's UnidentifiedImageError is an OSError
        raise ExportError(f"{name}: not a readable image: {exc}") from None
    return arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)


# ----------------------------------------------------------------------------- arrays


def _array_inputs(src: Path, spec: dict[str, Any], info: dict[str, Any]):
    try:
        arr = np.load(src, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ExportError(f"{src}: not a readable .npy array: {exc}") from None
    shape = tuple(info["input_shape"])
    if tuple(arr.shape) == shape:
        arr = arr[None]
    if tuple(arr.shape[1:]) != shape:
        raise ExportError(
            f"{src}: arrays of shape {list(arr.shape)}; the model takes (N, {', '.join(map(str, shape))})"
        )
    scale = spec.get("scale") if spec.get("kind") == "array" else None
    if scale and arr.dtype == np.uint8:  # as the dataset did: uint8 inputs divided by it
        arr = arr.astype(np.float32) / float(scale)
    arr = np.asarray(arr, dtype=np.float32)
    return {"row": list(range(len(arr)))}, _chunks(arr), None


# ----------------------------------------------------------------------------- output


def _write_values_csv(out: Path, names: dict[str, list[Any]], outputs: np.ndarray) -> None:
    import pandas as pd

    columns: dict[str, Any] = dict(names)
    if outputs.shape[1] == 1:
        columns["predicted"] = outputs[:, 0]
    else:
        for i in range(outputs.shape[1]):
            columns[f"predicted_{i}"] = outputs[:, i]
    try:
        with atomic_path(out) as tmp:
            pd.DataFrame(columns).to_csv(tmp, index=False)
    except OSError as exc:
        raise ExportError(f"{out}: predictions not written: {exc}") from None


def _write_csv(
    out: Path, names: dict[str, list[Any]], pred: np.ndarray, probs: np.ndarray, classes: list[str]
) -> None:
    import pandas as pd

    columns: dict[str, Any] = dict(names)
    columns["predicted"] = pred.astype(np.int64)
    columns["label"] = [classes[int(k)] for k in pred]
    for c, name in enumerate(classes):
        columns[f"p_{name}"] = probs[:, c]
    df = pd.DataFrame(columns)
    try:
        with atomic_path(out) as tmp:
            df.to_csv(tmp, index=False)
    except OSError as exc:
        raise ExportError(f"{out}: predictions not written: {exc}") from None
