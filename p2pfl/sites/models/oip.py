"""KServe's Open Inference Protocol (v2) over HTTP for a site's served model: what Triton,
MLServer, TorchServe, OpenVINO and KServe speak, so their clients and gateways call a site
as they call them (https://kserve.github.io/website/latest/modelserving/data_plane/v2_protocol/).
Pure translation between the protocol's JSON and the rows a
:class:`~p2pfl.export.predict.Classifier` takes; :mod:`p2pfl.sites.models.serving` routes.

- The model's name is the site's (``hospital-a``); its version the served model's id.
- **Inputs** of a tabular model: one tensor ``input`` (``[batch, features]``, in the order
  of the metadata's ``parameters.features``), or one tensor a feature column, named by the
  column (``[batch]`` or ``[batch, 1]``). An image model takes ``images``, a ``BYTES``
  tensor of image files (base64 in JSON). Numbers of any numeric datatype; ``null`` is a
  missing value.
- **Outputs**: ``predicted`` (INT64, the class index), ``label`` (BYTES, its name),
  ``probabilities`` (FP32, ``[batch, classes]``); a model of values answers ``value`` (FP32,
  ``[batch, outputs]``). A request's ``outputs`` picks among them. ``parameters`` carry the
  run id, the round and the classes.
- The binary tensor extension (Triton's, ``Inference-Header-Content-Length``): inputs sent
  as raw little-endian bytes are read; answers are JSON.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import struct
from typing import Any

import numpy as np

from p2pfl.errors import P2PFLError

PLATFORM = "p2pfl"
NUMERIC = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}
HEADER_LENGTH = "Inference-Header-Content-Length"


class ProtocolError(P2PFLError, ValueError):
    """A request the protocol cannot take: the message names the input, column or row."""


def metadata(name: str, version: str, classifier: Any, extra: dict[str, Any]) -> dict[str, Any]:
    """``GET /v2/models/{name}``: inputs and outputs with name, datatype and shape."""
    spec = classifier.spec
    parameters = dict(extra)
    if classifier.kind == "image":
        inputs = [{"name": "images", "datatype": "BYTES", "shape": [-1]}]
    else:
        features = list(spec.get("features") or [])
        inputs = [{"name": "input", "datatype": "FP32", "shape": [-1, len(features)]}]
        parameters["features"] = features
    if classifier.values:
        outputs = [{"name": "value", "datatype": "FP32", "shape": [-1, -1]}]
    else:
        n = len(classifier.classes)
        outputs = [
            {"name": "predicted", "datatype": "INT64", "shape": [-1]},
            {"name": "label", "datatype": "BYTES", "shape": [-1]},
            {"name": "probabilities", "datatype": "FP32", "shape": [-1, n]},
        ]
        parameters["classes"] = list(classifier.classes)
    return {
        "name": name,
        "versions": [version],
        "platform": PLATFORM,
        "inputs": inputs,
        "outputs": outputs,
        "parameters": parameters,
    }


def read_request(body: bytes, header_length: str | None) -> dict[str, Any]:
    """The request's JSON, its binary inputs decoded into each input's ``data`` (a flat
    list) where the binary extension sent them."""
    if header_length is None:
        head, rest = body, b""
    else:
        try:
            n = int(header_length)
        except ValueError:
            raise ProtocolError(f"{HEADER_LENGTH}: {header_length!r} is not a length") from None
        if not 0 <= n <= len(body):
            raise ProtocolError(f"{HEADER_LENGTH} {n}: the body has {len(body)} bytes")
        head, rest = body[:n], body[n:]
    try:
        request = json.loads(head)
    except ValueError as exc:
        raise ProtocolError(f"the request is not JSON: {exc}") from None
    if not isinstance(request, dict) or not isinstance(request.get("inputs"), list):
        raise ProtocolError("an inference request is {'inputs': [{name, shape, datatype, data}]}")
    offset = 0
    for tensor in request["inputs"]:
        if not isinstance(tensor, dict):
            raise ProtocolError("each input is {name, shape, datatype, data}")
        size = (tensor.get("parameters") or {}).get("binary_data_size")
        if size is None:
            continue
        if not isinstance(size, int) or size < 0 or offset + size > len(rest):
            raise ProtocolError(f"input {tensor.get('name')!r}: binary_data_size {size!r}")
        tensor["data"] = _from_bytes(tensor, rest[offset : offset + size])
        offset += size
    return request


def _from_bytes(tensor: dict[str, Any], raw: bytes) -> list[Any]:
    kind = tensor.get("datatype")
    if kind == "BYTES":  # each element: a 4-byte little-endian length, then its bytes
        items, i = [], 0
        while i < len(raw):
            if i + 4 > len(raw):
                raise ProtocolError(f"input {tensor.get('name')!r}: a truncated BYTES element")
            (n,) = struct.unpack_from("<I", raw, i)
            items.append(raw[i + 4 : i + 4 + n])
            i += 4 + n
        return items
    if kind not in NUMERIC:
        raise ProtocolError(f"input {tensor.get('name')!r}: datatype {kind!r}")
    dtype = np.dtype(NUMERIC[kind]).newbyteorder("<")
    if len(raw) % dtype.itemsize:
        raise ProtocolError(f"input {tensor.get('name')!r}: {len(raw)} bytes of {kind}")
    return np.frombuffer(raw, dtype=dtype).astype(np.float64).tolist()


def _shape(tensor: dict[str, Any]) -> list[int]:
    shape = tensor.get("shape")
    if (
        not isinstance(shape, list)
        or not shape
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise ProtocolError(f"input {tensor.get('name')!r}: shape {shape!r} is not a list of sizes")
    return shape


def _numbers(tensor: dict[str, Any]) -> np.ndarray:
    """A numeric input's flat values as float64, NaN for a ``null``."""
    name = tensor.get("name")
    if tensor.get("datatype") not in NUMERIC:
        raise ProtocolError(
            f"input {name!r}: datatype {tensor.get('datatype')!r}; send a numeric one (FP32, ...)"
        )
    data = _flatten(tensor.get("data"), name)
    values = np.empty(len(data), dtype=np.float64)
    for i, v in enumerate(data):
        if v is None:
            values[i] = math.nan
        elif isinstance(v, (int, float)):  # bool is an int: BOOL inputs read 0 and 1
            values[i] = float(v)
        else:
            raise ProtocolError(f"input {name!r}: element {i} is {v!r}, not a number")
    if math.prod(_shape(tensor)) != len(values):
        raise ProtocolError(
            f"input {name!r}: {len(values)} values do not fill shape {tensor.get('shape')}"
        )
    return values


def _flatten(data: Any, name: Any) -> list[Any]:
    if not isinstance(data, list):
        raise ProtocolError(f"input {name!r}: 'data' must be a list")
    out: list[Any] = []
    stack = [iter(data)]
    while stack:
        for v in stack[-1]:
            if isinstance(v, list):
                stack.append(iter(v))
                break
            out.append(v)
        else:
            stack.pop()
    return out


def table_rows(request: dict[str, Any], features: list[str]):
    """A DataFrame of the feature columns from a request's inputs: one ``input`` tensor
    ``[batch, features]``, or a tensor a column; an unknown input is named."""
    import pandas as pd

    inputs = {t.get("name"): t for t in request["inputs"]}
    if len(inputs) != len(request["inputs"]):
        raise ProtocolError("an input is named twice")
    if set(inputs) == {"input"}:
        tensor = inputs["input"]
        values = _numbers(tensor)
        shape = _shape(tensor)
        if shape[-1] != len(features) or len(values) % len(features):
            raise ProtocolError(
                f"input 'input': shape {shape}; the model reads [batch, {len(features)}] "
                f"(columns {', '.join(features)})"
            )
        return pd.DataFrame(values.reshape(-1, len(features)), columns=features)
    unknown = sorted(str(n) for n in inputs if n not in features)
    if unknown:
        raise ProtocolError(
            f"unknown input(s) {', '.join(map(repr, unknown))}: the model reads one tensor "
            f"'input' or one a column of {', '.join(features)}"
        )
    missing = [f for f in features if f not in inputs]
    if missing:
        raise ProtocolError(f"missing input column(s) {', '.join(map(repr, missing))}")
    columns = {f: _numbers(inputs[f]) for f in features}
    sizes = {len(v) for v in columns.values()}
    if len(sizes) != 1:
        raise ProtocolError("the input columns hold different numbers of rows")
    return pd.DataFrame(columns)


def image_blobs(request: dict[str, Any]) -> list[bytes]:
    """An image model's ``images``: each a file's bytes (base64 strings in JSON)."""
    names = [t.get("name") for t in request["inputs"]]
    if names != ["images"]:
        raise ProtocolError(f"inputs {names}: an image model reads one BYTES input 'images'")
    tensor = request["inputs"][0]
    items = _flatten(tensor.get("data"), "images")
    blobs = []
    for i, item in enumerate(items):
        if isinstance(item, bytes):
            blobs.append(item)
            continue
        if not isinstance(item, str):
            raise ProtocolError(f"input 'images': element {i} is not a base64 string")
        try:
            blobs.append(base64.b64decode(item, validate=True))
        except (binascii.Error, ValueError) as exc:
            raise ProtocolError(f"input 'images': element {i} is not base64: {exc}") from None
    if not blobs:
        raise ProtocolError("input 'images' holds no image")
    return blobs


def response(
    request: dict[str, Any],
    name: str,
    version: str,
    classifier: Any,
    outputs: np.ndarray,
    parameters: dict[str, Any],
) -> dict[str, Any]:
    """The inference response: the requested outputs (all when none is named)."""
    n = len(outputs)
    if classifier.values:
        tensors = {
            "value": {
                "datatype": "FP32",
                "shape": [n, int(outputs.shape[1]) if outputs.ndim > 1 else 1],
                "data": [float(v) for v in np.asarray(outputs, dtype=np.float64).ravel()],
            }
        }
    else:
        pred = outputs.argmax(axis=1)
        classes = classifier.classes
        tensors = {
            "predicted": {"datatype": "INT64", "shape": [n], "data": [int(k) for k in pred]},
            "label": {"datatype": "BYTES", "shape": [n], "data": [classes[int(k)] for k in pred]},
            "probabilities": {
                "datatype": "FP32",
                "shape": [n, len(classes)],
                "data": [float(v) for v in np.asarray(outputs, dtype=np.float64).ravel()],
            },
        }
    wanted = request.get("outputs")
    names = list(tensors)
    if wanted is not None:
        if not isinstance(wanted, list) or not all(
            isinstance(o, dict) and isinstance(o.get("name"), str) for o in wanted
        ):
            raise ProtocolError("'outputs' is a list of {name}")
        names = [o["name"] for o in wanted]
        unknown = [o for o in names if o not in tensors]
        if unknown:
            raise ProtocolError(
                f"unknown output(s) {', '.join(map(repr, unknown))}: this model answers "
                f"{', '.join(tensors)}"
            )
    answer: dict[str, Any] = {
        "model_name": name,
        "model_version": version,
        "parameters": parameters,
        "outputs": [{"name": o, **tensors[o]} for o in names],
    }
    if isinstance(request.get("id"), str):
        answer["id"] = request["id"]
    return answer
