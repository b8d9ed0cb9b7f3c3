"""Compression of the states that travel (docs/wire.md, "Compression"): ``transfer.compress``
parsed (:class:`Spec`, :func:`parse_spec`), the stateless codecs, and decoding whatever
codec a peer used. Pure: no transport, no event loop. ``transfer.compress`` names the mode:

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
- ``topk(rho)``: a stream per served state with error feedback, :mod:`p2pfl.wire.topk`
  (:class:`TopKSender` / :class:`TopKReceiver`, re-exported here); it has no stateless
  codec (:func:`codec_for` refuses it).

Every non-floating tensor travels raw. Non-finite values never make a codec fail: ``fp16``
keeps them, ``int8`` and ``topk`` send that tensor raw, so the decoded state holds exactly
what was sent and admission (``p2pfl/learning/admission.py``) sees them.

The wire form (a header tensor, :data:`HEADER`, and one entry per tensor) and its checks
are :mod:`p2pfl.wire.compress_format`'s. :func:`decode_state` decodes any codec but a
top-k delta, which needs its stream's base (:meth:`TopKReceiver.apply`); both refuse with
:class:`CompressError` anything malformed, and a decoded size over the caller's limit
before any allocation.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from p2pfl.wire.compress_format import (
    HEADER,
    MAX_HEADER_BYTES,
    CompressError,
    checked_tensor,
    decode_entries,
    int8_or_raw,
    pack,
    read_header,
    tensor_entry,
)
from p2pfl.wire.topk import TopKReceiver, TopKSender, parse_base, topk_positions

__all__ = [
    "CODECS",
    "HEADER",
    "MAX_HEADER_BYTES",
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

FP16_MAX = 65504.0  # float16's largest finite value
SPEC_RE = re.compile(r"^(none|fp16|int8|topk\((0?\.\d+|1(\.0*)?)\))$")  # the schema's


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


def is_compressed(wire: Mapping[str, Any]) -> bool:
    """Whether ``wire`` (a state as it arrived) is in a compressed form (holds :data:`HEADER`)."""
    return HEADER in wire


def _fits_fp16(t: torch.Tensor) -> bool:
    """Every finite value of ``t`` is within float16's range (non-finite ones cast to
    themselves)."""
    finite = torch.nan_to_num(t.abs(), nan=0.0, posinf=0.0)
    return bool(finite.max() <= FP16_MAX)


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
            t = checked_tensor(name, value)
            if t.dtype in (torch.float32, torch.float64) and t.numel() and _fits_fp16(t):
                entries.append(tensor_entry(name, t, "fp16"))
                tensors[name] = t.to(torch.float16)
            else:
                entries.append(tensor_entry(name, t, "raw"))
                tensors[name] = t
        return pack(self.name, entries, tensors)

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
            t = checked_tensor(name, value)
            entry, data = int8_or_raw(name, t)
            entries.append(entry)
            tensors[name] = data
        return pack(self.name, entries, tensors)

    def decode(self, wire: Mapping[str, torch.Tensor], *, max_bytes: int) -> State:
        """The state ``wire`` carries (:func:`decode_state`)."""
        return decode_state(wire, max_bytes=max_bytes)


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
    header = read_header(wire)
    if header.stream is not None and header.stream[2] is not None:
        raise CompressError(
            "a top-k delta needs the stream's base (this node keeps no top-k stream)"
        )
    return decode_entries(header, wire, max_bytes, None)


def codec_of(wire: Mapping[str, Any]) -> str | None:
    """The codec whose header ``wire`` (a state as it arrived) carries, None when it is not
    compressed; :class:`CompressError` when the header is malformed."""
    if not isinstance(wire, Mapping):
        raise CompressError(f"a state must be a map, got {type(wire).__name__}")
    return read_header(wire).codec if HEADER in wire else None
