"""msgpack + tensors, without pickle: peers are untrusted (docs/wire.md, "Codec").

Two ways to move tensors:

- :func:`encode` / :func:`decode` for messages: nested maps, lists, str, int, float, bool,
  None and bytes, where a ``torch.Tensor`` or ``numpy.ndarray`` becomes the map
  ``{"__tensor__": 1, "dtype": str, "shape": [...], "data": bytes}`` (raw little-endian,
  C-contiguous). Tensors always decode as CPU ``torch.Tensor`` (numpy arrays included).
  Map keys must be ``str`` (or ``bytes``): the decoder refuses other keys, which keeps
  crafted-hash-collision maps out.
- :func:`state_to_buffer` / :func:`buffer_to_state` for weight transfers: every tensor's
  bytes in ONE ``bytearray`` plus a small index ``[{name, dtype, shape, offset, nbytes}]``.
  The buffer is what is chunked over the wire and reassembled into a preallocated buffer;
  the receiver gets zero-copy tensors over it.

Every decoding path validates what it reads and raises :class:`CodecError` (a
``ValueError``) with a specific message; it never raises anything else on bad bytes.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np
import torch

from p2pfl.wire.untrusted import MAX_DEPTH, TENSOR_TAG, CodecError, unpack_untrusted

__all__ = [
    "ALLOWED_DTYPES",
    "CodecError",
    "MAX_DEPTH",
    "MAX_NDIM",
    "buffer_to_state",
    "decode",
    "encode",
    "state_nbytes",
    "state_to_buffer",
]

if sys.byteorder != "little":  # pragma: no cover - every supported torch platform is LE
    raise ImportError("p2pfl.wire.codec assumes a little-endian host")


ALLOWED_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in ALLOWED_DTYPES.items()}
_ITEMSIZE: dict[str, int] = {
    k: torch.empty((), dtype=v).element_size() for k, v in ALLOWED_DTYPES.items()
}
# numpy dtype names that map onto an allowed torch dtype (numpy has no bfloat16)
_NUMPY_OK = frozenset(ALLOWED_DTYPES) - {"bfloat16"}

MAX_NDIM = 32  # dimensions of one tensor (torch's own limit is 64)
MAX_DIM = 1 << 48  # one dimension; only reachable by zero-element tensors anyway
ALIGN = 64  # state_to_buffer: every tensor starts at a multiple of this offset
_TENSOR_KEYS = frozenset({TENSOR_TAG, "dtype", "shape", "data"})
_INDEX_KEYS = frozenset({"name", "dtype", "shape", "offset", "nbytes"})
_CPU = torch.device("cpu")


# ----------------------------------------------------------------------------- encode


def _tensor_bytes(t: torch.Tensor) -> tuple[str, list[int], memoryview]:
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise CodecError(
            f"cannot encode tensor of dtype {t.dtype}; allowed: {sorted(ALLOWED_DTYPES)}"
        )
    shape = list(t.shape)
    flat = t.detach()
    if flat.device != _CPU:
        flat = flat.cpu()
    flat = flat.reshape(-1)  # copies only if not contiguous
    return name, shape, memoryview(flat.view(torch.uint8).numpy())


def _array_bytes(a: np.ndarray) -> tuple[str, list[int], memoryview]:
    name = a.dtype.name
    if name not in _NUMPY_OK:
        raise CodecError(
            f"cannot encode numpy array of dtype {a.dtype}; allowed: {sorted(_NUMPY_OK)}"
        )
    shape = list(a.shape)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    flat = np.ascontiguousarray(a).reshape(-1)
    return name, shape, memoryview(flat.view(np.uint8))


def _default(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        dtype, shape, data = _tensor_bytes(obj)
    elif isinstance(obj, np.ndarray):
        dtype, shape, data = _array_bytes(obj)
    elif isinstance(obj, np.generic):  # numpy scalar: its Python value
        return obj.item()
    else:
        raise CodecError(f"cannot encode object of type {type(obj).__name__}")
    return {TENSOR_TAG: 1, "dtype": dtype, "shape": shape, "data": data}


def encode(obj: Any) -> bytes:
    """msgpack bytes for ``obj`` (see module docstring for what may be in it).

    Tensor bytes are handed to msgpack as memoryviews (no intermediate ``bytes``), packed
    into one growing buffer (``autoreset=False``) and copied out once.
    """
    packer = msgpack.Packer(use_bin_type=True, autoreset=False, default=_default)
    try:
        packer.pack(obj)
    except CodecError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise CodecError(f"cannot encode: {exc}") from None
    return packer.bytes()


# ----------------------------------------------------------------------------- decode


def _check_shape(shape: Any, where: str) -> list[int]:
    if not isinstance(shape, (list, tuple)):
        raise CodecError(f"{where}: shape must be a list, got {type(shape).__name__}")
    if len(shape) > MAX_NDIM:
        raise CodecError(f"{where}: {len(shape)} dimensions exceed the limit of {MAX_NDIM}")
    for d in shape:
        if not isinstance(d, int) or isinstance(d, bool):
            raise CodecError(f"{where}: shape entries must be ints, got {d!r}")
        if d < 0 or d > MAX_DIM:
            raise CodecError(f"{where}: shape entry {d} out of range")
    return list(shape)


def _check_dtype(dtype: Any, where: str) -> str:
    if not isinstance(dtype, str) or dtype not in ALLOWED_DTYPES:
        raise CodecError(f"{where}: unknown dtype {dtype!r}; allowed: {sorted(ALLOWED_DTYPES)}")
    return dtype


def _over_bytes(u8: torch.Tensor, dtype: str, shape: list[int], where: str) -> torch.Tensor:
    """``u8`` (a 1-D uint8 tensor of exactly the right size) viewed as ``dtype``/``shape``."""
    if dtype == "bool" and u8.numel() and int(u8.max()) > 1:
        raise CodecError(f"{where}: bool tensor holds bytes other than 0 and 1")
    if dtype != "uint8":
        u8 = u8.view(ALLOWED_DTYPES[dtype])
    return u8.view(shape)


def _tensor_from_map(obj: dict, where: str) -> torch.Tensor:
    if obj.keys() != _TENSOR_KEYS:
        extra = sorted(map(repr, obj.keys() - _TENSOR_KEYS))
        missing = sorted(_TENSOR_KEYS - obj.keys())
        raise CodecError(f"{where}: tensor map has keys missing {missing} / unexpected {extra}")
    if obj[TENSOR_TAG] != 1 or isinstance(obj[TENSOR_TAG], bool):
        raise CodecError(f"{where}: unsupported tensor map version {obj[TENSOR_TAG]!r}")
    dtype = _check_dtype(obj["dtype"], where)
    shape = _check_shape(obj["shape"], where)
    data = obj["data"]
    if not isinstance(data, bytes):
        raise CodecError(f"{where}: tensor data must be bin, got {type(data).__name__}")
    expected = math.prod(shape) * _ITEMSIZE[dtype]
    if len(data) != expected:
        raise CodecError(
            f"{where}: tensor data has {len(data)} bytes, dtype {dtype} shape {shape} needs {expected}"
        )
    if expected == 0:
        return torch.empty(shape, dtype=ALLOWED_DTYPES[dtype])
    # one copy into a writable bytearray: frombuffer over it is zero-copy and bf16-safe
    u8 = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return _over_bytes(u8, dtype, shape, where)


def _walk(obj: Any, depth: int) -> Any:
    """Check nesting and turn tensor maps into tensors, in place."""
    if depth > MAX_DEPTH:
        raise CodecError(f"message nested deeper than {MAX_DEPTH} levels")
    if isinstance(obj, dict):
        if TENSOR_TAG in obj:
            return _tensor_from_map(obj, f"tensor at depth {depth}")
        for k, v in obj.items():
            if isinstance(v, (dict, list)):
                obj[k] = _walk(v, depth + 1)
            elif isinstance(v, msgpack.Timestamp):
                raise CodecError("msgpack timestamps are not allowed")
        return obj
    if isinstance(obj, list):
        for i, v in enumerate(obj):
            if isinstance(v, (dict, list)):
                obj[i] = _walk(v, depth + 1)
            elif isinstance(v, msgpack.Timestamp):
                raise CodecError("msgpack timestamps are not allowed")
        return obj
    if isinstance(obj, msgpack.Timestamp):
        raise CodecError("msgpack timestamps are not allowed")
    return obj


def decode(data: bytes | bytearray | memoryview, max_size: int) -> Any:
    """Decode one message of at most ``max_size`` bytes; raise :class:`CodecError` on
    anything that is not exactly one valid message (oversized, truncated, trailing bytes,
    not msgpack, ext types, too deep, bad tensor maps)."""
    return _walk(unpack_untrusted(data, max_size), 1)


# ----------------------------------------------------------------------------- states


def _as_tensor(name: Any, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, np.ndarray):
        if value.dtype.name not in _NUMPY_OK:
            raise CodecError(f"state[{name!r}]: unsupported numpy dtype {value.dtype}")
        return torch.from_numpy(np.ascontiguousarray(value))
    raise CodecError(f"state[{name!r}]: expected a tensor, got {type(value).__name__}")


def state_to_buffer(state: Mapping[str, torch.Tensor]) -> tuple[list[dict], bytearray]:
    """Concatenate every tensor's raw bytes into one ``bytearray``.

    Returns ``(index, buf)``; ``index`` has one ``{"name", "dtype", "shape", "offset",
    "nbytes"}`` per tensor, in ``state`` order. Each tensor starts at a multiple of
    :data:`ALIGN` bytes so that the receiver's zero-copy views are aligned. GPU and
    non-contiguous tensors are fine (copied straight into the buffer).
    """
    tensors: list[tuple[str, torch.Tensor, str, int, int]] = []
    total = 0
    for name, value in state.items():
        if not isinstance(name, str):
            raise CodecError(f"state keys must be str, got {type(name).__name__}")
        t = _as_tensor(name, value)
        dtype = _DTYPE_NAMES.get(t.dtype)
        if dtype is None:
            raise CodecError(f"state[{name!r}]: unsupported dtype {t.dtype}")
        nbytes = t.numel() * t.element_size()
        total = -(-total // ALIGN) * ALIGN
        tensors.append((name, t, dtype, total, nbytes))
        total += nbytes
    buf = bytearray(total)
    mv = memoryview(buf)
    dst: torch.Tensor | None = None
    index = []
    for name, t, dtype, offset, nbytes in tensors:
        if nbytes:
            if t.device == _CPU and t.is_contiguous():
                # a plain memcpy: no torch intra-op threads (they contend badly with
                # training threads on small machines)
                mv[offset : offset + nbytes] = t.reshape(-1).view(torch.uint8).numpy()
            else:  # GPU or strided: one torch copy straight into place
                if dst is None:
                    dst = torch.frombuffer(buf, dtype=torch.uint8)
                part = dst[offset : offset + nbytes]
                if t.dtype != torch.uint8:
                    part = part.view(t.dtype)
                part.view(t.shape).copy_(t)
        index.append(
            {
                "name": name,
                "dtype": dtype,
                "shape": list(t.shape),
                "offset": offset,
                "nbytes": nbytes,
            }
        )
    mv.release()
    return index, buf


def _check_int(value: Any, where: str, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CodecError(f"{where}: {what} must be a non-negative int, got {value!r}")
    return value


def buffer_to_state(index: list[dict], buf: bytearray) -> dict[str, torch.Tensor]:
    """Tensors over ``buf`` as described by ``index`` (zero-copy: they share ``buf``'s memory
    and keep it alive). The index is untrusted: names must be unique strings, dtypes allowed,
    shapes sane, ``nbytes`` consistent with dtype and shape, every range inside ``buf`` and
    aligned to its dtype. Ranges may overlap. Raises :class:`CodecError` otherwise."""
    if isinstance(buf, memoryview):
        if buf.readonly or not buf.contiguous:
            raise CodecError("buffer must be a writable, contiguous bytearray / memoryview")
        buf = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
    elif not isinstance(buf, bytearray):
        raise CodecError(f"buffer must be a bytearray, got {type(buf).__name__}")
    if not isinstance(index, list):
        raise CodecError(f"tensor index must be a list, got {type(index).__name__}")
    size = len(buf)
    src = torch.frombuffer(buf, dtype=torch.uint8) if size else None
    out: dict[str, torch.Tensor] = {}
    typed: dict[str, torch.Tensor] = {"uint8": src} if src is not None else {}
    for i, entry in enumerate(index):
        where = f"index[{i}]"
        if not isinstance(entry, dict):
            raise CodecError(f"{where}: entry must be a map, got {type(entry).__name__}")
        if entry.keys() != _INDEX_KEYS:
            missing = sorted(_INDEX_KEYS - entry.keys())
            extra = sorted(map(repr, entry.keys() - _INDEX_KEYS))
            raise CodecError(f"{where}: keys missing {missing} / unexpected {extra}")
        name = entry["name"]
        if not isinstance(name, str):
            raise CodecError(f"{where}: name must be a string, got {name!r}")
        where = f"index[{i}] ({name!r})"
        if name in out:
            raise CodecError(f"{where}: duplicate tensor name")
        dtype = _check_dtype(entry["dtype"], where)
        shape = _check_shape(entry["shape"], where)
        offset = _check_int(entry["offset"], where, "offset")
        nbytes = _check_int(entry["nbytes"], where, "nbytes")
        itemsize = _ITEMSIZE[dtype]
        expected = math.prod(shape) * itemsize
        if nbytes != expected:
            raise CodecError(
                f"{where}: nbytes {nbytes} but dtype {dtype} shape {shape} needs {expected}"
            )
        if offset + nbytes > size:
            raise CodecError(
                f"{where}: bytes [{offset}, {offset + nbytes}) outside buffer of {size}"
            )
        if nbytes == 0:
            out[name] = torch.empty(shape, dtype=ALLOWED_DTYPES[dtype])
            continue
        if offset % itemsize:
            raise CodecError(f"{where}: offset {offset} not aligned to {dtype} ({itemsize} bytes)")
        assert src is not None
        if dtype == "bool":  # its bytes are checked: 0 and 1 only
            out[name] = _over_bytes(src[offset : offset + nbytes], dtype, shape, where)
            continue
        base = typed.get(dtype)
        if base is None:  # the whole buffer as this dtype, made once per dtype
            base = typed[dtype] = src[: size - size % itemsize].view(ALLOWED_DTYPES[dtype])
        # one op per tensor (a slice, a dtype view and a shape view cost three times as much)
        out[name] = base.as_strided(shape, _contiguous_strides(shape), offset // itemsize)
    return out


def _contiguous_strides(shape: list[int]) -> list[int]:
    strides, step = [0] * len(shape), 1
    for i in range(len(shape) - 1, -1, -1):
        strides[i] = step
        step *= shape[i]
    return strides


def state_nbytes(state: Mapping[str, Any]) -> int:
    """Bytes of tensor data in ``state`` (tensors and numpy arrays; other values count 0)."""
    total = 0
    for v in state.values():
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        elif isinstance(v, np.ndarray):
            total += v.nbytes
    return total
