"""Digests that verify a reassembled weight transfer.

The sender names the algorithm in the transfer metadata; the receiver accepts only the names
listed in :data:`DIGESTS`. Which one a node uses depends on what the digest has to vouch for
(:func:`transfer_digest`, docs/wire.md, "Digests"):

- In a **signed** swarm the digest in the signed ``xfer_meta`` is what authenticates the
  chunks (their data is not signed one by one), so it must resist a forger: BLAKE3 (the
  ``blake3`` package; 15 ms for a ResNet18 state here against 46 ms for SHA-256), SHA-256
  accepted from peers without BLAKE3. A receiver in a signed swarm refuses any other
  (:data:`AUTHENTICATING`).
- In an **unsigned** swarm no message is authenticated (any broker client can send any
  metadata with any digest), so the digest only has to catch a corrupt or misassembled
  transfer: XXH3-128 (the ``xxhash`` package), about ten times faster than BLAKE3, which
  matters because the receiver hashes every byte it pulls and on a small device that hash
  competes with the transfer for the CPU.

:data:`HASH_POOL` is the process's one hashing thread: the MQTT lane hashes a transfer's
reassembled prefix there as chunks arrive (hashers release the GIL, so it runs beside the
event loop). One worker keeps each transfer's updates in order, and a process that packs
hundreds of nodes keeps one thread for all of them rather than one per node. The direct
lane hashes on the event loop instead, each piece as the socket writes it
(:mod:`p2pfl.wire.direct`).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
from collections.abc import Callable
from typing import Any

DIGESTS: dict[str, Callable[[], Any]] = {"sha256": hashlib.sha256}
try:  # pragma: no cover - blake3 is a declared dependency; this guards exotic platforms
    import blake3 as _blake3

    DIGESTS["blake3"] = _blake3.blake3
except ImportError:  # pragma: no cover
    _blake3 = None

try:  # pragma: no cover - xxhash is a declared dependency; this guards exotic platforms
    import xxhash as _xxhash

    DIGESTS["xxh3_128"] = _xxhash.xxh3_128
except ImportError:  # pragma: no cover
    _xxhash = None

AUTHENTICATING = frozenset(name for name in ("blake3", "sha256") if name in DIGESTS)
DEFAULT_DIGEST = "blake3" if "blake3" in DIGESTS else "sha256"  # authenticating
CHECKSUM_DIGEST = "xxh3_128" if "xxh3_128" in DIGESTS else DEFAULT_DIGEST


def transfer_digest(signed: bool) -> str:
    """The digest a node puts on the states it serves: :data:`DEFAULT_DIGEST` (BLAKE3) when
    its swarm signs messages, :data:`CHECKSUM_DIGEST` (XXH3-128) when it does not."""
    return DEFAULT_DIGEST if signed else CHECKSUM_DIGEST


HASH_POOL = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="p2pfl-digest")


def new_hasher(name: str) -> Any:
    """A fresh incremental hasher (``update``/``hexdigest``); ValueError for unknown names."""
    try:
        return DIGESTS[name]()
    except KeyError:
        raise ValueError(f"unsupported digest {name!r}; known: {sorted(DIGESTS)}") from None


def hexdigest(data: Any, name: str = DEFAULT_DIGEST) -> str:
    h = new_hasher(name)
    h.update(data)
    return h.hexdigest()
