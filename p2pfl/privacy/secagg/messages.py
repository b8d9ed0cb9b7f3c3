"""The payloads of secure aggregation, as plain data (bytes, ints, lists, str-keyed dicts)
that msgpack carries as they are. Who sends what, step by step:

1. member → aggregator ``advertise``: ``{"c_pk": 32 B, "s_pk": 32 B}``; aggregator →
   every member: ``{member: {"c_pk", "s_pk"}}`` of all that advertised.
2. member → aggregator ``share_keys``: ``{recipient: sealed bundle (bytes)}``, one per
   neighbour that advertised; aggregator → each recipient ``{sender: sealed bundle}``.
   A bundle's plaintext is :data:`BUNDLE` = ``index (uint32 BE) ‖ share of b_u (16 B) ‖
   share of s_u^SK (32 B)``, sealed under a key only ``u`` and the recipient derive.
3. (no message: the members learn from step 2 who shared keys.)
4. member → aggregator: its masked vector, ``uint64`` of the agreed length.
5. aggregator → survivors ``{"survivors": [ids], "dropped": [ids]}``; survivor →
   aggregator ``{"b": {peer: [index, share (16 B)]}, "sk": {peer: [index, share (32 B)]}}``.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

from p2pfl.privacy.secagg.errors import SecAggError
from p2pfl.privacy.secagg.primitives import KEY_BYTES, SEED_BYTES

SHARE_BYTES = {"b": SEED_BYTES, "sk": KEY_BYTES}  # a Shamir share is as long as its secret
BUNDLE = struct.Struct(f">I{SHARE_BYTES['b']}s{SHARE_BYTES['sk']}s")
KEY_FIELDS = ("c_pk", "s_pk")


def parse_keys(keys: Any, who: str) -> tuple[bytes, bytes]:
    """``(c_pk, s_pk)`` of an advertisement; :class:`SecAggError` naming ``who`` unless it
    is exactly ``{"c_pk": 32 B, "s_pk": 32 B}`` with two different keys (one key for both
    would let a rebuilt masking key decrypt the shares sent to its owner)."""
    if not isinstance(keys, Mapping) or set(keys) != set(KEY_FIELDS):
        raise SecAggError(f"keys of {who}: expected exactly {list(KEY_FIELDS)}")
    c_pk, s_pk = keys["c_pk"], keys["s_pk"]
    for name, value in (("c_pk", c_pk), ("s_pk", s_pk)):
        if not isinstance(value, bytes) or len(value) != KEY_BYTES:
            raise SecAggError(f"keys of {who}: {name} must be {KEY_BYTES} bytes")
    if c_pk == s_pk:
        raise SecAggError(f"keys of {who}: c_pk and s_pk must differ")
    return c_pk, s_pk


def pack_bundle(index: int, b_share: bytes, sk_share: bytes) -> bytes:
    """The plaintext of one share bundle."""
    return BUNDLE.pack(index, b_share, sk_share)


def unpack_bundle(plaintext: bytes, who: str) -> tuple[int, bytes, bytes]:
    """``(index, b share, s^SK share)``; :class:`SecAggError` naming ``who`` if malformed."""
    if len(plaintext) != BUNDLE.size:
        raise SecAggError(f"share bundle from {who}: malformed plaintext")
    return BUNDLE.unpack(plaintext)


def id_list(value: Any, name: str) -> list[str]:
    """A list of distinct str ids; :class:`SecAggError` naming ``name`` otherwise."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise SecAggError(f"{name}: expected a list of node ids")
    ids = list(value)
    if any(not isinstance(i, str) for i in ids) or len(set(ids)) != len(ids):
        raise SecAggError(f"{name}: expected distinct node ids (strings)")
    return ids


def parse_unmask(response: Any, who: str) -> dict[str, dict[str, tuple[int, bytes]]]:
    """``{"b": {peer: (index, share)}, "sk": {...}}`` of an unmask response;
    :class:`SecAggError` naming ``who`` when it has another shape."""
    if not isinstance(response, Mapping) or set(response) != {"b", "sk"}:
        raise SecAggError(f"unmask response of {who}: expected exactly keys 'b' and 'sk'")
    parsed: dict[str, dict[str, tuple[int, bytes]]] = {}
    for kind in ("b", "sk"):
        shares = response[kind]
        if not isinstance(shares, Mapping):
            raise SecAggError(f"unmask response of {who}: {kind!r} must map peers to shares")
        parsed[kind] = {}
        for peer, item in shares.items():
            ok = (
                isinstance(peer, str)
                and isinstance(item, (list, tuple))
                and len(item) == 2
                and isinstance(item[0], int)
                and not isinstance(item[0], bool)
                and isinstance(item[1], bytes)
                and len(item[1]) == SHARE_BYTES[kind]
            )
            if not ok:
                raise SecAggError(f"unmask response of {who}: malformed {kind!r} share")
            parsed[kind][peer] = (item[0], item[1])
    return parsed
