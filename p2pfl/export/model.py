"""A run's trained models, rebuilt and exported: :func:`load_model`, :func:`export_model`.

A node leaves ``<run>/nodes/<id>.safetensors`` and ``<run>/nodes/<id>.model.json``
(:mod:`p2pfl.learning.artifacts`); the run directory has the resolved topology in
``config.yaml``. :func:`load_model` rebuilds the node's module exactly as the swarm built its
initial model (:func:`p2pfl.node.daemon.build_node_model`, the method's adaptations
included) and loads the trained weights into it, strictly.
"""

from __future__ import annotations

import inspect
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from p2pfl.algorithms import get_algorithm
from p2pfl.algorithms.build import build_node_model
from p2pfl.check.load import load_topology
from p2pfl.config.schema import ModelConfig
from p2pfl.files import atomic_path
from p2pfl.learning.artifacts import (
    ExportError,
    info_path,
    layout_problems,
    nodes_with_models,
    read_model_info,
    restore_buffers,
    weights_path,
)
from p2pfl.learning.layout import tensor_specs

FORMATS = ("safetensors", "onnx", "torchscript")
SUFFIX = {"safetensors": ".safetensors", "onnx": ".onnx", "torchscript": ".pt"}
ONNX_OPSET = 17


def export_filename(node_id: str, fmt: str) -> str:
    """The file name :func:`export_model` gives node ``node_id``'s model in format ``fmt``."""
    _check_format(fmt)
    return f"{node_id}{SUFFIX[fmt]}"


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}: one of {', '.join(FORMATS)}")


def _nodes_text(run: Path) -> str:
    nodes = nodes_with_models(run)
    if not nodes:
        return f"no node of {run} has a trained model (nodes/<id>.safetensors)"
    return f"nodes with models: {', '.join(nodes)}"


def check_node(run_dir: str | Path, node_id: str) -> Path:
    """``run_dir`` as a Path, once it is a run directory in which ``node_id`` left a model;
    :class:`ExportError` naming what is missing (and the nodes that have models) otherwise."""
    run = Path(run_dir)
    if not run.is_dir():
        raise ExportError(f"{run}: no such run directory")
    if not (run / "config.yaml").is_file():
        raise ExportError(f"{run}: not a run directory (no config.yaml)")
    for path in (info_path(run, node_id), weights_path(run, node_id)):
        if not path.is_file():
            raise ExportError(
                f"{path}: no such file: node {node_id!r} has no trained model; {_nodes_text(run)}"
            )
    return run


def load_model_with_info(run_dir: str | Path, node_id: str) -> tuple[nn.Module, dict[str, Any]]:
    """:func:`load_model` and the node's checked ``model.json``, with what its outputs are
    (``loss``: ``training.loss``; ``targets``: ``classes`` or ``values``, from its run's
    ``config.yaml``)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    run = check_node(run_dir, node_id)
    info = read_model_info(run, node_id)
    cfg = load_topology(run / info["config"])
    if cfg.algorithm.name != info["algorithm"]:
        raise ExportError(
            f"{run / info['config']}: algorithm {cfg.algorithm.name!r}, but "
            f"{info_path(run, node_id)} was trained with {info['algorithm']!r} (a config of "
            "another run?)"
        )
    try:  # the model json names the model; config.yaml gives the method's knobs and seed
        model_cfg = ModelConfig.model_validate(info["model"])
    except ValueError as exc:
        raise ExportError(f"{info_path(run, node_id)}: field 'model': {exc}") from None
    cfg = cfg.model_copy(update={"model": model_cfg})
    method_cls = get_algorithm(cfg.algorithm.name)
    with torch.random.fork_rng(devices=[]):  # building seeds torch's RNG: keep the caller's
        model = build_node_model(method_cls, cfg, info["num_classes"], tuple(info["input_shape"]))
    module = model.export_module()
    path = weights_path(run, node_id)
    try:
        weights = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise ExportError(f"{path}: not a readable safetensors file: {exc}") from None
    problems = layout_problems(tensor_specs(module.state_dict()), weights)
    if problems:
        raise ExportError(
            f"{path}: the weights do not fit the model rebuilt from {run / info['config']}: "
            + "; ".join(problems)
        )
    module.load_state_dict(weights, strict=True)
    restore_buffers(module, info["buffers"], str(info_path(run, node_id)))
    module.eval()
    # what the outputs mean (the task: p2pfl.learning.task), for predict, serving and the gate
    info = {**info, "loss": cfg.training.loss, "targets": cfg.dataset.targets or "classes"}
    return module, info


def load_model(run_dir: str | Path, node_id: str) -> nn.Module:
    """Node ``node_id``'s trained model from run directory ``run_dir``, in eval mode on the
    CPU: the module the user takes away (``SplitModel.export_module``: the built-in model,
    or the user's own module for a user model), its weights loaded strictly.
    :class:`~p2pfl.learning.artifacts.ExportError` names a missing run directory, node or
    file (and the nodes that do have models)."""
    return load_model_with_info(run_dir, node_id)[0]


def dummy_input(info: dict[str, Any], batch: int = 2) -> torch.Tensor:
    """A zero batch of the model's input shape."""
    return torch.zeros(batch, *info["input_shape"])


def export_model(
    run_dir: str | Path, node_id: str, fmt: str, out_path: str | Path | None = None
) -> Path:
    """Write node ``node_id``'s trained model in format ``fmt`` and return the file's path:

    * ``safetensors``: a copy of the weights, and of its ``model.json`` beside it
      (``<name>.model.json``);
    * ``onnx``: ``torch.onnx.export`` (opset 17, input ``input``, output ``logits``, a
      dynamic batch axis), checked with ``onnx.checker``;
    * ``torchscript``: ``torch.jit.trace`` on a zero batch of the input shape, saved with
      ``torch.jit.save``.

    ``out_path`` is the file to write (default ``<run_dir>/export/<id>.<ext>``)."""
    _check_format(fmt)
    run = check_node(run_dir, node_id)
    out = Path(out_path) if out_path is not None else run / "export" / export_filename(node_id, fmt)
    if fmt == "safetensors":
        read_model_info(run, node_id)  # a malformed json is not copied on
        return _copy_safetensors(run, node_id, out)
    module, info = load_model_with_info(run, node_id)
    with atomic_path(out) as tmp:
        if fmt == "onnx":
            _export_onnx(module, info, tmp)
        else:
            _export_torchscript(module, info, tmp)
    return out


def _copy_safetensors(run: Path, node_id: str, out: Path) -> Path:
    json_out = out.with_name(out.name.removesuffix(".safetensors") + ".model.json")
    for src, dst in ((weights_path(run, node_id), out), (info_path(run, node_id), json_out)):
        if dst.exists() and dst.resolve() == src.resolve():
            continue
        with atomic_path(dst) as tmp:
            shutil.copyfile(src, tmp)
    return out


def _export_onnx(module: nn.Module, info: dict[str, Any], path: Path) -> None:
    path.write_bytes(onnx_bytes(module, info, str(path)))


def onnx_bytes(module: nn.Module, info: dict[str, Any], where: str) -> bytes:
    """``module`` as an ONNX model (``export --format onnx``'s: opset 17, input ``input``,
    output ``logits``, a dynamic batch axis), checked with ``onnx.checker``; ``where``
    names it in an :class:`ExportError`, raised also when the exporter cannot trace it."""
    import io

    import onnx

    kwargs: dict[str, Any] = {}
    if "dynamo" in inspect.signature(torch.onnx.export).parameters:
        kwargs["dynamo"] = False  # the TorchScript-based exporter: no onnxscript needed
    buffer = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        try:
            torch.onnx.export(
                module,
                (dummy_input(info),),
                buffer,
                input_names=["input"],
                output_names=["logits"],
                dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
                opset_version=ONNX_OPSET,
                **kwargs,
            )
        except (RuntimeError, TypeError, ValueError, torch.onnx.errors.OnnxExporterError) as exc:
            raise ExportError(f"{where}: the model cannot be exported to ONNX: {exc}") from None
    data = buffer.getvalue()
    try:
        onnx.checker.check_model(onnx.load_from_string(data))
    except onnx.checker.ValidationError as exc:
        raise ExportError(f"{where}: the exported ONNX model does not check: {exc}") from None
    return data


def _export_torchscript(module: nn.Module, info: dict[str, Any], path: Path) -> None:
    with warnings.catch_warnings(), torch.no_grad():
        # torch 2.10+ deprecates TorchScript, yet it is what C++ (libtorch) and older
        # runtimes load
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        traced = torch.jit.trace(module, (dummy_input(info),))
        torch.jit.save(traced, str(path))
