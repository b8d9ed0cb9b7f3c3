"""The message envelope and its frames (docs/wire.md, "Envelope" and "Frames").

Every message between nodes is an :class:`Envelope` — swarm, sender, round, attempt, kind,
id, timestamp, body — packed with :mod:`p2pfl.wire.codec`, with an optional raw binary tail
(transfer chunks) and an optional signature (:mod:`p2pfl.security.signing`).
:meth:`Envelope.unpack` checks the shape of untrusted bytes and raises
:class:`~p2pfl.wire.codec.CodecError` for anything off (:class:`VersionError` for a protocol
version outside :data:`p2pfl.MIN_PROTOCOL_VERSION`–:data:`p2pfl.PROTOCOL_VERSION`).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from p2pfl import MIN_PROTOCOL_VERSION, PROTOCOL_VERSION
from p2pfl.wire.untrusted import CodecError, decode_plain


def _encode(obj: Any) -> bytes:
    """:func:`p2pfl.wire.codec.encode` (tensors: torch), imported with the first message that
    needs it, so a reader of presence and status (the dashboard) imports no torch; the
    name is then bound to it, at no cost a call."""
    global _encode
    from p2pfl.wire.codec import encode

    _encode = encode
    return encode(obj)


def _decode(data: Any, max_size: int) -> Any:
    """:func:`p2pfl.wire.codec.decode`, imported as :func:`_encode` is."""
    global _decode
    from p2pfl.wire.codec import decode

    _decode = decode
    return decode(data, max_size)


def same_body(a: Any, b: Any) -> bool:
    """Whether two message bodies travel as the same bytes (their :mod:`~p2pfl.wire.codec`
    encodings are equal: lists and tuples alike, tensors bit for bit)."""
    return _encode(a) == _encode(b)


KINDS = frozenset(
    {
        "presence",
        "gossip",
        "announce",
        "pull",
        "report",
        "xfer_meta",
        "xfer_chunk",
        "pull_error",
        "status",  # telemetry for observers (p2pfl.wire.status); no node handles it
        "audit",  # an auditor's verdict on a round's aggregate (centralized methods)
        # indirect probes of a suspected peer (docs/wire.md, "Partitions")
        "probe_req",
        "probe_ack",
        # the next roster whole, asked of an aggregator (docs/wire.md, "Roster by difference")
        "roster_req",
        "roster",
        # a peer's whole model layout, asked when its presence's differs (docs/wire.md,
        # "Model layout")
        "layout_req",
        "layout",
        # secure aggregation (privacy.secagg; docs/wire.md, "Secure aggregation")
        "sa_keys",
        "sa_step",
        "sa_shares",
        "sa_bundles",
        "sa_ready",
        "sa_unmask",
        "sa_reveal",
    }
)
# broadcast on a node's gossip topic
GOSSIP_KINDS = frozenset({"gossip", "announce", "audit", "sa_keys"})
# small messages handed to ``on_inbox``
INBOX_KINDS = frozenset(
    {
        "report",
        "probe_req",
        "probe_ack",
        "roster_req",
        "roster",
        "layout_req",
        "layout",
        "sa_step",
        "sa_shares",
        "sa_bundles",
        "sa_ready",
        "sa_unmask",
        "sa_reveal",
    }
)
MAX_ATTEMPT = 1 << 16
FRAME_MAGIC = b"P2F\x01"  # a msgpack message never starts with these bytes (0x50 is a fixint)
SIGNED_MAGIC = b"P2S\x01"
SIGNATURE_BYTES = 64


class VersionError(CodecError):
    """An envelope of a protocol version this node does not speak (docs/wire.md, "Protocol
    versions"): ``version`` as read, and ``sender`` when the header names one."""

    def __init__(self, version: object, sender: str | None):
        super().__init__(
            f"protocol version {version!r}; this node speaks "
            f"{MIN_PROTOCOL_VERSION}–{PROTOCOL_VERSION}"
        )
        self.version = version
        self.sender = sender


@dataclass(frozen=True)
class Envelope:
    """One message. ``attempt`` numbers the tries at a round (the rotating aggregator's
    failover; 0 otherwise). ``ts`` is the sender's clock when it was made (replay window).
    ``data`` is an optional raw binary tail (transfer chunks).

    Frames: a plain message is the msgpack header alone; a message with a data tail is
    ``FRAME_MAGIC | u32 header length | header | data`` so a 1 MiB chunk is neither
    msgpack-encoded nor copied on decode; a signed message (:mod:`p2pfl.security.signing`) is
    ``SIGNED_MAGIC | u32 header length | header | 64-byte signature | data``. ``header``
    keeps the exact signed bytes of a received message. ``v``: the protocol version stamped
    on it (the one its sender speaks to the swarm, :mod:`p2pfl.wire.versions`)."""

    swarm: str
    sender: str
    round: int
    kind: str
    id: str
    body: Any
    data: memoryview | None = field(default=None, compare=False, repr=False)
    attempt: int = 0
    ts: float = 0.0
    sig: bytes | None = field(default=None, compare=False, repr=False)
    header: memoryview | bytes | None = field(default=None, compare=False, repr=False)
    v: int = PROTOCOL_VERSION

    def _header(self) -> bytes:
        return _encode(
            {
                "v": self.v,
                "swarm": self.swarm,
                "from": self.sender,
                "round": self.round,
                "attempt": self.attempt,
                "kind": self.kind,
                "id": self.id,
                "ts": self.ts,
                "body": self.body,
            }
        )

    def pack(self, sign: Callable[[bytes], bytes] | None = None) -> bytes:
        """The wire bytes; ``sign(header) -> 64-byte signature`` makes a signed frame."""
        header = self._header()
        if sign is not None:
            sig = sign(header)
            if len(sig) != SIGNATURE_BYTES:
                raise ValueError("signature must be 64 bytes")
            parts = [SIGNED_MAGIC, struct.pack("<I", len(header)), header, sig]
            if self.data is not None:
                parts.append(self.data)
            return b"".join(parts)
        if self.data is None:
            return header
        return b"".join((FRAME_MAGIC, struct.pack("<I", len(header)), header, self.data))

    @classmethod
    def unpack(cls, payload: bytes, max_bytes: int, tensors: bool = True) -> Envelope:
        """Decode and check the envelope's shape; raise :class:`CodecError` if it is off.
        A signature is returned in ``sig`` unchecked: verifying it is the caller's job.
        ``tensors``: tensor maps become tensors (False: a tensor is an error, and no torch
        is imported, :func:`~p2pfl.wire.untrusted.decode_plain`)."""
        data = sig = None
        magic = payload[:4]
        if magic in (FRAME_MAGIC, SIGNED_MAGIC):
            if len(payload) < 8:
                raise CodecError("truncated binary frame")
            (hlen,) = struct.unpack_from("<I", payload, 4)
            tail = 8 + hlen + (SIGNATURE_BYTES if magic == SIGNED_MAGIC else 0)
            if tail > len(payload):
                raise CodecError("binary frame header runs past the payload")
            view = memoryview(payload)
            if magic == SIGNED_MAGIC:
                sig = bytes(view[8 + hlen : tail])
                data = view[tail:] if tail < len(payload) else None
            else:
                data = view[tail:]
            payload = view[8 : 8 + hlen]
        obj = _decode(payload, max_bytes) if tensors else decode_plain(payload, max_bytes)
        if not isinstance(obj, dict):
            raise CodecError("envelope is not a map")
        version = obj.get("v")
        if (
            not isinstance(version, int)
            or isinstance(version, bool)
            or not MIN_PROTOCOL_VERSION <= version <= PROTOCOL_VERSION
        ):
            sender = obj.get("from")
            named = isinstance(sender, str) and 0 < len(sender) <= 64
            raise VersionError(version, sender if named else None)
        swarm, sender, rnd, kind, mid = (
            obj.get(k) for k in ("swarm", "from", "round", "kind", "id")
        )
        if not (isinstance(swarm, str) and isinstance(sender, str) and isinstance(mid, str)):
            raise CodecError("envelope swarm/from/id must be strings")
        if not isinstance(rnd, int) or isinstance(rnd, bool) or rnd < 0:
            raise CodecError(f"envelope round must be a non-negative int, got {rnd!r}")
        attempt = obj.get("attempt", 0)
        if not isinstance(attempt, int) or isinstance(attempt, bool):
            raise CodecError(f"envelope attempt must be an int, got {attempt!r}")
        if not 0 <= attempt <= MAX_ATTEMPT:
            raise CodecError(f"envelope attempt {attempt} out of range")
        ts = obj.get("ts", 0.0)
        if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not math.isfinite(ts):
            raise CodecError(f"envelope ts must be a number, got {ts!r}")
        if kind not in KINDS:
            raise CodecError(f"unknown message kind {kind!r}")
        if not 0 < len(mid) <= 64 or not 0 < len(sender) <= 64:
            raise CodecError("envelope id/from length out of range")
        body = obj.get("body")
        return cls(
            swarm, sender, rnd, kind, mid, body, data, attempt, float(ts), sig, payload, version
        )
