"""A trained model's forward pass through onnxruntime: what serving answers with
(docs/design.md, "A site's own models").

The model is ``p2pfl export --format onnx``'s (:func:`p2pfl.export.model.onnx_bytes`: input
``input``, output ``logits``), run by one ``InferenceSession`` on the CPU with one thread per
call: onnxruntime releases the GIL while it runs, so a server's threads and processes, not
one call's threads, share the cores. The session is safe to call from many threads at once.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class OnnxForward:
    """``logits = forward(x)`` for a float32 batch ``x`` shaped as the model takes it."""

    def __init__(self, model: bytes, threads: int = 1):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.log_severity_level = 3  # errors only: no graph-optimisation chatter
        self.session = ort.InferenceSession(
            model, sess_options=options, providers=["CPUExecutionProvider"]
        )

    def __call__(self, x: np.ndarray) -> np.ndarray:
        out: Any = self.session.run(["logits"], {"input": np.ascontiguousarray(x, np.float32)})
        return np.asarray(out[0], dtype=np.float32)
