"""The one msgpack decoder for bytes a peer sent: a node's messages
(:func:`p2pfl.wire.codec.decode`) and a site's (:mod:`p2pfl.sites.consent.messages`) both
read them through :func:`unpack_untrusted`, torch-free.

Exactly one value, ``str`` map keys only (no crafted-hash-collision maps), strings as
``str`` (valid UTF-8), no ext types, every length bounded by the payload's own. Anything
else is :class:`UntrustedBytes` (a ``ValueError``) with a specific reason; nothing else is
ever raised on bad bytes. What a value may hold (its depth, no msgpack timestamps,
tensor maps) is its reader's walk over it, which each does anyway.
"""

from __future__ import annotations

from typing import Any

import msgpack

from p2pfl.errors import P2PFLError


class UntrustedBytes(P2PFLError, ValueError):
    """Bytes that are not exactly one valid message."""


def _reject_ext(code: int, _data: bytes) -> Any:
    raise UntrustedBytes(f"msgpack ext type {code} is not allowed")


def unpack_untrusted(data: bytes | bytearray | memoryview, max_size: int) -> Any:
    """One msgpack value of at most ``max_size`` bytes a peer sent (see the module's
    rules); :class:`UntrustedBytes` otherwise."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise UntrustedBytes(f"expected bytes, got {type(data).__name__}")
    if isinstance(data, memoryview):
        if not data.contiguous:
            raise UntrustedBytes("message buffer is not contiguous")
        data = data.cast("B") if data.format != "B" or data.ndim != 1 else data
    size = len(data)
    if size > max_size:
        raise UntrustedBytes(f"message of {size} bytes exceeds the limit of {max_size} bytes")
    if size == 0:
        raise UntrustedBytes("empty message")
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
    except UntrustedBytes:
        raise
    except msgpack.ExtraData as exc:
        raise UntrustedBytes(
            f"trailing garbage: {len(exc.extra)} bytes after the message"
        ) from None
    except msgpack.FormatError:
        raise UntrustedBytes("not a valid msgpack message: reserved or invalid type byte") from None
    except msgpack.StackError:
        raise UntrustedBytes("message nested too deep") from None
    except UnicodeDecodeError as exc:
        raise UntrustedBytes(f"invalid UTF-8 in a string: {exc.reason}") from None
    except ValueError as exc:
        msg = str(exc) or type(exc).__name__
        if "incomplete" in msg.lower():
            raise UntrustedBytes(f"truncated message ({size} bytes)") from None
        if "max_ext_len" in msg:
            raise UntrustedBytes("msgpack ext types are not allowed") from None
        raise UntrustedBytes(f"not a valid msgpack message: {msg}") from None
    except Exception as exc:  # untrusted bytes: anything msgpack raises is a bad message
        raise UntrustedBytes(f"not a valid msgpack message: {type(exc).__name__}: {exc}") from None
    return obj
