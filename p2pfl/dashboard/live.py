"""What the broker says about a swarm right now: each node's presence (``online``,
``done``, ``offline``), its round's phase and the pulls that just arrived (docs/wire.md,
"Presence and Last Will" and "Status telemetry").

:meth:`LiveState.handle` takes one raw MQTT message and either applies it or drops it with a
reason (counted in :attr:`LiveState.dropped`). Every message is untrusted: it must be small,
on a topic of this swarm naming a node of the topology, a well-formed envelope of that swarm
sent by that node, with a body of the right shape. Signatures are not checked: what the
dashboard shows is a view, never used to decide anything.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from p2pfl.wire.envelope import Envelope
from p2pfl.wire.status import MAX_STATUS_BYTES, check_status
from p2pfl.wire.untrusted import CodecError

PRESENCE_STATUSES = ("online", "done", "offline")
MAX_PRESENCE_BYTES = 16 << 10  # a signed presence carries a certificate (~1 KiB)
MAX_ROUND = 1 << 31
PULLS_KEPT = 512  # recent pull events remembered


@dataclass(frozen=True)
class Presence:
    status: str  # one of PRESENCE_STATUSES
    round: int | None  # the last round the node reports finished
    at: float  # when it arrived (the state's clock)


@dataclass(frozen=True)
class Phase:
    phase: str  # one of p2pfl.wire.status.PHASES
    round: int
    at: float


@dataclass(frozen=True)
class PullEvent:
    seq: int  # grows by one per event: the page animates each once
    at: float
    src: str  # the peer the weights came from
    dst: str  # the node that pulled them
    part: str
    nbytes: int
    round: int


class LiveState:
    """The latest presence and phase of each node of ``node_ids`` in swarm ``swarm``, and
    the last :data:`PULLS_KEPT` pull events. ``clock`` stamps arrivals (monotonic)."""

    def __init__(
        self, swarm: str, node_ids: Iterable[str], *, clock: Callable[[], float] = time.monotonic
    ):
        self.swarm = swarm
        self.prefix = f"p2pfl/{swarm}/"
        self.node_ids = frozenset(node_ids)
        self.clock = clock
        self.presence: dict[str, Presence] = {}
        self.phases: dict[str, Phase] = {}
        self.pulls: deque[PullEvent] = deque(maxlen=PULLS_KEPT)
        self.seq = 0
        self.dropped: Counter[str] = Counter()
        self.accepted = 0
        self.connected = False
        self.note = "not connected yet"

    def topics(self) -> list[str]:
        """The subscriptions that feed this state."""
        return [f"{self.prefix}presence/+", f"{self.prefix}status/+"]

    def handle(self, topic: str, payload: Any) -> str | None:
        """Apply one message; return None, or the reason it was dropped. Never raises."""
        try:
            reason = self._handle(str(topic), payload)
        except Exception:  # a bug here must not kill the observer: count it
            reason = "handler_error"
        if reason is None:
            self.accepted += 1
        else:
            self.dropped[reason] += 1
        return reason

    def _handle(self, topic: str, payload: Any) -> str | None:
        if not isinstance(payload, (bytes, bytearray)):
            return "not_bytes"
        if not topic.startswith(self.prefix):
            return "foreign_topic"
        parts = topic[len(self.prefix) :].split("/")
        if len(parts) != 2 or parts[0] not in ("presence", "status"):
            return "foreign_topic"
        channel, owner = parts
        limit = MAX_PRESENCE_BYTES if channel == "presence" else MAX_STATUS_BYTES
        if len(payload) > limit:
            return "oversized"
        if owner not in self.node_ids:
            return "unknown_node"
        try:
            env = Envelope.unpack(bytes(payload), limit, tensors=False)
        except CodecError:
            return "malformed"
        if env.swarm != self.swarm:
            return "foreign_swarm"
        if env.sender != owner:
            return "sender_mismatch"
        if env.round > MAX_ROUND:
            return "malformed"
        if channel == "presence":
            return self._presence(owner, env)
        return self._status(owner, env)

    def _presence(self, node: str, env: Envelope) -> str | None:
        info = env.body.get("presence") if isinstance(env.body, dict) else None
        if env.kind != "presence" or not isinstance(info, dict):
            return "malformed"
        status = info.get("status")
        if status not in PRESENCE_STATUSES:
            return "malformed"
        r = info.get("round")
        if not (isinstance(r, int) and not isinstance(r, bool) and 0 <= r <= MAX_ROUND):
            r = None
        self.presence[node] = Presence(status, r, self.clock())
        return None

    def _status(self, node: str, env: Envelope) -> str | None:
        if env.kind != "status":
            return "malformed"
        try:
            body = check_status(env.body)
        except ValueError:
            return "malformed"
        now = self.clock()
        if body["event"] == "phase":
            self.phases[node] = Phase(body["phase"], env.round, now)
            return None
        if body["peer"] not in self.node_ids or body["peer"] == node:
            return "unknown_node"
        self.seq += 1
        self.pulls.append(
            PullEvent(self.seq, now, body["peer"], node, body["part"], body["bytes"], env.round)
        )
        return None

    def recent_pulls(self, within_s: float) -> list[PullEvent]:
        """The pull events that arrived in the last ``within_s`` seconds, oldest first."""
        since = self.clock() - within_s
        return [p for p in self.pulls if p.at >= since]
