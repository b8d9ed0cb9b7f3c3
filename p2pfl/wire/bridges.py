"""The bridges of this node's broker to other sites' brokers, as the node hears them
(docs/wire.md, "Partitions"): Mosquitto publishes each bridge's state, retained, on
``$SYS/broker/connection/<name>/state`` (``1`` up, ``0`` down), which the transport asks
the MQTT lane to follow (:data:`FILTER`). A notification of any other shape is the
broker's, but malformed: it is dropped (``foreign_topic``), never raised.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

__all__ = ["FILTER", "PREFIX", "Bridges"]

# every line the transport writes goes to one logger, whichever of its modules writes it
log = logging.getLogger("p2pfl.wire.transport")

PREFIX = "$SYS/broker/connection/"  # Mosquitto's bridge notifications
FILTER = PREFIX + "+/state"


class Bridges:
    """The state of each bridge heard, by connection name (:attr:`states`: True up, False
    down). ``drop(reason, detail)`` counts a malformed notification; ``on_change(name,
    up)``, when set, is called on each change."""

    def __init__(self, node_id: str, drop: Callable[[str, Any], None]):
        self.node_id = node_id
        self.states: dict[str, bool] = {}
        self.on_change: Callable[[str, bool], None] | None = None
        self._drop = drop

    def heard(self, topic: str, payload: Any) -> None:
        """One notification under :data:`PREFIX`: a change is logged and told."""
        parts = topic.split("/")
        if len(parts) != 5 or parts[4] != "state" or payload not in (b"0", b"1"):
            self._drop("foreign_topic", topic)
            return
        name, up = parts[3], payload == b"1"
        if self.states.get(name) == up:
            return
        self.states[name] = up
        log.log(
            logging.INFO if up else logging.WARNING,
            "%s: the broker's bridge %s is %s",
            self.node_id,
            name,
            "up" if up else "down",
        )
        if self.on_change is not None:
            self.on_change(name, up)

    @property
    def down(self) -> bool:
        """Whether a bridge heard is down now."""
        return not all(self.states.values())
