"""A run's trained models for other tools (README.md, "Trained models").

* :func:`load_model`: a node's trained ``torch.nn.Module`` from a run directory (also
  ``p2pfl.load_model``);
* :func:`export_model`: the same as safetensors (+ its ``model.json``), ONNX or TorchScript;
* :func:`predict`: classify a CSV file or an image folder with it into a predictions CSV.

Each node writes its model when its rounds are done (:mod:`p2pfl.learning.artifacts`).
"""

from __future__ import annotations

from p2pfl.export.model import (
    FORMATS,
    export_filename,
    export_model,
    load_model,
    load_model_with_info,
)
from p2pfl.export.predict import Predictions, classify, predict
from p2pfl.learning.artifacts import (
    ExportError,
    nodes_with_models,
    read_model_info,
    write_model_artifacts,
)

__all__ = [
    "FORMATS",
    "ExportError",
    "Predictions",
    "classify",
    "export_filename",
    "export_model",
    "load_model",
    "load_model_with_info",
    "nodes_with_models",
    "predict",
    "read_model_info",
    "write_model_artifacts",
]
