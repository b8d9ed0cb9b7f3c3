"""The lanes a weight transfer travels on (docs/wire.md, "Weight transfers", "Direct lane").

A :class:`Lane` carries this node's pulls to peers and the answers to the pulls peers
sent it. The transport (:mod:`p2pfl.wire.transport`) holds its lanes in an ordered list,
the direct lane (:mod:`p2pfl.wire.direct_lane`) first when the node has one, then the MQTT
lane (:mod:`p2pfl.wire.mqtt_lane`), which reaches every peer through the broker:

- **A pull** goes to each lane in turn. :meth:`Lane.pull` returns None when the lane cannot
  reach the peer (it announces no direct address, or its address cannot be connected to),
  and the next lane is tried within the same deadline; it returns the state, verified
  against its digest, or raises (:class:`~p2pfl.wire.errors.TransportError`,
  :class:`~p2pfl.wire.transfers.TransferError`, :class:`asyncio.TimeoutError`) when the
  peer was reached and the pull failed there: no other lane is tried then.
- **An answer** goes back on the lane its pull came by: :meth:`Lane.answer` and
  :meth:`Lane.refuse` return False for a pull that did not come this way, and the next
  lane is asked. The last lane (MQTT) takes every answer to the peer's inbox.

Every lane sends the same envelopes, made by the transport (this node's, signed for the
peer's inbox topic: :data:`Pack`), and hands what it receives to the one receive pipeline
(:mod:`p2pfl.wire.receive`), so checks, drops and counters do not depend on the lane. Each
lane frames the bytes its own way: numbered chunks through the broker, or one frame and the
raw bytes on a TCP connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from p2pfl.wire.errors import TransportError
from p2pfl.wire.transfers import PreparedState, State

__all__ = ["Answer", "Lane", "Pack", "Pull", "within_limit"]

# ``pack(to, kind, round_no, body, *, mid=None, attempt=0, data=None)``: one envelope of
# this node (id ``mid``, else a fresh one; the version it speaks; its clock now), with the
# raw tail ``data``, packed and signed for ``to``'s inbox topic
Pack = Callable[..., bytes]


def within_limit(kind: str, payload: bytes, limit: int) -> bytes:
    """``payload`` when it fits one message of ``limit`` bytes, else
    :class:`TransportError` (a peer's receive pipeline would drop it as ``oversized``)."""
    if len(payload) > limit:
        raise TransportError(f"{kind} of {len(payload)} bytes exceeds the message limit")
    return payload


@dataclass(frozen=True)
class Pull:
    """One pull of this node, as each lane tried gets it.

    ``request()`` makes the packed ``pull`` envelope (id ``xfer``, signed for the peer's
    inbox) when the lane sends it; ``limit`` is the most bytes its answer may announce;
    ``deadline`` is the event-loop time by which the state must be in. ``arrived`` is the
    pull's entry in :class:`~p2pfl.wire.transfers.IncomingTransfers`: the state an answer
    through the broker lands on, and, on every lane, a future that fails
    (:class:`~p2pfl.wire.transfers.TransferError`) as soon as the peer goes offline or the
    transport closes."""

    peer: str
    xfer: str
    request: Callable[[], bytes]
    limit: int
    deadline: float
    arrived: asyncio.Future

    def remaining(self) -> float:
        """Seconds left before the deadline (0 once it has passed)."""
        return max(0.0, self.deadline - asyncio.get_running_loop().time())


@dataclass(frozen=True)
class Answer:
    """A prepared state answering ``to``'s pull ``xfer`` of round ``round_no``; ``chunk``:
    the chunk size its metadata announces (the MQTT lane's chunks)."""

    to: str
    xfer: str
    round_no: int
    prepared: PreparedState
    chunk: int

    def meta(self) -> dict[str, Any]:
        """The body of its ``xfer_meta``, the same on every lane."""
        prepared = self.prepared
        return {
            "xfer": self.xfer,
            "total": len(prepared.buf),
            "chunk": self.chunk,
            "nchunks": prepared.nchunks(self.chunk),
            "digest": prepared.digest_name,
            "hexdigest": prepared.hexdigest,
            "index": prepared.index,
        }


@runtime_checkable
class Lane(Protocol):
    """One way weights travel between this node and its peers (module docstring)."""

    name: str  # what :attr:`Transport.pull_lanes` records for a pull it carried

    async def pull(self, pull: Pull) -> State | None:
        """The state ``pull`` asks for, or None when this lane cannot reach the peer."""
        ...

    async def answer(self, answer: Answer) -> bool:
        """Send ``answer`` (metadata, then the bytes) if its pull came on this lane."""
        ...

    async def refuse(self, to: str, xfer: str, payload: bytes) -> bool:
        """Send the packed ``pull_error`` ``payload`` for ``to``'s pull ``xfer`` if that
        pull came on this lane."""
        ...
