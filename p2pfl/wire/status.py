"""Live status telemetry: what a node is doing now, for observers such as the dashboard
(docs/wire.md, "Status telemetry").

A node publishes a ``status`` envelope on ``p2pfl/<swarm>/status/<id>`` (QoS 0, not
retained) at each phase change of a round and after each completed pull. No node subscribes
to these topics, so they cost the swarm nothing but the publish when nobody observes. The
envelope's ``round`` is the node's round; its body is one of:

- ``{"event": "phase", "phase": P}`` with ``P`` in :data:`PHASES`;
- ``{"event": "pull", "peer": ID, "part": PART, "bytes": N}``: this node received ``PART``
  (``N`` bytes of tensors) from ``ID``.

:func:`phase_body` and :func:`pull_body` build the bodies; :func:`check_status` checks an
untrusted one and returns it normalized, or raises :class:`ValueError`.
"""

from __future__ import annotations

from typing import Any

PHASES = ("training", "waiting", "aggregating", "evaluating")
MAX_STATUS_BYTES = 4096  # a status envelope is ~150 bytes (~1 KiB signed with a long id)
MAX_ID_CHARS = 64  # as the envelope's ``from``
MAX_PART_CHARS = 32


def phase_body(phase: str) -> dict[str, Any]:
    """The body announcing ``phase`` (one of :data:`PHASES`; ValueError otherwise)."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}")
    return {"event": "phase", "phase": phase}


def pull_body(peer: str, part: str, nbytes: int) -> dict[str, Any]:
    """The body announcing a completed pull of ``part`` (``nbytes`` bytes) from ``peer``."""
    return check_status({"event": "pull", "peer": peer, "part": part, "bytes": int(nbytes)})


def _short_str(value: Any, limit: int, what: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= limit:
        raise ValueError(f"{what} must be a string of 1-{limit} characters")
    return value


def check_status(body: Any) -> dict[str, Any]:
    """``body`` if it is a well-formed status body, with only the known keys; ValueError
    (naming the problem) for anything else. Peers are untrusted: nothing is assumed."""
    if not isinstance(body, dict):
        raise ValueError("status body is not a map")
    event = body.get("event")
    if event == "phase":
        phase = body.get("phase")
        if phase not in PHASES:
            raise ValueError(f"unknown phase {str(phase)[:40]!r}")
        return {"event": "phase", "phase": phase}
    if event == "pull":
        peer = _short_str(body.get("peer"), MAX_ID_CHARS, "pull peer")
        part = _short_str(body.get("part"), MAX_PART_CHARS, "pull part")
        nbytes = body.get("bytes")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 <= nbytes < 1 << 50:
            raise ValueError("pull bytes must be a non-negative int")
        return {"event": "pull", "peer": peer, "part": part, "bytes": nbytes}
    raise ValueError(f"unknown status event {str(event)[:40]!r}")
