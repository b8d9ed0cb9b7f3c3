"""t-of-n Shamir sharing of 16- or 32-byte secrets, on pycryptodome's implementation.

pycryptodome's :class:`Crypto.Protocol.SecretSharing.Shamir` shares one 16-byte block over
GF(2^128). A longer secret (a 32-byte X25519 private key) is shared block by block with
the same ``t`` and the same holder indices, and a holder's share is its block shares
concatenated (as long as the secret). Any ``t`` shares give the secret back; ``t − 1``
reveal nothing about it (information-theoretically). The polynomials' random coefficients
come from pycryptodome's own OS-backed generator, so shares differ from run to run while
the rebuilt secret is the same.

Cost: pycryptodome's field arithmetic is pure Python; :func:`combine` of ``t`` shares is
``O(t²)`` multiplications per block (about 0.1 s per block at ``t = 25``), which is what
bounds the aggregator's time at large rounds (a smaller SecAgg+ degree keeps ``t`` small).
"""

from __future__ import annotations

from collections.abc import Sequence

from Crypto.Protocol.SecretSharing import Shamir

from p2pfl.privacy.secagg.errors import SecAggError

BLOCK = 16
SECRET_SIZES = (16, 32)


def split(secret: bytes, threshold: int, holders: int) -> list[tuple[int, bytes]]:
    """``holders`` shares ``(index, share)`` of ``secret`` (16 or 32 bytes), indices
    ``1..holders``, any ``threshold`` of which rebuild it (``1 ≤ threshold ≤ holders``)."""
    if not isinstance(secret, bytes) or len(secret) not in SECRET_SIZES:
        raise SecAggError(f"shamir: the secret must be 16 or 32 bytes, got {len(secret)}")
    if not 1 <= threshold <= holders:
        raise SecAggError(f"shamir: need 1 <= threshold <= holders, got {threshold}, {holders}")
    blocks = [
        Shamir.split(threshold, holders, secret[i : i + BLOCK])
        for i in range(0, len(secret), BLOCK)
    ]
    return [  # pycryptodome numbers the shares 1..holders, the same for every block
        (column[0][0], b"".join(share for _, share in column))
        for column in zip(*blocks, strict=True)
    ]


def combine(shares: Sequence[tuple[int, bytes]], threshold: int) -> bytes:
    """The secret from at least ``threshold`` shares (the ``threshold`` with the lowest
    indices are used). :class:`SecAggError` with fewer, a repeated index or a malformed
    share. Wrong shares give a wrong secret, silently: the caller checks what it can."""
    unique = {int(i): bytes(s) for i, s in shares}
    if len(unique) != len(shares):
        raise SecAggError("shamir: a share index appears twice")
    if len(unique) < threshold:
        raise SecAggError(f"shamir: {len(unique)} shares, {threshold} needed")
    chosen = sorted(unique.items())[:threshold]
    size = len(chosen[0][1])
    if size not in SECRET_SIZES or any(i < 1 or len(s) != size for i, s in chosen):
        raise SecAggError("shamir: malformed share")
    return b"".join(
        Shamir.combine([(i, s[b : b + BLOCK]) for i, s in chosen]) for b in range(0, size, BLOCK)
    )
