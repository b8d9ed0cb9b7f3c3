"""Fixed-point encoding of float vectors into the field Z_{2^64} of secure aggregation.

The field is ``uint64`` with numpy's wrapping arithmetic: addition and subtraction of
``uint64`` arrays are exactly addition and subtraction mod ``2^64``, on every machine, with
no big-integer code. Why ``2^64`` and not ``2^32``: a member's value is its weight times a
model coordinate (the weight may be a sample count in the thousands), the sum runs over up to
a few dozen members, and the resolution must beat float32's; 32 bits cannot hold both
(``2^16`` of range and ``2^-16`` of resolution at best). The cost is 8 bytes per coordinate
on the wire, twice a float32 model.

Encoding (``f = frac_bits``, default :data:`FRAC_BITS` = 32)::

    encode(v) = round(v · 2^f) mod 2^64            (two's complement for v < 0)
    decode(z) = signed(z) / 2^f,   signed(z) = z − 2^64 if z ≥ 2^63 else z

No wrap-around: with ``n`` members, each encoded ``|round(v · 2^f)|`` is at most
``M = ⌊(2^63 − 1) / n⌋``, so any sum of at most ``n`` of them lies in ``[−(2^63 − 1),
2^63 − 1]`` and ``decode`` of the field sum is the true sum. :func:`encode` raises
:class:`SecAggError` on a value beyond :func:`max_abs` ``= M / 2^f`` (for f = 32:
``2^31 / n``, about 2.7e8 at 8 members, 4.3e7 at 50), and on a non-finite value.

Precision: each encoded value is within ``2^-(f+1)`` of ``v``, so the decoded sum of ``n``
values is within ``n · 2^-(f+1)`` of the exact real sum (:func:`tolerance`), plus float64's
own rounding of the decoded integer (relative 2^-53).
"""

from __future__ import annotations

import numpy as np

from p2pfl.privacy.secagg.errors import SecAggError

FIELD_BITS = 64
FRAC_BITS = 32


def _check(members: int, frac_bits: int) -> None:
    if isinstance(members, bool) or not isinstance(members, int) or members < 1:
        raise SecAggError(f"fixed point: members must be a positive int, got {members!r}")
    if isinstance(frac_bits, bool) or not isinstance(frac_bits, int) or not 0 <= frac_bits <= 52:
        raise SecAggError(f"fixed point: frac_bits must be an int in [0, 52], got {frac_bits!r}")


def max_int(members: int) -> int:
    """``M = ⌊(2^63 − 1) / members⌋``: the largest ``|round(v · 2^f)|`` one member may add."""
    _check(members, 0)
    return (2**63 - 1) // members


def _max_scaled(members: int) -> float:
    """The largest float64 not above ``M``."""
    limit = max_int(members)
    limit_f = float(limit)
    return float(np.nextafter(limit_f, 0.0)) if limit_f > limit else limit_f


def max_abs(members: int, frac_bits: int = FRAC_BITS) -> float:
    """The largest ``|v|`` one of ``members`` members may encode: ``M / 2^f`` (the largest
    float64 not above it)."""
    _check(members, frac_bits)
    return _max_scaled(members) / 2.0**frac_bits


def tolerance(members: int, frac_bits: int = FRAC_BITS) -> float:
    """``members · 2^-(f+1)``: how far a decoded sum of ``members`` encodings may be from
    the exact sum of the floats (rounding only)."""
    _check(members, frac_bits)
    return members * 2.0 ** -(frac_bits + 1)


def encode(values: np.ndarray, members: int, frac_bits: int = FRAC_BITS) -> np.ndarray:
    """``round(values · 2^f) mod 2^64`` as ``uint64`` (1-D, float64 maths; round half to
    even). :class:`SecAggError` on a non-finite value or one with ``|v| > max_abs``."""
    _check(members, frac_bits)
    v = np.asarray(values, dtype=np.float64)
    if not np.all(np.isfinite(v)):
        raise SecAggError("fixed point: the vector has a non-finite value")
    scaled = np.rint(v * 2.0**frac_bits)  # times a power of two: exact in float64
    peak = float(np.max(np.abs(scaled))) if scaled.size else 0.0
    if peak > _max_scaled(members):
        raise SecAggError(
            f"fixed point: |value| up to {peak / 2.0**frac_bits:.6g} exceeds "
            f"{max_abs(members, frac_bits):.6g}, the most one of {members} members may add "
            f"with {frac_bits} fractional bits without the sum wrapping around 2^64"
        )
    return scaled.astype(np.int64).view(np.uint64)


def decode(field: np.ndarray, frac_bits: int = FRAC_BITS) -> np.ndarray:
    """``signed(field) / 2^f`` as float64: the inverse of :func:`encode`, and of a field sum
    of encodings that stayed within the bound."""
    _check(1, frac_bits)
    z = np.asarray(field)
    if z.dtype != np.uint64:
        raise SecAggError(f"fixed point: decode takes uint64, got {z.dtype}")
    return z.view(np.int64).astype(np.float64) / 2.0**frac_bits
