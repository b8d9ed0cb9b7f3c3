"""The round context of secure aggregation, bound into every derived key.

A context is ``(swarm, round, attempt)``. Every HKDF ``info`` and every AEAD associated
data starts with :meth:`RoundContext.encode`, so a pairwise seed, a mask or an encrypted
share of one attempt is useless in any other (a failover's attempt ``a + 1`` starts from
fresh keys and shares nothing with the dead attempt ``a``).

The encoding is unambiguous: every variable-length field is length-prefixed (4 bytes,
big-endian), integers are 8 bytes big-endian.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2pfl.privacy.secagg.errors import SecAggError

PROTOCOL = b"p2pfl-secagg+/1"


def _field(text: str) -> bytes:
    raw = text.encode("utf-8")
    return len(raw).to_bytes(4, "big") + raw


@dataclass(frozen=True)
class RoundContext:
    """One attempt of one round of one swarm: ``(swarm, round, attempt)``."""

    swarm: str
    round: int
    attempt: int

    def __post_init__(self) -> None:
        if not isinstance(self.swarm, str) or not self.swarm:
            raise SecAggError(f"context: swarm must be a non-empty string, got {self.swarm!r}")
        for name in ("round", "attempt"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
                raise SecAggError(f"context: {name} must be an int in [0, 2^63), got {value!r}")

    def encode(self) -> bytes:
        """``PROTOCOL ‖ len‖swarm ‖ round (8 B) ‖ attempt (8 B)``."""
        return (
            _field(PROTOCOL.decode())
            + _field(self.swarm)
            + self.round.to_bytes(8, "big")
            + self.attempt.to_bytes(8, "big")
        )

    def info(self, label: str, *parts: str) -> bytes:
        """``encode() ‖ len‖label ‖ len‖part ...``: the HKDF info / AEAD associated data of
        one use (``label``) between named members (``parts``)."""
        return self.encode() + _field(label) + b"".join(_field(p) for p in parts)
