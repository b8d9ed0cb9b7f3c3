"""The wire form of a compressed state, both ways (docs/wire.md, "Compression"): what
:mod:`p2pfl.wire.compress` (the stateless codecs) and :mod:`p2pfl.wire.topk` (the top-k
streams) share. Pure: no transport, no event loop.

A compressed state is an ordinary state (it travels as any other: one buffer, a tensor
index, a digest over its bytes) whose first tensor, :data:`HEADER`, is a 1-D uint8 tensor
holding a msgpack map (:func:`p2pfl.wire.codec.encode`)::

    {"v": 1, "codec": "fp16" | "int8" | "topk",
     "tensors": [{"name", "dtype", "shape", "form", ...}, ...],   # in the state's order
     "stream": {"epoch": str, "seq": int, "base": int | None}}    # topk only

Each entry's ``form`` says how its tensor travels, under its own name: ``raw`` (its dtype
and shape), ``fp16`` (float16, its shape), ``int8`` (uint8 levels, its shape; the entry
adds ``lo`` and ``scale``), ``topk`` (1-D values of its dtype, and 1-D strictly increasing
flat positions, int32 or int64, under ``<name>@idx``; the receiver's base supplies the
rest).

Sending: :func:`checked_tensor` takes each tensor of a state to encode, :func:`tensor_entry`
describes how it travels (:func:`int8_or_raw`: the int8 form both ``int8`` and a dense
top-k state use), :func:`pack` makes the wire state. Receiving: :func:`read_header` checks
the header, :func:`decode_entries` rebuilds the state it describes. Both refuse with
:class:`CompressError` anything else: an unknown codec, version or form, a missing or
extra tensor, a dtype or shape unlike the entry's, a decoded size over the caller's limit
(checked before any allocation), non-finite quantization parameters, positions out of
range or repeated, a delta without the base it was computed against. Untrusted input
never raises anything else.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from p2pfl.errors import P2PFLError
from p2pfl.wire.codec import ALLOWED_DTYPES, MAX_NDIM, CodecError, decode, encode

__all__ = [
    "CODEC_FORMS",
    "HEADER",
    "IDX_SUFFIX",
    "MAX_EPOCH_CHARS",
    "MAX_HEADER_BYTES",
    "MAX_SEQ",
    "CompressError",
    "Header",
    "checked_tensor",
    "decode_entries",
    "tensor_entry",
    "int8_or_raw",
    "is_int",
    "pack",
    "read_header",
]

State = dict[str, torch.Tensor]

HEADER = "@compress"  # a name no model state holds (their names start with g. or h.)
IDX_SUFFIX = "@idx"
VERSION = 1
MAX_HEADER_BYTES = 16 << 20
LEVELS = 255  # int8: q in 0..LEVELS
_DTYPE_NAMES = {v: k for k, v in ALLOWED_DTYPES.items()}
_IDX_DTYPES = {torch.int32, torch.int64}
_COMMON_KEYS = frozenset({"name", "dtype", "shape", "form"})
_FORM_KEYS = {
    "raw": _COMMON_KEYS,
    "fp16": _COMMON_KEYS,
    "int8": _COMMON_KEYS | {"lo", "scale"},
    "topk": _COMMON_KEYS,
}
_STREAM_KEYS = frozenset({"epoch", "seq", "base"})
MAX_EPOCH_CHARS = 64
MAX_SEQ = (1 << 63) - 1  # a stream's sequence numbers fit an int64


class CompressError(P2PFLError, ValueError):
    """A state that cannot be compressed as asked, or a compressed state that does not
    decode (malformed, unknown codec, over the size limit, a delta without its base)."""


# ----------------------------------------------------------------------------- sending


def checked_tensor(name: Any, value: Any) -> torch.Tensor:
    """``state[name]`` as a detached tensor to encode; :class:`CompressError` for a key that
    is not a str or is reserved for the wire form, a value that is not a tensor (a numpy
    array is taken as one), or a dtype the codec cannot carry."""
    if not isinstance(name, str):
        raise CompressError(f"state keys must be str, got {type(name).__name__}")
    if name == HEADER or name.endswith(IDX_SUFFIX):
        raise CompressError(f"state[{name!r}]: the name is reserved for the compressed form")
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(np.ascontiguousarray(value))
    if not isinstance(value, torch.Tensor):
        raise CompressError(f"state[{name!r}]: expected a tensor, got {type(value).__name__}")
    if value.dtype not in _DTYPE_NAMES:
        raise CompressError(f"state[{name!r}]: unsupported dtype {value.dtype}")
    return value.detach()


def tensor_entry(name: str, t: torch.Tensor, form: str, **params: float) -> dict[str, Any]:
    """The header entry saying that tensor ``name`` (``t`` as it was) travels as ``form``."""
    return {
        "name": name,
        "dtype": _DTYPE_NAMES[t.dtype],
        "shape": list(t.shape),
        "form": form,
        **params,
    }


def pack(codec: str, entries: list[dict], tensors: State, stream: dict | None = None) -> State:
    """The wire state: the header tensor first, then the tensors in the entries' order."""
    header: dict[str, Any] = {"v": VERSION, "codec": codec, "tensors": entries}
    if stream is not None:
        header["stream"] = stream
    raw = bytearray(encode(header))
    return {HEADER: torch.frombuffer(raw, dtype=torch.uint8), **tensors}


def _quantize(t: torch.Tensor) -> tuple[torch.Tensor, float, float] | None:
    """``(q, lo, scale)``: ``t``'s affine int8 form (``s = (hi - lo) / 255``,
    ``q = round((x - lo) / s)``, in float64), None when it holds non-finite values or its
    range overflows float64 (it then travels raw)."""
    x = t.to(torch.float64, copy=True)  # a copy: the steps below work in place
    if not bool(torch.isfinite(x).all()):
        return None
    lo_t, hi_t = torch.aminmax(x)
    lo, hi = float(lo_t), float(hi_t)
    scale = (hi - lo) / LEVELS
    if not math.isfinite(scale):
        return None
    if scale == 0.0:
        return torch.zeros(t.shape, dtype=torch.uint8), lo, 0.0
    q = x.sub_(lo).div_(scale).round_().clamp_(0, LEVELS).to(torch.uint8)
    return q.cpu(), lo, scale


def int8_or_raw(name: str, t: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
    """``(entry, tensor)``: ``t`` quantized to uint8 levels (:mod:`p2pfl.wire.compress`,
    ``int8``), or as it is when it is not floating, is empty, or cannot be quantized."""
    if t.is_floating_point() and t.numel():
        quantized = _quantize(t)
        if quantized is not None:
            q, lo, scale = quantized
            return tensor_entry(name, t, "int8", lo=lo, scale=scale), q
    return tensor_entry(name, t, "raw"), t


# ----------------------------------------------------------------------------- receiving


@dataclass(frozen=True)
class Header:
    """A compressed state's header, checked (:func:`read_header`)."""

    codec: str
    entries: list[dict[str, Any]]
    stream: tuple[str, int, int | None] | None  # (epoch, seq, base)


# the forms each codec's entries may take
CODEC_FORMS = {
    "fp16": frozenset({"raw", "fp16"}),
    "int8": frozenset({"raw", "int8"}),
    "topk": frozenset({"raw", "int8", "topk"}),
}


def is_int(v: Any) -> bool:
    """Whether ``v`` is an int (a bool is not, though Python says so)."""
    return isinstance(v, int) and not isinstance(v, bool)


def read_header(wire: Any) -> Header:
    """The header of ``wire`` (a compressed state as it arrived), checked: a version and
    codec this node knows, its keys, a list of entries (not yet checked one by one:
    :func:`decode_entries`), and a top-k stream's epoch and sequence numbers."""
    if not isinstance(wire, Mapping):
        raise CompressError(f"a state must be a map, got {type(wire).__name__}")
    t = wire.get(HEADER)
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
        raise CompressError(f"{HEADER!r} must be a 1-D uint8 tensor")
    if t.numel() > MAX_HEADER_BYTES:
        raise CompressError(f"header of {t.numel()} bytes exceeds {MAX_HEADER_BYTES}")
    if not t.numel():
        raise CompressError("empty header")
    try:
        header = decode(memoryview(t.contiguous().numpy()), MAX_HEADER_BYTES)
    except CodecError as exc:
        raise CompressError(f"header: {exc}") from None
    if not isinstance(header, dict):
        raise CompressError("header must be a map")
    version, codec = header.get("v"), header.get("codec")
    if not is_int(version) or version != VERSION:
        raise CompressError(f"unsupported compressed-state version {version!r}")
    if not isinstance(codec, str) or codec not in CODEC_FORMS:
        raise CompressError(f"unknown codec {codec!r}; known: {sorted(CODEC_FORMS)}")
    allowed = {"v", "codec", "tensors"} | ({"stream"} if codec == "topk" else set())
    if not header.keys() <= allowed or "tensors" not in header:
        raise CompressError(f"header keys {sorted(map(str, header))}, expected {sorted(allowed)}")
    entries = header["tensors"]
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise CompressError("header 'tensors' must be a list of maps")
    if len(entries) >= len(wire):
        raise CompressError(f"{len(entries)} entries but {len(wire) - 1} tensors")
    stream = None
    if codec == "topk":
        s = header.get("stream")
        if not isinstance(s, dict) or s.keys() != _STREAM_KEYS:
            raise CompressError(f"a topk header needs stream {sorted(_STREAM_KEYS)}")
        epoch, seq, base = s["epoch"], s["seq"], s["base"]
        if not isinstance(epoch, str) or not 0 < len(epoch) <= MAX_EPOCH_CHARS:
            raise CompressError("stream epoch must be a string of 1 to 64 characters")
        if not is_int(seq) or seq < 0 or not (base is None or (is_int(base) and 0 <= base <= seq)):
            raise CompressError(f"stream seq {seq!r} / base {base!r} out of range")
        stream = (epoch, seq, base)
    return Header(codec, entries, stream)


def _check_shape(shape: Any, where: str) -> list[int]:
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise CompressError(f"{where}: shape must be a list of at most {MAX_NDIM} ints")
    if not all(is_int(d) and d >= 0 for d in shape):
        raise CompressError(f"{where}: shape entries must be non-negative ints, got {shape!r}")
    return shape


def _wire_tensor(
    wire: Mapping[str, Any], key: str, dtypes: set[torch.dtype], shape: list[int] | None, where: str
) -> torch.Tensor:
    t = wire.get(key)
    if not isinstance(t, torch.Tensor):
        raise CompressError(f"{where}: tensor {key!r} missing")
    if t.dtype not in dtypes:
        names = sorted(_DTYPE_NAMES.get(d, str(d)) for d in dtypes)
        raise CompressError(f"{where}: tensor {key!r} is {t.dtype}, expected {names}")
    if shape is not None and list(t.shape) != shape:
        raise CompressError(f"{where}: tensor {key!r} has shape {list(t.shape)}, expected {shape}")
    return t


def decode_entries(
    header: Header, wire: Mapping[str, Any], max_bytes: int, base: Mapping[str, Any] | None
) -> State:
    """The state the checked ``header`` and ``wire`` describe; ``base`` supplies what a
    ``topk`` entry does not send."""
    forms = CODEC_FORMS[header.codec]
    used = {HEADER}
    total = 0
    plan: list[tuple[str, str, torch.dtype, list[int], dict[str, Any]]] = []
    for i, e in enumerate(header.entries):
        where = f"entry {i}"
        name, form = e.get("name"), e.get("form")
        if not isinstance(name, str) or name == HEADER or name in used:
            raise CompressError(f"{where}: bad or repeated name {name!r}")
        where = f"entry {i} ({name!r})"
        if not isinstance(form, str) or form not in forms:
            raise CompressError(f"{where}: form {form!r} not allowed in {header.codec}")
        if e.keys() != _FORM_KEYS[form]:
            raise CompressError(
                f"{where}: keys {sorted(map(str, e))}, expected {sorted(_FORM_KEYS[form])}"
            )
        dname = e["dtype"]
        if not isinstance(dname, str) or dname not in ALLOWED_DTYPES:
            raise CompressError(f"{where}: unknown dtype {dname!r}")
        dtype = ALLOWED_DTYPES[dname]
        shape = _check_shape(e["shape"], where)
        if form != "raw" and not dtype.is_floating_point:
            raise CompressError(f"{where}: form {form} needs a floating dtype, not {dname}")
        total += math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if total > max_bytes:
            raise CompressError(f"decoded state exceeds the limit of {max_bytes} bytes")
        used.add(name)
        if form == "topk":
            idx_key = name + IDX_SUFFIX
            if idx_key in used:
                raise CompressError(f"{where}: tensor {idx_key!r} referenced twice")
            used.add(idx_key)
        plan.append((name, form, dtype, shape, e))
    extra = set(wire) - used
    if extra:
        raise CompressError(f"tensors no entry describes: {sorted(map(str, extra))[:3]}")
    out: State = {}
    for name, form, dtype, shape, e in plan:
        where = f"{name!r}"
        if form == "raw":
            out[name] = _wire_tensor(wire, name, {dtype}, shape, where)
        elif form == "fp16":
            out[name] = _wire_tensor(wire, name, {torch.float16}, shape, where).to(dtype)
        elif form == "int8":
            q = _wire_tensor(wire, name, {torch.uint8}, shape, where)
            lo, scale = e["lo"], e["scale"]
            ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (lo, scale))
            if not ok or not (math.isfinite(lo) and math.isfinite(scale)) or scale < 0:
                raise CompressError(
                    f"{where}: lo {lo!r} / scale {scale!r} must be finite, scale >= 0"
                )
            # out of the dtype's range (a hostile lo/scale): inf, which admission refuses
            out[name] = (q.to(torch.float64) * float(scale) + float(lo)).to(dtype)
        else:
            out[name] = _apply_topk(wire, name, dtype, shape, base, where)
    return out


def _apply_topk(
    wire: Mapping[str, Any],
    name: str,
    dtype: torch.dtype,
    shape: list[int],
    base: Mapping[str, Any] | None,
    where: str,
) -> torch.Tensor:
    """``base[name]`` with the sent positions replaced by the sent values."""
    ref = None if base is None else base.get(name)
    if not isinstance(ref, torch.Tensor):
        raise CompressError(f"{where}: a top-k delta needs the base it was computed against")
    if ref.dtype != dtype or list(ref.shape) != shape:
        raise CompressError(f"{where}: the base holds {ref.dtype} {list(ref.shape)}")
    idx = _wire_tensor(wire, name + IDX_SUFFIX, _IDX_DTYPES, None, where)
    vals = _wire_tensor(wire, name, {dtype}, None, where)
    n = ref.numel()
    if idx.dim() != 1 or vals.dim() != 1 or idx.numel() != vals.numel() or idx.numel() > n:
        raise CompressError(f"{where}: {idx.numel()} positions / {vals.numel()} values for {n}")
    out = ref.detach().clone().contiguous()
    if idx.numel():
        pos = idx.to(torch.int64)
        if int(pos[0]) < 0 or int(pos[-1]) >= n or not bool((pos[1:] > pos[:-1]).all()):
            raise CompressError(f"{where}: positions must be increasing and within [0, {n})")
        out.view(-1)[pos] = vals
    return out
