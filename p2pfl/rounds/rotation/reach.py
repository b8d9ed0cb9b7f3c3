"""Who a centralized member can reach now (docs/wire.md, "Partitions").

Retained presence says who is *connected to some broker*, not who this node can reach: when
the link between two bridged sites is cut, each broker keeps the other site's presence
``online`` (no Will crosses a dead bridge) until the link heals. Three signals tell them
apart, combined by :func:`verdict`, a pure rule:

- **presence**: a peer whose presence is not ``online`` (its Last Will fired, or it said
  ``done``) is ``offline``;
- **the direct lane**: a TCP connect to the ``host:port`` a peer announces in its presence
  (:meth:`~p2pfl.services.exchange.Exchange.probe`). A probe that fails means the peer cannot
  be reached *if* its lane answered this node before (a peer behind NAT, whose lane never
  answers, is served over MQTT as usual and never counts as cut off on that ground alone);
- **bridge state**: Mosquitto's ``$SYS/broker/connection/<name>/state`` at this node's
  broker (``0``: a bridge to another site is down;
  :attr:`~p2pfl.services.exchange.Exchange.bridge_down`). While a bridge is down, a failed probe
  counts even for a peer whose lane never answered before.

:class:`Reachability` keeps the latest probe of each peer (for :data:`PROBE_TTL_S`), answers
synchronously from it (:meth:`Reachability.cut_off`, for wait predicates), probes on demand
(:meth:`Reachability.check`) and, while a wait is on, re-probes the peers waited on every
:data:`RECHECK_S` (:meth:`Reachability.watching`), waking the wait when a verdict changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from p2pfl.background import background

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2.0  # a connect on a live link takes milliseconds, even under load
PROBE_TTL_S = 1.5  # a probe this recent is not repeated
RECHECK_S = 1.0  # how often a wait re-probes the peers it waits on
PROBE_KEPT_S = 5.0  # a probe older than this says nothing any more (a link may have healed)

OFFLINE = "offline"
UNREACHABLE = "unreachable"


def verdict(
    online: bool, probe: bool | None, answered_before: bool, bridge_down: bool
) -> str | None:
    """Why a peer cannot be reached now, or None when it may be.

    ``online``: its presence is ``online``; ``probe``: the latest probe of its direct lane
    (True: it answered, False: it did not, None: no lane to probe); ``answered_before``: its
    lane answered this node at some earlier probe; ``bridge_down``: a bridge of this node's
    broker is down. Returns :data:`OFFLINE` or :data:`UNREACHABLE`."""
    if not online:
        return OFFLINE
    if probe is False and (answered_before or bridge_down):
        return UNREACHABLE
    return None


class Reachability:
    """The reachability of one node's peers, from ``online(peer)`` (presence),
    ``probe(peer, timeout)`` (the direct lane: True, False, or None without one) and
    ``bridge_down()`` (a bridge of this node's broker is down); ``changed()`` is called
    when a verdict flips (to wake the waits); ``answered(peer)``: the peer's direct lane
    answered this node otherwise (a pull went that way), as a successful probe does."""

    def __init__(
        self,
        node_id: str,
        online: Callable[[str], bool],
        probe: Callable[[str, float], Any],
        bridge_down: Callable[[], bool],
        changed: Callable[[], None] = lambda: None,
        probe_timeout: float = PROBE_TIMEOUT_S,
        answered: Callable[[str], bool] = lambda _p: False,
    ):
        self.id = node_id
        self._online = online
        self._probe = probe
        self._bridge_down = bridge_down
        self._changed = changed
        self._answered = answered
        self.probe_timeout = probe_timeout
        self._last: dict[str, tuple[float, bool | None]] = {}  # peer -> (when, result)
        self.answered: set[str] = set()  # peers whose lane answered at least once
        self._cut_at: dict[str, float] = {}  # peer -> when a probe last found it cut off
        self.since = time.monotonic()  # the start of the current round (:meth:`begin_round`)
        self.probes = 0

    def cut_off(self, peer: str) -> str | None:
        """Why ``peer`` cannot be reached, from presence and the latest probe if it is at
        most :data:`PROBE_KEPT_S` old (no new probe): :func:`verdict`. None for this node
        itself."""
        if peer == self.id:
            return None
        last = self._last.get(peer)
        fresh = last is not None and time.monotonic() - last[0] <= PROBE_KEPT_S
        return verdict(
            self._online(peer),
            last[1] if fresh and last is not None else None,
            peer in self.answered or self._answered(peer),
            self._bridge_down(),
        )

    async def _probe_one(self, peer: str) -> None:
        before = self.cut_off(peer)
        result = await self._probe(peer, self.probe_timeout)
        self.probes += 1
        self._last[peer] = (time.monotonic(), result)
        if result:
            self.answered.add(peer)
        after = self.cut_off(peer)
        if after is not None:
            self._cut_at[peer] = time.monotonic()
        if after != before:
            log.warning(
                "%s: %s %s", self.id, peer, f"cannot be reached ({after})" if after else "reachable"
            )
            self._changed()

    def begin_round(self) -> None:
        """A round starts: :meth:`cut_lately` looks back to now."""
        self.since = time.monotonic()

    def cut_lately(self, peer: str) -> bool:
        """Whether ``peer`` is cut off now or was found cut off since the round began: it
        may have missed what was said meanwhile (an announcement), even once healed."""
        return self.cut_off(peer) is not None or self._cut_at.get(peer, -1.0) >= self.since

    async def check(self, peer: str) -> str | None:
        """:meth:`cut_off` after a fresh probe (one at most every :data:`PROBE_TTL_S`)."""
        if peer == self.id or not self._online(peer):
            return self.cut_off(peer)
        last = self._last.get(peer)
        if last is None or time.monotonic() - last[0] >= PROBE_TTL_S:
            await self._probe_one(peer)
        return self.cut_off(peer)

    async def refresh(self, peers: Iterable[str]) -> None:
        """Probe every online peer of ``peers`` (concurrently) whose probe is not fresh."""
        now = time.monotonic()
        due = [
            p
            for p in set(peers)
            if p != self.id
            and self._online(p)
            and (p not in self._last or now - self._last[p][0] >= PROBE_TTL_S)
        ]
        if due:
            await asyncio.gather(*(self._probe_one(p) for p in due))

    @contextlib.asynccontextmanager
    async def watching(self, peers: Callable[[], Iterable[str]]) -> AsyncIterator[None]:
        """While inside, re-probe ``peers()`` every :data:`RECHECK_S` (a flip of a verdict
        calls ``changed``, which wakes the wait)."""

        async def loop() -> None:
            while True:
                await self.refresh(peers())
                await asyncio.sleep(RECHECK_S)

        async with background(loop()):
            yield
