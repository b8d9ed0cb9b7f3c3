"""The one msgpack decoder for bytes a peer sent: a node's messages
(:func:`p2pfl.wire.codec.decode`, which turns tensor maps into tensors), a site's
(:mod:`p2pfl.sites.consent.messages`) and what a dashboard reads (:func:`decode_plain`) all
read them through :func:`unpack_untrusted`, torch-free.

Exactly one value, ``str`` map keys only (no crafted-hash-collision maps), strings as
``str`` (valid UTF-8), no ext types, every length bounded by the payload's own. Anything
else is :class:`CodecError` (a ``ValueError``) with a specific reason; nothing else is
ever raised on bad bytes. What a value may hold (its depth, no msgpack timestamps,
tensor maps) is its reader's walk over it, which each does anyway.
"""

from __future__ import annotations

from typing import Any

import msgpack

from p2pfl.errors import P2PFLError

MAX_DEPTH = 32
"""The deepest nesting of maps and lists in a message."""

TENSOR_TAG = "__tensor__"
"""The key that marks a tensor map (:mod:`p2pfl.wire.codec`)."""


class CodecError(P2PFLError, ValueError):
    """Bytes (or an index) that do not describe a valid message / state."""


def _reject_ext(code: int, _data: bytes) -> Any:
    raise CodecError(f"msgpack ext type {code} is not allowed")


def unpack_untrusted(data: bytes | bytearray | memoryview, max_size: int) -> Any:
    """One msgpack value of at most ``max_size`` bytes a peer sent (see the module's
    rules); :class:`CodecError` otherwise."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError(f"expected bytes, got {type(data).__name__}")
    if isinstance(data, memoryview):
        if not data.contiguous:
            raise CodecError("message buffer is not contiguous")
        data = data.cast("B") if data.format != "B" or data.ndim != 1 else data
    size = len(data)
    if size > max_size:
        raise CodecError(f"message of {size} bytes exceeds the limit of {max_size} bytes")
    if size == 0:
        raise CodecError("empty message")
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            ext_hook=_reject_ext,
            max_str_len=size,
            max_bin_len=size,
            max_array_len=size,
            max_map_len=size // 2,
            max_ext_len=0,
        )
    except CodecError:
        raise
    except msgpack.ExtraData as exc:
        raise CodecError(f"trailing garbage: {len(exc.extra)} bytes after the message") from None
    except msgpack.FormatError:
        raise CodecError("not a valid msgpack message: reserved or invalid type byte") from None
    except msgpack.StackError:
        raise CodecError("message nested too deep") from None
    except UnicodeDecodeError as exc:
        raise CodecError(f"invalid UTF-8 in a string: {exc.reason}") from None
    except ValueError as exc:
        msg = str(exc) or type(exc).__name__
        if "incomplete" in msg.lower():
            raise CodecError(f"truncated message ({size} bytes)") from None
        if "max_ext_len" in msg:
            raise CodecError("msgpack ext types are not allowed") from None
        raise CodecError(f"not a valid msgpack message: {msg}") from None
    except Exception as exc:  # untrusted bytes: anything msgpack raises is a bad message
        raise CodecError(f"not a valid msgpack message: {type(exc).__name__}: {exc}") from None
    return obj


def decode_plain(data: bytes | bytearray | memoryview, max_size: int) -> Any:
    """:func:`unpack_untrusted`, then its value walked: at most :data:`MAX_DEPTH` deep, no
    msgpack timestamps, and no tensor map (a reader that expects none: a dashboard reading
    presence and status, without torch). :class:`CodecError` otherwise."""
    obj = unpack_untrusted(data, max_size)
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, msgpack.Timestamp):
            raise CodecError("msgpack timestamps are not allowed")
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_DEPTH:
            raise CodecError(f"message nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict) and TENSOR_TAG in value:
            raise CodecError(f"a tensor at depth {depth}, where none is expected")
        stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
    return obj
