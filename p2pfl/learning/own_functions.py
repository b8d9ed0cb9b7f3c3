"""A user's dataset function, ``dataset.name: "package.module:function"``, under
``dataset.partition: none``.

Contract (:func:`read_function`): the function is called as ``fn(node_id=..., root=...)``
and returns four arrays ``(x_train, y_train, x_test, y_test)`` (numpy or torch; checked as
an ``.npz`` is) or two map-style torch Datasets ``(train, test)`` of ``(x, y)`` items. A
Dataset is never loaded whole: it is wrapped (:class:`LabelledDataset`) and read item by
item through a DataLoader while training; its labels are read once, from a ``targets``
attribute or item by item, and mapped into ``dataset.classes``. An import that fails, an
exception inside the function, or output of another shape is a
:class:`~p2pfl.learning.arrays.DatasetError` on ``dataset.name`` naming the function.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch

from p2pfl.config.schema import DatasetConfig
from p2pfl.learning.arrays import DatasetError, NodeData, array_spec
from p2pfl.learning.own_data import from_four_arrays, map_labels, node_data, swarm_classes
from p2pfl.learning.user_code import UserCodeError, describe, import_object


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
            return from_four_arrays(out, names, where, counted, path)
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
        return node_data(
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


__all__ = ["LabelledDataset", "as_input", "read_function"]
