"""The masks of secure aggregation (Bonawitz et al. 2017, §4), as field vectors.

Member ``u`` with field input ``e_u = encode(w_u · x_u)`` sends::

    y_u = e_u + PRG(B_u) + Σ_{v ∈ N(u), v < u} PRG(S_uv) − Σ_{v ∈ N(u), v > u} PRG(S_uv)   (mod 2^64)

- ``B_u = HKDF(b_u, context ‖ "self" ‖ u)``: the self mask's key, from the member's fresh
  random 16-byte seed ``b_u`` (Shamir-shared; 128 bits, as X25519 gives, and one Shamir
  block: rebuilding one per survivor is most of the aggregator's work);
- ``S_uv = S_vu = HKDF(X25519(s_u^SK, s_v^PK), context ‖ "pair" ‖ min(u, v) ‖ max(u, v))``:
  the pairwise key, which ``u`` and ``v`` compute alike;
- ``v < u`` compares node ids as strings; ``N(u)`` is ``u``'s neighbours that shared keys.

Summed over the survivors, pairwise masks between two survivors cancel; what remains is
``Σ e_u + Σ PRG(B_u)`` plus the pairwise masks of survivors with dropped members, which the
aggregator removes once it rebuilt each dropped ``s_d^SK`` (:func:`pair_sign` gives the sign
with which ``PRG(S_vd)`` sits in ``y_v``).
"""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from p2pfl.privacy.secagg.context import RoundContext
from p2pfl.privacy.secagg.primitives import agree, derive, expand


def pair_sign(owner: str, peer: str) -> int:
    """``+1`` when ``PRG(S_{owner,peer})`` is added to ``y_owner`` (``peer < owner``),
    else ``−1``."""
    return 1 if peer < owner else -1


def self_mask(seed: bytes, context: RoundContext, owner: str, length: int) -> np.ndarray:
    """``PRG(HKDF(b_u, context ‖ "self" ‖ u))`` of ``length`` uint64."""
    return expand(derive(seed, context.info("self", owner)), length)


def pair_mask(
    secret: X25519PrivateKey, peer_public: bytes, context: RoundContext, a: str, b: str, length: int
) -> np.ndarray:
    """``PRG(S_ab)`` of ``length`` uint64, from one side's secret key and the other's
    public key (symmetric in ``a`` and ``b``)."""
    lo, hi = sorted((a, b))
    seed = agree(secret, peer_public, context.info("pair", lo, hi), f"masking key of {b}")
    return expand(seed, length)
