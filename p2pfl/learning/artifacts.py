"""A node's trained model as files other tools read (README.md, "Trained models").

When a node's rounds are done the daemon writes, beside its records:

``<run>/nodes/<id>.safetensors``
    the state_dict of the model the user takes away (:meth:`SplitModel.export_module`:
    the ``g``/``h`` model itself for a built-in model, the user's own module for a user
    model), under the module's own parameter names; ``safetensors.torch.load_file`` and
    ``module.load_state_dict`` read it as it is.
``<run>/nodes/<id>.model.json``
    what rebuilds the module and feeds it (:data:`FORMAT` 1)::

        {"node", "format", "model": <the model config: what shapes it>, "algorithm",
         "num_classes", "input_shape", "classes", "input_spec", "round",
         "layout": [[name, shape, dtype], ...], "buffers": {...}, "config": "config.yaml"}

    ``input_spec`` says how raw inputs become the model's (feature columns and their
    mean/std, or image channels, size and per-channel mean/std); ``buffers`` holds the
    module's small non-persistent buffers (not in a state_dict, but part of what the node
    predicts with, e.g. pFedC's mask of the classes a node predicts among); ``config`` is the
    run's resolved topology, relative to the run directory.

Both files are written atomically (a temporary file, then a rename). This module is pure:
no node, wire or config import; :mod:`p2pfl.export` rebuilds and reads models from these files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from p2pfl.errors import P2PFLError
from p2pfl.files import write_bytes_atomic
from p2pfl.learning.layout import tensor_specs, valid_tensor_specs

FORMAT = 1
MAX_BUFFER_VALUES = 65536  # non-persistent buffers larger than this are not recorded
_INFO_FIELDS = ("model", "algorithm", "num_classes", "input_shape", "round")


class ExportError(P2PFLError, ValueError):
    """A trained model that cannot be written, found, read or exported; the message names
    the file (or run directory) and what is wrong."""


def weights_path(run_dir: str | Path, node_id: str) -> Path:
    return Path(run_dir) / "nodes" / f"{node_id}.safetensors"


def info_path(run_dir: str | Path, node_id: str) -> Path:
    return Path(run_dir) / "nodes" / f"{node_id}.model.json"


def nodes_with_models(run_dir: str | Path) -> list[str]:
    """The ids of the nodes of ``run_dir`` that have both model files, sorted."""
    nodes = Path(run_dir) / "nodes"
    suffix = ".model.json"
    ids = (p.name[: -len(suffix)] for p in nodes.glob(f"*{suffix}") if not p.name.startswith("."))
    return sorted(i for i in ids if weights_path(run_dir, i).is_file())


def export_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state_dict as contiguous CPU tensors that share no memory (safetensors
    refuses shared storage: tied weights are saved once under each of their names)."""
    out: dict[str, torch.Tensor] = {}
    for name, value in module.state_dict().items():
        if not isinstance(value, torch.Tensor):
            raise ExportError(
                f"state_dict entry {name!r} is a {type(value).__name__}, not a tensor: "
                "safetensors stores tensors only"
            )
        out[name] = value.detach().to("cpu").contiguous().clone()
    return out


def extra_buffers(module: nn.Module) -> dict[str, dict[str, Any]]:
    """The module's non-persistent buffers (not in its state_dict) as JSON: ``{name: {"dtype",
    "shape", "values"}}``, for buffers of at most :data:`MAX_BUFFER_VALUES` values."""
    persistent = set(module.state_dict())
    out: dict[str, dict[str, Any]] = {}
    for name, buf in module.named_buffers():
        if name in persistent or buf is None or buf.numel() > MAX_BUFFER_VALUES:
            continue
        t = buf.detach().to("cpu")
        out[name] = {
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "values": t.flatten().tolist(),
        }
    return out


def restore_buffers(module: nn.Module, buffers: dict[str, Any], where: str) -> None:
    """Copy recorded non-persistent buffers (:func:`extra_buffers`) back into ``module``;
    one the module lacks, or of another shape, is an :class:`ExportError` naming ``where``."""
    own = dict(module.named_buffers())
    for name, spec in buffers.items():
        buf = own.get(name)
        try:
            dtype = getattr(torch, spec["dtype"])
            value = torch.tensor(spec["values"], dtype=dtype).reshape(spec["shape"])
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
            raise ExportError(f"{where}: buffers.{name}: malformed ({exc})") from None
        if buf is None or tuple(buf.shape) != tuple(value.shape):
            raise ExportError(f"{where}: buffers.{name}: the rebuilt model has no such buffer")
        with torch.no_grad():
            buf.copy_(value.to(dtype=buf.dtype, device=buf.device))


def write_model_artifacts(
    out_dir: str | Path, node_id: str, module: nn.Module, info: dict[str, Any]
) -> tuple[Path, Path]:
    """Write ``<out_dir>/nodes/<id>.safetensors`` (``module``'s state_dict) and
    ``<out_dir>/nodes/<id>.model.json`` (``info``: ``model``, ``algorithm``, ``num_classes``,
    ``input_shape``, ``round`` and, where known, ``classes`` and ``input_spec``; this adds
    ``node``, ``format``, ``layout``, ``buffers`` and ``config``). Returns both paths.
    ``OSError`` when the disk refuses (a previous pair stays whole)."""
    from safetensors.torch import save

    missing = [k for k in _INFO_FIELDS if k not in info]
    if missing:
        raise ExportError(f"node {node_id}: model info lacks {', '.join(missing)}")
    state = export_state(module)
    meta = {
        "node": node_id,
        "format": FORMAT,
        "model": info["model"],
        "algorithm": info["algorithm"],
        "num_classes": int(info["num_classes"]),
        "input_shape": [int(v) for v in info["input_shape"]],
        "classes": list(info["classes"]) if info.get("classes") else None,  # [] : unknown
        "input_spec": info.get("input_spec") or None,
        "round": int(info["round"]),
        "layout": tensor_specs(state),
        "buffers": extra_buffers(module),
        "config": "config.yaml",
    }
    weights, json_path = weights_path(out_dir, node_id), info_path(out_dir, node_id)
    validate_model_info(meta, json_path, node_id)  # never a file that would not read back
    text = json.dumps(meta, indent=2)

    try:
        packed = save(state, metadata={"node": node_id})  # safetensors' file, in memory
    except Exception as exc:
        raise OSError(f"{weights}: cannot be written: {exc}") from None
    write_bytes_atomic(weights, packed)
    write_bytes_atomic(json_path, text.encode())
    return weights, json_path


def _check(cond: bool, where: Path, field: str, what: str) -> None:
    if not cond:
        raise ExportError(f"{where}: field {field!r}: {what}")


def validate_model_info(meta: Any, where: Path, node_id: str | None = None) -> dict[str, Any]:
    """Check a model.json's fields; :class:`ExportError` naming ``where`` and the field."""
    _check(isinstance(meta, dict), where, "(top level)", "expected a JSON object")
    fmt = meta.get("format")
    _check(fmt == FORMAT, where, "format", f"{fmt!r} is not a p2pfl model format {FORMAT}")
    _check(isinstance(meta.get("node"), str), where, "node", "missing or not a string")
    if node_id is not None:
        _check(meta["node"] == node_id, where, "node", f"{meta['node']!r}, not {node_id!r}")
    model = meta.get("model")
    _check(
        isinstance(model, dict) and isinstance(model.get("name"), str),
        where,
        "model",
        "missing or not a model config with a name",
    )
    _check(isinstance(meta.get("algorithm"), str), where, "algorithm", "missing or not a string")
    n = meta.get("num_classes")
    _check(isinstance(n, int) and not isinstance(n, bool) and n >= 1, where, "num_classes", "bad")
    shape = meta.get("input_shape")
    _check(
        isinstance(shape, list)
        and len(shape) >= 1
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in shape),
        where,
        "input_shape",
        "missing or not a list of positive ints",
    )
    classes = meta.get("classes")
    if classes is not None:
        _check(
            isinstance(classes, list)
            and len(classes) == n
            and all(isinstance(c, str) for c in classes),
            where,
            "classes",
            f"expected {n} class names",
        )
    spec = meta.get("input_spec")
    _check(spec is None or isinstance(spec, dict), where, "input_spec", "not an object")
    rnd = meta.get("round")
    _check(isinstance(rnd, int) and not isinstance(rnd, bool), where, "round", "not an int")
    _check(
        valid_tensor_specs(meta.get("layout")),
        where,
        "layout",
        "expected [[name, shape, dtype], ...]",
    )
    buffers = meta.get("buffers", {})
    _check(isinstance(buffers, dict), where, "buffers", "not an object")
    meta.setdefault("buffers", {})
    meta.setdefault("config", "config.yaml")
    _check(isinstance(meta["config"], str), where, "config", "not a string")
    return meta


def read_model_info(run_dir: str | Path, node_id: str) -> dict[str, Any]:
    """The checked ``<run_dir>/nodes/<id>.model.json``; :class:`ExportError` naming the file
    when it is missing, unreadable, not JSON or malformed."""
    path = info_path(run_dir, node_id)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ExportError(f"{path}: no such file (node {node_id!r} wrote no model)") from None
    except OSError as exc:
        raise ExportError(f"{path}: cannot be read: {exc}") from None
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ExportError(f"{path}: not JSON: {exc}") from None
    return validate_model_info(meta, path, node_id)


def layout_problems(layout: list[list[Any]], state: dict[str, torch.Tensor]) -> list[str]:
    """How ``state`` differs from a recorded ``layout`` (names and shapes): empty if alike."""
    want = {name: tuple(shape) for name, shape, _ in layout}
    have = {k: tuple(v.shape) for k, v in state.items()}
    out = []
    if missing := [k for k in want if k not in have]:
        out.append(f"missing {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    if extra := [k for k in have if k not in want]:
        out.append(f"unexpected {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}")
    for k in want.keys() & have.keys():
        if want[k] != have[k]:
            out.append(f"{k}: shape {list(have[k])}, expected {list(want[k])}")
    return out
