"""A model's layout: its tensors' names, shapes and dtypes, with its input shape and class
count, as a compact description every node announces in its presence (docs/wire.md,
"Model layout").

Two nodes can exchange weights only when their layouts are equal. A neighbour whose layout
differs is refused before any weight moves (:func:`layout_difference` says how, in words a
user can act on: the first tensor, the input shape or the class count that differs).
Untrusted input (a peer's presence) is checked by :func:`parse_layout` and never raises.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch

MAX_TENSORS = 100_000  # a presence announcing more is malformed


def tensor_specs(state: Mapping[str, torch.Tensor]) -> list[list[Any]]:
    """``[[name, shape, dtype], ...]`` of the tensors of ``state``, in its order, as JSON
    and msgpack carry it; dtypes as torch spells them without ``torch.`` (``float32``)."""
    return [
        [k, [int(d) for d in v.shape], str(v.dtype).removeprefix("torch.")]
        for k, v in state.items()
    ]


def describe_layout(
    state: Mapping[str, torch.Tensor], input_shape: tuple[int, ...], num_classes: int
) -> dict[str, Any]:
    """What a presence carries: ``{"fp": 16 hex digits, "input_shape", "num_classes",
    "tensors": [[name, shape, dtype], ...]}``; ``fp`` is a hash of the rest."""
    body = {
        "input_shape": [int(v) for v in input_shape],
        "num_classes": int(num_classes),
        "tensors": tensor_specs(state),
    }
    return {"fp": _fingerprint(body), **body}


def _fingerprint(layout: Mapping[str, Any]) -> str:
    """16 hex digits of SHA-256 over the layout but its ``fp``, tensors sorted by name (a
    state's order carries no meaning)."""
    keyed = {
        "input_shape": list(layout["input_shape"]),
        "num_classes": layout["num_classes"],
        "tensors": sorted(layout["tensors"]),
    }
    return hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:16]


def valid_tensor_specs(value: Any) -> bool:
    """Whether untrusted ``value`` is a :func:`tensor_specs` list: ``[name, [ints], dtype]``
    entries, at most :data:`MAX_TENSORS` of them."""
    return (
        isinstance(value, list)
        and len(value) <= MAX_TENSORS
        and all(
            isinstance(t, list)
            and len(t) == 3
            and isinstance(t[0], str)
            and isinstance(t[1], list)
            and all(isinstance(d, int) and not isinstance(d, bool) for d in t[1])
            and isinstance(t[2], str)
            for t in value
        )
    )


def compact_layout(layout: Mapping[str, Any]) -> dict[str, Any]:
    """What a protocol 4 presence carries: the layout without its tensor list
    (``{fp, input_shape, num_classes}``); a peer whose ``fp`` differs asks for the list
    (``layout_req``) to name the first difference."""
    return {k: layout[k] for k in ("fp", "input_shape", "num_classes")}


def parse_layout(value: Any, *, compact: bool = False) -> dict[str, Any] | None:
    """A peer's announced layout with its fields checked, or None when malformed; with
    ``compact``, one without its tensor list is taken too (:func:`compact_layout`)."""
    if not isinstance(value, Mapping):
        return None
    fp, shape, classes, tensors = (
        value.get(k) for k in ("fp", "input_shape", "num_classes", "tensors")
    )
    if not isinstance(fp, str) or not isinstance(shape, list):
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in shape):
        return None
    if not isinstance(classes, int) or isinstance(classes, bool):
        return None
    if compact and "tensors" not in value:
        return {"fp": fp, "input_shape": shape, "num_classes": classes}
    if not valid_tensor_specs(tensors):
        return None
    return {"fp": fp, "input_shape": shape, "num_classes": classes, "tensors": tensors}


def fingerprint_holds(layout: Mapping[str, Any]) -> bool:
    """Whether a whole parsed ``layout``'s ``fp`` is the hash of the rest
    (:func:`describe_layout`)."""
    return _fingerprint(layout) == layout["fp"]


def summary(layout: Mapping[str, Any]) -> str:
    """One line: fingerprint, input shape, classes, tensor and parameter counts (a compact
    layout, :func:`compact_layout`, has no counts)."""
    if "tensors" not in layout:
        return (
            f"{layout['fp']} (input {list(layout['input_shape'])}, {layout['num_classes']} classes)"
        )
    tensors = layout["tensors"]
    numel = 0
    for _, shape, _ in tensors:
        n = 1
        for d in shape:
            n *= d
        numel += n
    return (
        f"{layout['fp']} (input {list(layout['input_shape'])}, {layout['num_classes']} classes, "
        f"{len(tensors)} tensors, {numel:,} values)"
    )


def layout_difference(mine: Mapping[str, Any], theirs: Mapping[str, Any]) -> str | None:
    """None when the two layouts are equal; otherwise the first difference, in words:
    the input shape, the class count, or the first tensor (in this node's order) that is
    missing, extra, or of another shape or dtype (``theirs`` compact: "the tensors
    differ")."""
    if mine["fp"] == theirs["fp"]:
        return None
    if list(mine["input_shape"]) != list(theirs["input_shape"]):
        return f"input shape {list(mine['input_shape'])} here, {list(theirs['input_shape'])} there"
    if mine["num_classes"] != theirs["num_classes"]:
        return f"{mine['num_classes']} classes here, {theirs['num_classes']} there"
    if "tensors" not in theirs:  # compact: the list is asked for
        return "the tensors differ"
    their = {t[0]: t for t in theirs["tensors"]}
    for name, shape, dtype in mine["tensors"]:
        other = their.get(name)
        if other is None:
            return f"tensor {name!r} {list(shape)} {dtype} here, absent there"
        if list(other[1]) != list(shape) or other[2] != dtype:
            return f"tensor {name!r}: {list(shape)} {dtype} here, {list(other[1])} {other[2]} there"
    mine_names = {t[0] for t in mine["tensors"]}
    for name, shape, dtype in theirs["tensors"]:
        if name not in mine_names:
            return f"tensor {name!r} {list(shape)} {dtype} there, absent here"
    return "the fingerprints differ"
