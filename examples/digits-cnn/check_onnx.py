"""The ONNX export against torch, on the node's own test set: both classify every test image
of the node, and the largest difference between their outputs is printed (and must be
below 1e-4).

    python check_onnx.py RUN_DIR NODE EXPORT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

import p2pfl
from p2pfl.learning.data import load_node_data


def main(run_dir: str, node: str, export_dir: str) -> int:
    cfg = p2pfl.load_topology(Path(run_dir) / "config.yaml")
    data = load_node_data(cfg.dataset, cfg.node_ids, node, cfg.seed)
    model = p2pfl.load_model(run_dir, node)
    with torch.no_grad():
        expected = model(data.test_x).numpy()
    session = ort.InferenceSession(str(Path(export_dir) / f"{node}.onnx"))
    name = session.get_inputs()[0].name
    got = session.run(None, {name: data.test_x.numpy()})[0]
    diff = float(np.abs(got - expected).max())
    agree = float((got.argmax(1) == expected.argmax(1)).mean())
    acc = float((expected.argmax(1) == data.test_y.numpy()).mean())
    print(
        f"{node}: {len(data.test_y)} test images; max |ONNX - torch| = {diff:.3g}; "
        f"same class for {agree:.1%}; torch accuracy {acc:.4f}"
    )
    return 0 if diff < 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:4]))
