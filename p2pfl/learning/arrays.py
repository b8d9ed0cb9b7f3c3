"""The containers of data: a whole dataset as numpy arrays (:class:`DatasetArrays`) and one
node's train and test splits ready for training (:class:`NodeData`), and the error a reader
raises on files it cannot use (:class:`DatasetError`).

Contract: :meth:`DatasetArrays.to_tensor` converts only the rows asked for to float32
(uint8 images: ``(x / 255 - mean) / std`` per channel). :class:`NodeData` holds either
tensors (``train_x`` / ``test_x``) or map-style torch Datasets read item by item
(``train_set`` / ``test_set``, the inputs then ``None``); its labels are always int64 tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from p2pfl.learning.own_rules import DatasetError as DatasetError  # raised by every reader


def readonly(a: np.ndarray) -> np.ndarray:
    """``a``, marked read-only (arrays shared by every node of a process)."""
    a.flags.writeable = False
    return a


def label_hist(y: torch.Tensor | np.ndarray, num_classes: int) -> list[int]:
    """The label histogram of ``y`` (int labels in ``[0, num_classes)``), as a list."""
    arr = y.numpy() if isinstance(y, torch.Tensor) else np.asarray(y)
    return [int(v) for v in np.bincount(arr.astype(np.int64), minlength=num_classes)]


def image_spec(
    input_shape: tuple[int, ...], mean: tuple[float, ...], std: tuple[float, ...]
) -> dict[str, Any]:
    """The :attr:`NodeData.input_spec` of ``C x H x W`` images normalised as
    ``(x / 255 - mean) / std`` per channel."""
    return {
        "kind": "image",
        "channels": int(input_shape[0]),
        "size": [int(v) for v in input_shape[1:]],
        "mean": [float(v) for v in mean],
        "std": [float(v) for v in std],
    }


def array_spec(input_shape: tuple[int, ...]) -> dict[str, Any]:
    """The :attr:`NodeData.input_spec` of inputs used as given (float32 of ``input_shape``)."""
    return {"kind": "array", "shape": [int(v) for v in input_shape]}


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

    @property
    def input_spec(self) -> dict[str, Any]:
        """What turns a raw input into a model input (:attr:`NodeData.input_spec`)."""
        if self.mean is None or self.std is None:
            return array_spec(self.input_shape)
        return image_spec(self.input_shape, self.mean, self.std)


@dataclass
class NodeData:
    """One node's data: its train split and its test split, ready for training.

    The inputs are either float32 tensors (``train_x`` / ``test_x``: ``N x C x H x W``
    normalized, or ``N x D``) or, for a user's datasets read item by item, map-style torch
    Datasets of ``(x, y)`` items (``train_set`` / ``test_set``; ``train_x`` / ``test_x`` are
    then ``None``). ``train_y`` / ``test_y`` always hold the int64 labels.

    ``classes``: the label names (index = label); ``source``: the file or directory read (or
    the dataset function); ``input_spec``: JSON-able, what turns a raw input into a model
    input: ``{"kind": "tabular", "features", "label", "mean", "std"}`` (columns in order,
    ``(x - mean) / std`` per feature), ``{"kind": "image", "channels", "size", "mean",
    "std"}`` (pixels ``/ 255`` then ``(x - mean) / std`` per channel) or ``{"kind": "array",
    "shape"}`` (used as given; ``"scale": 255`` when uint8 inputs are divided by it)."""

    train_x: torch.Tensor | None  # float32, N x C x H x W (normalized), or N x D
    train_y: torch.Tensor  # int64
    test_x: torch.Tensor | None
    test_y: torch.Tensor
    num_classes: int
    input_shape: tuple[int, ...]
    train_hist: list[int]  # label histogram of this node's train split, length num_classes
    test_hist: list[int]
    train_set: torch.utils.data.Dataset | None = None
    test_set: torch.utils.data.Dataset | None = None
    classes: list[str] = field(default_factory=list)
    source: str = ""
    input_spec: dict[str, Any] = field(default_factory=dict)

    @property
    def train_inputs(self) -> torch.Tensor | torch.utils.data.Dataset:
        """What :func:`p2pfl.learning.train.train_local` takes: ``train_set``, else
        ``train_x``."""
        return self.train_set if self.train_set is not None else self.train_x  # type: ignore[return-value]

    @property
    def test_inputs(self) -> torch.Tensor | torch.utils.data.Dataset:
        """What :func:`p2pfl.learning.train.evaluate` takes: ``test_set``, else ``test_x``."""
        return self.test_set if self.test_set is not None else self.test_x  # type: ignore[return-value]


__all__ = [
    "DatasetArrays",
    "DatasetError",
    "NodeData",
    "array_spec",
    "image_spec",
    "label_hist",
    "readonly",
]
