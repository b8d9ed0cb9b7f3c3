"""The transport's byte and message counters, shared by both lanes (round records read
them: docs/architecture.md, "Round records")."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TransportStats:
    """Bytes and messages this node sent and received. ``bytes_*`` and ``messages_*``
    count both lanes; ``direct_bytes_*`` are the direct lane's share of them. Received
    bytes count when they reach this node's socket, before any emulated link holds them
    back (:mod:`p2pfl.wire.emulation`)."""

    bytes_sent: int = 0  # both lanes
    bytes_recv: int = 0
    messages_sent: int = 0
    messages_recv: int = 0
    direct_bytes_sent: int = 0  # the direct lane's share of bytes_sent / bytes_recv
    direct_bytes_recv: int = 0

    def sent_direct(self, nbytes: int, messages: int) -> None:
        """Count bytes (and messages) sent on the direct lane, in both totals."""
        self.bytes_sent += nbytes
        self.direct_bytes_sent += nbytes
        self.messages_sent += messages

    def received_direct(self, nbytes: int, messages: int) -> None:
        """Count bytes (and messages) received on the direct lane, in both totals."""
        self.bytes_recv += nbytes
        self.direct_bytes_recv += nbytes
        self.messages_recv += messages
