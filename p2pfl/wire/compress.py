"""Compression of the states that travel (docs/wire.md, "Compression").

Pure: no transport, no event loop. ``transfer.compress`` names the mode:

- ``none``: the state travels as it is (:func:`encode_state` returns the very same mapping,
  so its bytes are those of an uncompressed transfer).
- ``fp16``: each float32 / float64 tensor travels as float16 and is cast back to its own
  dtype on decode. ``|x - x̂| ≤ max(2⁻¹¹·|x|, 2⁻²⁵)`` (round to nearest; 2⁻²⁵ is half the
  float16 subnormal spacing). A tensor holding a finite value beyond float16's range
  (``|x| > 65504``, which would become an infinity) travels raw; NaN and ±inf cast to
  themselves.
- ``int8``: per-tensor **affine** quantization over 256 levels, from the tensor's minimum
  ``lo`` and maximum ``hi``: ``s = (hi - lo) / 255``, ``q = round((x - lo) / s)`` in
  ``0..255`` (one byte), ``x̂ = lo + q·s`` (float64, then cast to the tensor's dtype).
  ``|x - x̂| ≤ s/2`` before that cast (which adds at most half an ulp of the dtype). A
  constant tensor (``s = 0``) decodes to exactly ``lo``. A tensor holding NaN or ±inf, or
  whose range overflows float64, travels raw.
- ``topk(rho)``: a stream per served state, :class:`TopKSender` / :class:`TopKReceiver`.
  The sender keeps a *published estimate* ``P_t`` of its state ``x_t`` and sends, of each
  floating tensor, the positions of the ``⌈rho·n⌉`` largest ``|x_t - P_{t-1}|`` with their
  new values: ``P_t = P_{t-1} + M_t ⊙ (x_t - P_{t-1})``. That is top-k with error feedback:
  with ``e_t = x_t - P_t`` the residual not sent, ``x_t - P_{t-1} = Δ_t + e_{t-1}`` (the
  change plus the previous residual), and ``e_t = (1 - M_t) ⊙ (Δ_t + e_{t-1})``. A receiver
  that holds ``P_b`` (same stream epoch, ``b`` within the sender's window) gets the union
  of the positions changed since ``b`` with ``P_t``'s values there and rebuilds ``P_t`` bit
  for bit; any other receiver gets ``P_t`` dense (raw, after which it holds ``P_t``; or
  int8, after which it holds no base). The daemon keeps them per stream and a pull names
  the base it holds (:mod:`p2pfl.wire.streams`).

Every non-floating tensor travels raw. Non-finite values never make a codec fail: ``fp16``
keeps them, ``int8`` and ``topk`` send that tensor raw, so the decoded state holds exactly
what was sent and admission (``p2pfl/learning/admission.py``) sees them.

Wire form of a compressed state: an ordinary state (it travels as any other: one buffer, a
tensor index, a digest over its bytes) whose first tensor, :data:`HEADER`, is a 1-D uint8
tensor holding a msgpack map (:func:`p2pfl.wire.codec.encode`)::

    {"v": 1, "codec": "fp16" | "int8" | "topk",
     "tensors": [{"name", "dtype", "shape", "form", ...}, ...],   # in the state's order
     "stream": {"epoch": str, "seq": int, "base": int | None}}    # topk only

Each entry's ``form`` says how its tensor travels, under its own name: ``raw`` (its dtype
and shape), ``fp16`` (float16, its shape), ``int8`` (uint8 levels, its shape; the entry
adds ``lo`` and ``scale``), ``topk`` (1-D values of its dtype, and 1-D strictly increasing
flat positions, int32 or int64, under ``<name>@idx``; the receiver's base supplies the
rest). Decoding (:func:`decode_state`, :meth:`TopKReceiver.apply`) refuses with
:class:`CompressError` anything else: an unknown codec or form, a missing or extra tensor,
a dtype or shape unlike the entry's, a decoded size over the caller's limit (checked
before any allocation), non-finite quantization parameters, positions out of range or
repeated, a delta against a base the receiver does not hold.
"""

from __future__ import annotations

import math
import re
import secrets
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from p2pfl.errors import P2PFLError
from p2pfl.wire.codec import ALLOWED_DTYPES, MAX_NDIM, CodecError, decode, encode

__all__ = [
    "CODECS",
    "HEADER",
    "CompressError",
    "Fp16Codec",
    "Int8Codec",
    "NoneCodec",
    "Spec",
    "TopKReceiver",
    "TopKSender",
    "codec_for",
    "codec_of",
    "decode_state",
    "encode_state",
    "is_compressed",
    "parse_base",
    "parse_spec",
    "topk_positions",
]

State = dict[str, torch.Tensor]

HEADER = "@compress"  # a name no model state holds (their names start with g. or h.)
IDX_SUFFIX = "@idx"
VERSION = 1
MAX_HEADER_BYTES = 16 << 20
FP16_MAX = 65504.0  # float16's largest finite value
LEVELS = 255  # int8: q in 0..LEVELS
SPEC_RE = re.compile(r"^(none|fp16|int8|topk\((0?\.\d+|1(\.0*)?)\))$")  # the schema's
_DTYPE_NAMES = {v: k for k, v in ALLOWED_DTYPES.items()}
_IDX_DTYPES = {torch.int32, torch.int64}
_INT32_MAX = (1 << 31) - 1
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


# ----------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class Spec:
    """A parsed ``transfer.compress``: ``mode`` (``none``, ``fp16``, ``int8``, ``topk``)
    and, for ``topk``, ``rho`` in (0, 1]."""

    mode: str
    rho: float | None = None

    def __str__(self) -> str:
        return f"topk({self.rho:g})" if self.mode == "topk" else self.mode


def parse_spec(spec: str | Spec) -> Spec:
    """``spec`` (``none``, ``fp16``, ``int8``, ``topk(rho)`` with ``0 < rho ≤ 1``) parsed;
    :class:`CompressError` otherwise."""
    if isinstance(spec, Spec):
        return spec
    m = SPEC_RE.match(spec) if isinstance(spec, str) else None
    if m is None:
        raise CompressError(
            f"transfer.compress {spec!r}: expected none, fp16, int8 or topk(rho), 0 < rho <= 1"
        )
    if m.group(2) is None:
        return Spec(m.group(1))
    rho = float(m.group(2))
    if not 0 < rho <= 1:
        raise CompressError(f"transfer.compress {spec!r}: rho must be in (0, 1]")
    return Spec("topk", rho)


# ----------------------------------------------------------------------------- helpers


def _tensor(name: Any, value: Any) -> torch.Tensor:
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


def _entry(name: str, t: torch.Tensor, form: str, **params: float) -> dict[str, Any]:
    return {
        "name": name,
        "dtype": _DTYPE_NAMES[t.dtype],
        "shape": list(t.shape),
        "form": form,
        **params,
    }


def _pack(codec: str, entries: list[dict], tensors: State, stream: dict | None = None) -> State:
    """The wire state: the header tensor first, then the tensors in the entries' order."""
    header: dict[str, Any] = {"v": VERSION, "codec": codec, "tensors": entries}
    if stream is not None:
        header["stream"] = stream
    raw = bytearray(encode(header))
    return {HEADER: torch.frombuffer(raw, dtype=torch.uint8), **tensors}


def is_compressed(wire: Mapping[str, Any]) -> bool:
    """Whether ``wire`` (a state as it arrived) is in a compressed form (holds :data:`HEADER`)."""
    return HEADER in wire


def _fits_fp16(t: torch.Tensor) -> bool:
    """Every finite value of ``t`` is within float16's range (non-finite ones cast to
    themselves)."""
    finite = torch.nan_to_num(t.abs(), nan=0.0, posinf=0.0)
    return bool(finite.max() <= FP16_MAX)


def _quantize(t: torch.Tensor) -> tuple[torch.Tensor, float, float] | None:
    """``(q, lo, scale)``: ``t``'s affine int8 form (module docstring), None when it holds
    non-finite values or its range overflows float64 (it then travels raw)."""
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


# ----------------------------------------------------------------------------- codecs


class NoneCodec:
    """``none``: the state travels as it is."""

    name = "none"

    def encode(self, state: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """``state`` itself (the same object): its transfer is byte for byte an
        uncompressed one."""
        return state

    def decode(self, wire: Mapping[str, torch.Tensor], *, max_bytes: int) -> State:
        """The state ``wire`` carries (:func:`decode_state`: the header says which codec)."""
        return decode_state(wire, max_bytes=max_bytes)


class Fp16Codec:
    """``fp16``: float32 / float64 tensors as float16 (module docstring: error bound, what
    travels raw)."""

    name = "fp16"

    def encode(self, state: Mapping[str, torch.Tensor]) -> State:
        """The wire form of ``state``."""
        entries: list[dict] = []
        tensors: State = {}
        for name, value in state.items():
            t = _tensor(name, value)
            if t.dtype in (torch.float32, torch.float64) and t.numel() and _fits_fp16(t):
                entries.append(_entry(name, t, "fp16"))
                tensors[name] = t.to(torch.float16)
            else:
                entries.append(_entry(name, t, "raw"))
                tensors[name] = t
        return _pack(self.name, entries, tensors)

    def decode(self, wire: Mapping[str, torch.Tensor], *, max_bytes: int) -> State:
        """The state ``wire`` carries (:func:`decode_state`)."""
        return decode_state(wire, max_bytes=max_bytes)


class Int8Codec:
    """``int8``: per-tensor affine quantization of floating tensors (module docstring:
    formula, error bound, what travels raw)."""

    name = "int8"

    def encode(self, state: Mapping[str, torch.Tensor]) -> State:
        """The wire form of ``state``."""
        entries: list[dict] = []
        tensors: State = {}
        for name, value in state.items():
            t = _tensor(name, value)
            entry, data = _int8_or_raw(name, t)
            entries.append(entry)
            tensors[name] = data
        return _pack(self.name, entries, tensors)

    def decode(self, wire: Mapping[str, torch.Tensor], *, max_bytes: int) -> State:
        """The state ``wire`` carries (:func:`decode_state`)."""
        return decode_state(wire, max_bytes=max_bytes)


def _int8_or_raw(name: str, t: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
    if t.is_floating_point() and t.numel():
        quantized = _quantize(t)
        if quantized is not None:
            q, lo, scale = quantized
            return _entry(name, t, "int8", lo=lo, scale=scale), q
    return _entry(name, t, "raw"), t


CODECS: dict[str, NoneCodec | Fp16Codec | Int8Codec] = {
    c.name: c for c in (NoneCodec(), Fp16Codec(), Int8Codec())
}


def codec_for(spec: str | Spec) -> NoneCodec | Fp16Codec | Int8Codec:
    """The stateless codec of ``spec``; :class:`CompressError` for ``topk``, which needs a
    stream (:class:`TopKSender`, :class:`TopKReceiver`)."""
    parsed = parse_spec(spec)
    if parsed.mode == "topk":
        raise CompressError(
            f"transfer.compress {parsed}: top-k needs a stream per served state "
            "(TopKSender / TopKReceiver), not a stateless codec"
        )
    return CODECS[parsed.mode]


def encode_state(state: Mapping[str, torch.Tensor], spec: str | Spec) -> Mapping[str, torch.Tensor]:
    """``state``'s wire form under ``spec`` (``none``: ``state`` itself)."""
    return codec_for(spec).encode(state)


# ----------------------------------------------------------------------------- decoding


@dataclass(frozen=True)
class _Header:
    codec: str
    entries: list[dict[str, Any]]
    stream: tuple[str, int, int | None] | None  # (epoch, seq, base)


_CODEC_FORMS = {
    "fp16": frozenset({"raw", "fp16"}),
    "int8": frozenset({"raw", "int8"}),
    "topk": frozenset({"raw", "int8", "topk"}),
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _read_header(wire: Any) -> _Header:
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
    if not _is_int(version) or version != VERSION:
        raise CompressError(f"unsupported compressed-state version {version!r}")
    if not isinstance(codec, str) or codec not in _CODEC_FORMS:
        raise CompressError(f"unknown codec {codec!r}; known: {sorted(_CODEC_FORMS)}")
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
        if (
            not _is_int(seq)
            or seq < 0
            or not (base is None or (_is_int(base) and 0 <= base <= seq))
        ):
            raise CompressError(f"stream seq {seq!r} / base {base!r} out of range")
        stream = (epoch, seq, base)
    return _Header(codec, entries, stream)


def _check_shape(shape: Any, where: str) -> list[int]:
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise CompressError(f"{where}: shape must be a list of at most {MAX_NDIM} ints")
    if not all(_is_int(d) and d >= 0 for d in shape):
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


def _decode_entries(
    header: _Header, wire: Mapping[str, Any], max_bytes: int, base: Mapping[str, Any] | None
) -> State:
    """The state the checked ``header`` and ``wire`` describe; ``base`` supplies what a
    ``topk`` entry does not send."""
    forms = _CODEC_FORMS[header.codec]
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


def decode_state(wire: Mapping[str, torch.Tensor], *, max_bytes: int) -> Mapping[str, torch.Tensor]:
    """The state ``wire`` carries, whatever codec made it (its header says): ``wire``
    itself when it is not compressed; a ``fp16``, ``int8`` or dense ``topk`` state decoded
    (the entries' order kept). A decoded state of more than ``max_bytes`` bytes, anything
    malformed, and a top-k delta (which needs its stream's base: :class:`TopKReceiver`)
    raise :class:`CompressError`."""
    if not isinstance(wire, Mapping):
        raise CompressError(f"a state must be a map, got {type(wire).__name__}")
    if HEADER not in wire:
        return wire
    header = _read_header(wire)
    if header.stream is not None and header.stream[2] is not None:
        raise CompressError(
            "a top-k delta needs the stream's base (this node keeps no top-k stream)"
        )
    return _decode_entries(header, wire, max_bytes, None)


def codec_of(wire: Mapping[str, Any]) -> str | None:
    """The codec whose header ``wire`` (a state as it arrived) carries, None when it is not
    compressed; :class:`CompressError` when the header is malformed."""
    if not isinstance(wire, Mapping):
        raise CompressError(f"a state must be a map, got {type(wire).__name__}")
    return _read_header(wire).codec if HEADER in wire else None


def parse_base(value: Any) -> tuple[str, int] | None:
    """The base a pull request names (its body's optional ``base``: ``[epoch, seq]`` of the
    sender's published estimate the puller holds, docs/wire.md, "Compression"), None when
    it names none. Untrusted: anything but a list of a string of 1 to 64 characters and an
    int in ``[0, 2**63)`` raises :class:`CompressError`."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise CompressError(f"base must be [epoch, seq], got {type(value).__name__}")
    epoch, seq = value
    if not isinstance(epoch, str) or not 0 < len(epoch) <= MAX_EPOCH_CHARS:
        raise CompressError(f"base epoch must be a string of 1 to {MAX_EPOCH_CHARS} characters")
    if not _is_int(seq) or not 0 <= seq <= MAX_SEQ:
        raise CompressError("base seq must be an int in [0, 2**63)")
    return epoch, seq


# ----------------------------------------------------------------------------- top-k


def topk_positions(change: torch.Tensor, rho: float) -> torch.Tensor:
    """Flat positions (int64, increasing) of the ``⌈rho·n⌉`` largest ``|change|`` values
    of ``change`` (ties: any of them), leaving out those that are exactly 0 (sending them
    changes nothing)."""
    flat = change.reshape(-1)
    n = flat.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.int64)
    mag = flat.abs()
    k = min(n, max(1, math.ceil(rho * n)))
    pos = torch.arange(n) if k == n else torch.topk(mag, k, sorted=False).indices
    pos = pos[mag[pos] > 0]
    return pos.sort().values


def _layout(state: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    return [(k, v.dtype, tuple(v.shape)) for k, v in state.items()]


class TopKSender:
    """The sending end of one top-k stream: one state a node serves round after round (one
    part of its model), with error feedback through the published estimate (module
    docstring: ``P_t = P_{t-1} + M_t ⊙ (x_t - P_{t-1})``).

    :meth:`publish` takes the state of each round (once per round, whether or not anybody
    pulls); :meth:`message` answers a receiver that holds ``base``. The sender keeps the
    positions sent in its last ``window`` publishes, so a receiver up to ``window`` rounds
    behind still gets a delta. ``epoch`` names the stream (random by default): a sender
    that restarts, or whose layout changes, starts a new epoch, and every base of the old
    one gets a dense state."""

    def __init__(self, rho: float, *, window: int = 4, epoch: str | None = None):
        if not 0 < rho <= 1:
            raise CompressError(f"topk rho must be in (0, 1], got {rho}")
        if window < 1:
            raise CompressError(f"topk window must be at least 1, got {window}")
        self.rho = rho
        self.window = window
        self.epoch = epoch or secrets.token_hex(8)
        self.seq = 0
        self.estimate: State | None = None
        # per publish: seq and, per tensor, the positions sent (None: the whole tensor)
        self._sent: deque[tuple[int, dict[str, torch.Tensor | None]]] = deque(maxlen=window)

    def error(self, state: Mapping[str, torch.Tensor]) -> State:
        """``e = x - P``: what of ``state`` (the one last published) the published estimate
        has not carried yet, the residual the next publish adds to its change."""
        if self.estimate is None:
            raise CompressError("nothing published yet")
        return {k: state[k].detach().cpu() - v for k, v in self.estimate.items()}

    def publish(self, state: Mapping[str, torch.Tensor]) -> int:
        """Move the estimate to ``state`` (this round's) and return its sequence number. The
        first state, or one of another layout (a new epoch), is published whole."""
        x = {name: _tensor(name, v).cpu() for name, v in state.items()}
        prev = self.estimate
        if prev is not None and _layout(prev) != _layout(x):
            self.epoch = secrets.token_hex(8)
            self._sent.clear()
            prev = None
        sent: dict[str, torch.Tensor | None] = {}
        estimate: State = {}
        for name, xt in x.items():
            if prev is None:
                estimate[name], sent[name] = xt.clone(), None
                continue
            p = prev[name]
            exact = not xt.is_floating_point() or not xt.numel()
            if exact or not bool(torch.isfinite(xt).all()) or not bool(torch.isfinite(p).all()):
                # non-floating, empty or non-finite: sent whole (the receiver sees it as is)
                estimate[name], sent[name] = xt.clone(), None
                continue
            wide = torch.promote_types(xt.dtype, torch.float32)
            pos = topk_positions(xt.to(wide) - p.to(wide), self.rho)
            new = p.clone()
            new.view(-1)[pos] = xt.reshape(-1)[pos]
            estimate[name], sent[name] = new, pos
        self.estimate = estimate
        self.seq += 1
        self._sent.append((self.seq, sent))
        return self.seq

    def message(self, base: tuple[str, int] | None, *, dense: str = "raw") -> State:
        """The wire state that brings a receiver holding ``base`` (``(epoch, seq)`` of the
        estimate it holds, None: none) to the current estimate: a delta when ``base`` is of
        this epoch and at most ``window`` publishes old, else the estimate dense (``raw``:
        exact, the receiver then holds it; ``int8``: a quarter of the bytes, the receiver
        then holds no base)."""
        if self.estimate is None:
            raise CompressError("nothing published yet")
        if dense not in ("raw", "int8"):
            raise CompressError(f"dense form {dense!r}: raw or int8")
        if self.answers(base) is None:
            return self._dense(dense)
        assert base is not None
        entries: list[dict] = []
        tensors: State = {}
        for name, p in self.estimate.items():
            changed = [sent[name] for seq, sent in self._sent if seq > base[1]]
            if any(c is None for c in changed):
                entries.append(_entry(name, p, "raw"))
                tensors[name] = p
                continue
            pos = torch.unique(torch.cat(changed)) if changed else torch.empty(0, dtype=torch.int64)
            idx_dtype = torch.int32 if p.numel() <= _INT32_MAX else torch.int64
            sparse = pos.numel() * (p.element_size() + (4 if idx_dtype == torch.int32 else 8))
            if sparse >= p.numel() * p.element_size():  # dense is no larger
                entries.append(_entry(name, p, "raw"))
                tensors[name] = p
                continue
            entries.append(_entry(name, p, "topk"))
            tensors[name] = p.reshape(-1)[pos].clone()
            tensors[name + IDX_SUFFIX] = pos.to(idx_dtype)
        stream = {"epoch": self.epoch, "seq": self.seq, "base": base[1]}
        return _pack("topk", entries, tensors, stream)

    def answers(self, base: tuple[str, int] | None) -> int | None:
        """The sequence number :meth:`message` answers ``base`` with a delta from (``base``'s
        own), None when it answers with a dense state (no base, another epoch, outside the
        window, nothing published)."""
        if self.estimate is None or base is None or base[0] != self.epoch:
            return None
        # the oldest base a delta can start from; never 0 (no receiver holds what came
        # before the first publish)
        oldest = max(self._sent[0][0] - 1, 1)
        return base[1] if oldest <= base[1] <= self.seq else None

    def view(self) -> TopKSender:
        """This sender as it stands (its current publish): a copy that later publishes
        leave as it is, whose :meth:`message` answers from this publish's estimate (shared,
        never modified: a publish makes a new one)."""
        frozen = TopKSender(self.rho, window=self.window, epoch=self.epoch)
        frozen.seq, frozen.estimate = self.seq, self.estimate
        frozen._sent = deque(self._sent, maxlen=self.window)
        return frozen

    def _dense(self, form: str) -> State:
        assert self.estimate is not None
        entries: list[dict] = []
        tensors: State = {}
        for name, p in self.estimate.items():
            if form == "int8":
                entry, data = _int8_or_raw(name, p)
            else:
                entry, data = _entry(name, p, "raw"), p
            entries.append(entry)
            tensors[name] = data
        stream = {"epoch": self.epoch, "seq": self.seq, "base": None}
        return _pack("topk", entries, tensors, stream)


class TopKReceiver:
    """The receiving end of one top-k stream (one sender's state, one part): it holds the
    sender's estimate it last rebuilt exactly, and :attr:`base` names it for the next pull
    request."""

    def __init__(self) -> None:
        self.base: tuple[str, int] | None = None
        self.estimate: State | None = None

    def apply(self, wire: Mapping[str, torch.Tensor], *, max_bytes: int) -> State:
        """The state ``wire`` (a top-k message of this stream) carries, at most
        ``max_bytes`` decoded; :class:`CompressError` when it is malformed, not top-k, or
        a delta against a base this receiver does not hold. An exact message (no int8
        tensor) becomes the held base; a lossy dense one leaves none."""
        header = _read_header(wire)
        if header.codec != "topk" or header.stream is None:
            raise CompressError(f"expected a topk message, got codec {header.codec!r}")
        epoch, seq, base = header.stream
        held = None
        if base is not None:
            if self.base != (epoch, base) or self.estimate is None:
                raise CompressError(
                    f"a delta against base {(epoch, base)} but this receiver holds {self.base}"
                )
            held = self.estimate
        state = _decode_entries(header, wire, max_bytes, held)
        if any(e["form"] == "int8" for e in header.entries):
            self.base, self.estimate = None, None
        else:
            self.base = (epoch, seq)
            self.estimate = {k: v.clone() for k, v in state.items()}
        return state
