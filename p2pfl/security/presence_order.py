"""The order of a member's signed presence messages, bounded by time (docs/wire.md,
"Presence order").

Presence is retained by the broker and may be hours old, so it is not judged by its age like
other messages (:class:`p2pfl.security.signing.ReplayGuard`) but ordered: each carries
``[session, sequence]``, the session being the sender's clock when its connection began and
the sequence growing within it (the Last Will holds the largest). :func:`presence_verdict`
is the rule, a pure function of the presence, the last order accepted from its sender, and
the receiver's clock:

- ``malformed``: the order is not ``[number, int]``.
- ``future_session``: the session starts more than ``max_age_s`` after the receiver's clock.
  No honest sender makes one (its messages would be refused as ``stale`` anyway); accepting
  it would make every later genuine presence of that sender look old.
- ``accept``: newer than the last order accepted (or none yet).
- ``same``: the last order accepted, delivered again (a retained copy).
- ``rewind``: older than the last order, but that one is no longer credible and this
  presence is fresh: the last session starts more than :data:`REWIND_SLACK_S` after the
  receiver's clock (only a sender clock that ran ahead makes one; a session cannot have begun
  in the future), and this presence was made within ``max_age_s`` of the receiver's clock.
  This is how a sender whose clock jumped back gets its presence through. The caller must
  also refuse a rewind whose message id it has already seen (the replay window), so a rewind
  admits nothing that the ``max_age_s`` window does not already admit for other messages.
- ``replayed``: older than the last order, otherwise.
"""

from __future__ import annotations

import math

# a stored session this far (seconds) ahead of the receiver's clock is no longer credible;
# a sender reconnecting within it keeps its sessions in order itself (``new_session``)
REWIND_SLACK_S = 1.0

Order = tuple[float, int]


def parse_order(order: object) -> Order | None:
    """``(session, sequence)`` of a presence's ``order`` field, or None when malformed."""
    if (
        not isinstance(order, (list, tuple))
        or len(order) != 2
        or not isinstance(order[0], (int, float))
        or isinstance(order[0], bool)
        or not math.isfinite(order[0])
        or not isinstance(order[1], int)
        or isinstance(order[1], bool)
    ):
        return None
    return float(order[0]), int(order[1])


def presence_verdict(
    order: object, last: Order | None, ts: float, now: float, max_age_s: float
) -> str:
    """The verdict on a presence with ``order`` and envelope timestamp ``ts``, given the
    ``last`` order accepted from its sender and the receiver's clock ``now``: ``accept``,
    ``rewind``, ``same``, ``replayed``, ``future_session`` or ``malformed`` (module doc).
    Only ``accept`` and ``rewind`` admit it; both make its order the sender's last."""
    key = parse_order(order)
    if key is None:
        return "malformed"
    if key[0] > now + max_age_s:
        return "future_session"
    if last is None or key > last:
        return "accept"
    if key == last:
        return "same"
    if last[0] > now + REWIND_SLACK_S and abs(now - ts) <= max_age_s:
        return "rewind"
    return "replayed"
