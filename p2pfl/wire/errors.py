"""The transport's errors: what a send, a pull or the broker connection raises to the node.

Both lanes (:mod:`p2pfl.wire.mqtt_lane`, :mod:`p2pfl.wire.direct_lane`) and the facade
(:mod:`p2pfl.wire.transport`, which re-exports both names) raise them, so they live below
all three.
"""

from __future__ import annotations

from p2pfl.errors import P2PFLError


class TransportError(P2PFLError, RuntimeError):
    """A send or pull that could not complete (disconnected, refused, timed out, corrupt)."""


class BrokerLostError(TransportError):
    """The broker has been unreachable for longer than the node is willing to wait."""
