"""Secure aggregation for the rotating aggregator: SecAgg+ as pure, transport-free maths.

Bonawitz et al. 2017, "Practical Secure Aggregation for Privacy-Preserving Machine
Learning" (CCS), with the sparse masking graph of Bell et al. 2020, "Secure Single-Server
Aggregation with (Poly)Logarithmic Overhead" (CCS; "SecAgg+"). The aggregator of a round
learns ``Σ_u w_u x_u`` over the members whose input arrived, and nothing else about any
single ``x_u``; a member that drops out after masking is recovered from ``t`` shares of its
masking key held by its neighbours.

- :class:`SecAggMember` (``member``) and :class:`SecAggServer` (``server``): the two
  sides; ``messages`` has the payloads, all plain data;
- ``context``: :class:`RoundContext` ``(swarm, round, attempt)``, bound into every key;
- ``graph``: the SecAgg+ neighbour graph and its threshold; ``masks``: the mask equation;
- ``fixedpoint``: floats into Z_{2^64} and back; ``shamir``: pycryptodome's Shamir for
  32-byte secrets; ``primitives``: X25519, HKDF-SHA256, AES-GCM and the ChaCha20 PRG, all
  from ``cryptography``.

No I/O, no pickle: keys, shares and bundles are ``bytes``, vectors ``numpy`` arrays.
"""

from __future__ import annotations

from p2pfl.privacy.secagg.context import RoundContext
from p2pfl.privacy.secagg.errors import SecAggError
from p2pfl.privacy.secagg.fixedpoint import FRAC_BITS, decode, encode, max_abs, tolerance
from p2pfl.privacy.secagg.member import SecAggMember
from p2pfl.privacy.secagg.server import SecAggServer

__all__ = [
    "FRAC_BITS",
    "RoundContext",
    "SecAggError",
    "SecAggMember",
    "SecAggServer",
    "decode",
    "encode",
    "max_abs",
    "tolerance",
]
