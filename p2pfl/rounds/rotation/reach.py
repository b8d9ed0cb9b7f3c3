"""Who a centralized member can reach now (docs/wire.md, "Partitions").

Retained presence says who is *connected to some broker*, not who this node can reach: when
the link between two bridged sites is cut, each broker keeps the other site's presence
``online`` (no Will crosses a dead bridge) until the link heals. Three signals tell them
apart:

- **presence**: a peer whose presence is not ``online`` (its Last Will fired, or it said
  ``done``) is ``offline``, at once;
- **the direct lane**: a TCP connect to the ``host:port`` a peer announces in its presence
  (:meth:`~p2pfl.services.exchange.Exchange.probe`). A probe that fails makes this node
  *suspect* the peer if its lane answered this node before (a peer behind NAT, whose lane
  never answers, is served over MQTT as usual and never suspected on that ground alone);
- **bridge state**: Mosquitto's ``$SYS/broker/connection/<name>/state`` at this node's
  broker (``0``: a bridge to another site is down;
  :attr:`~p2pfl.services.exchange.Exchange.bridge_down`). While a bridge is down, a failed probe
  counts even for a peer whose lane never answered before.

**A busy peer is not a cut-off peer** (SWIM with Lifeguard's refinements, as HashiCorp's
memberlist does). A connect that times out may be a cut cable or a peer whose process is
busy (its accept queue full). So:

- a member probes a peer it waits on only after its *own evidence*: :func:`suspicion_delay`
  with no sign of life from it (a message it sent this node, a pull it made: :meth:`alive`),
  spread over ``members / TARGET_RATE`` seconds so that the probes of a whole swarm waiting
  on one aggregator reach it at about :data:`TARGET_RATE` a second, whatever the swarm's
  size; every probe is jittered, one per peer is in flight at most, :data:`IN_FLIGHT` per node;
- a failed probe makes the peer *suspect*, not cut off: :data:`HELPERS` other members are
  asked to probe it (``probe_req`` / ``probe_ack``, docs/wire.md, "Partitions") and the
  peer is **confirmed** cut off (:func:`confirmed`) only when none of them reached it within
  the wait. A helper that reached it refutes the suspicion: one honest helper outweighs any
  number of hostile ones, and no helper alone can make this node fail over (its own
  failed probe is needed first);
- every timeout is stretched by this node's own *health* (:meth:`Reachability.health`: how
  late its event loop wakes, Lifeguard's local health multiplier): a prober that is slow
  itself waits longer before it judges others;
- once a peer has been confirmed cut off (or a bridge is down), the node is in a
  partition: it probes at once instead of after the suspicion delay.

:class:`Reachability` keeps the latest confirmed verdict of each peer (for
:data:`PROBE_KEPT_S`), answers synchronously from it (:meth:`Reachability.cut_off`, for wait
predicates), probes on demand (:meth:`Reachability.check`, :meth:`Reachability.refresh`)
and, while a wait is on, probes the peers waited on as above (:meth:`Reachability.watching`),
waking the wait when a verdict changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

from p2pfl.background import TaskSet, background, cancel_and_wait

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2.0  # a connect on a live link takes milliseconds (× health)
PROBE_TTL_S = 1.5  # a probe this recent is not repeated
PROBE_KEPT_S = 5.0  # a verdict older than this says nothing any more (a link may have healed)
SUSPECT_S = 1.0  # a wait probes a peer after this long without a sign of life (× log10 N, × health)
PROBE_EVERY_S = 2.0  # then again after this long at the earliest (× health, + the spread)
EVIDENCE_S = 5.0  # a sign of life this recent stands for a probe (:meth:`Reachability.refresh`)
TARGET_RATE = 50.0  # probes a second one peer gets from a swarm that waits on it
PARTITION_S = 30.0  # a peer confirmed cut off this recently: probe at once, not after SUSPECT_S
HELPERS = 3  # members asked to probe a suspect
HELP_WAIT_S = PROBE_TIMEOUT_S + 0.5  # how long a suspicion waits for the helpers (× health)
HELP_IN_FLIGHT = 4  # probes a node makes for others at once (more requests are dropped)
IN_FLIGHT = 16  # probes a node makes for itself at once
TICK_S = 0.5  # how often a wait looks at whom to probe (and measures its loop's lag)
MAX_HEALTH = 8.0  # the widest timeouts grow

OFFLINE = "offline"
UNREACHABLE = "unreachable"


def verdict(
    online: bool, probe: bool | None, answered_before: bool, bridge_down: bool
) -> str | None:
    """What this node's own evidence says of a peer: :data:`OFFLINE`, :data:`UNREACHABLE`
    (suspected: see :func:`confirmed`) or None.

    ``online``: its presence is ``online``; ``probe``: the latest probe of its direct lane
    (True: it answered, False: it did not, None: no lane to probe); ``answered_before``: its
    lane answered this node at some earlier probe; ``bridge_down``: a bridge of this node's
    broker is down."""
    if not online:
        return OFFLINE
    if probe is False and (answered_before or bridge_down):
        return UNREACHABLE
    return None


def confirmed(own: str | None, answers: dict[str, bool | None]) -> bool:
    """Whether a suspicion is confirmed: this node's own probe failed (``own`` is
    :data:`UNREACHABLE`) and no helper that answered (``answers``: helper → reached the
    peer, None: had no lane to try or did not answer) reached it."""
    return own == UNREACHABLE and not any(ok is True for ok in answers.values())


def check_probe_message(kind: str, body: Any, members: Iterable[str]) -> tuple[str, bool | None]:
    """An untrusted ``probe_req`` (``{peer}``) or ``probe_ack`` (``{peer, ok}``) body:
    the peer named (a member) and, for an ack, whether the sender reached it. Raises
    ``ValueError`` when it is malformed."""
    want = {"peer"} if kind == "probe_req" else {"peer", "ok"}
    if not isinstance(body, dict) or set(body) != want:
        raise ValueError(f"{kind} must be a map of {sorted(want)}")
    peer = body["peer"]
    if not isinstance(peer, str) or not 1 <= len(peer) <= 64 or peer not in set(members):
        raise ValueError(f"{kind} names no member")
    ok = body.get("ok")
    if ok is not None and not isinstance(ok, bool):
        raise ValueError(f"{kind}: ok must be a bool or nil")
    return peer, ok


def suspicion_delay(members: int, health: float, partition: bool, rng: random.Random) -> float:
    """How long a wait lets a peer be silent before it probes it: ``SUSPECT_S × log10 N``
    (Lifeguard's suspicion grows with the swarm), 0 in a partition, times this node's health,
    plus a jitter over ``N / TARGET_RATE`` seconds (the swarm's probes of one peer spread)."""
    base = 0.0 if partition else SUSPECT_S * max(1.0, math.log10(max(members, 1)))
    return base * health + rng.uniform(0.0, max(members / TARGET_RATE, 0.05))


class Reachability:
    """The reachability of one node's peers, from ``online(peer)`` (presence),
    ``probe(peer, timeout)`` (the direct lane: True, False, or None without one) and
    ``bridge_down()`` (a bridge of this node's broker is down); ``changed()`` is called
    when a verdict flips (to wake the waits); ``answered(peer)``: the peer's direct lane
    answered this node otherwise (a pull went that way), as a successful probe does;
    ``members()``: the swarm's members (whom it may ask to help, and how many wait on a
    peer); ``ask(helper, kind, body)``: send a ``probe_req`` or ``probe_ack`` (None: no
    helpers, a suspicion is confirmed by this node's own probe alone); ``may_ask(helper)``:
    whether ``helper`` may be asked now (never one that knows no ``probe_req``; none at all
    while such a peer is heard: then, as without ``ask``, a suspicion is confirmed by this
    node's own probe; requests of others are still answered)."""

    def __init__(
        self,
        node_id: str,
        online: Callable[[str], bool],
        probe: Callable[[str, float], Any],
        bridge_down: Callable[[], bool],
        changed: Callable[[], None] = lambda: None,
        probe_timeout: float = PROBE_TIMEOUT_S,
        answered: Callable[[str], bool] = lambda _p: False,
        members: Callable[[], Iterable[str]] = lambda: (),
        ask: Callable[[str, str, dict[str, Any]], Awaitable[None]] | None = None,
        may_ask: Callable[[str], bool] = lambda _p: True,
    ):
        self.id = node_id
        self._online = online
        self._probe = probe
        self._bridge_down = bridge_down
        self._changed = changed
        self._answered = answered
        self._members = members
        self._ask = ask
        self._may_ask = may_ask
        self.probe_timeout = probe_timeout
        self.rng = random.Random(node_id)  # jitter only: no result depends on it
        self._last: dict[str, tuple[float, bool | None]] = {}  # peer -> (when, own probe)
        self._confirmed: dict[str, float] = {}  # peer -> when it was confirmed cut off
        self._evidence: dict[str, float] = {}  # peer -> its last sign of life
        self._next: dict[str, float] = {}  # peer -> the earliest next probe
        self._pending: dict[str, asyncio.Future[None]] = {}  # suspicions under way
        self._asked: dict[str, dict[str, bool | None]] = {}  # suspect -> helper -> answer
        self._events: dict[str, asyncio.Event] = {}  # suspect -> set when the helpers answered
        self._helping: dict[tuple[str, str], float] = {}  # (asker, peer) -> when answered
        self._help_in_flight = 0
        self._slots: asyncio.Semaphore | None = None
        self._tasks = TaskSet(lambda exc: log.debug("%s: probe task: %r", node_id, exc))
        self.answered: set[str] = set()  # peers whose lane answered at least once
        self._cut_at: dict[str, float] = {}  # peer -> when it was last confirmed cut off
        self._told = -math.inf  # when an announcement last said a partition was found
        self.since = time.monotonic()  # the start of the current round (:meth:`begin_round`)
        self.lag = 0.0  # how late this node's loop woke lately (decaying), seconds
        self._count: int | None = None  # how many members (counted once: they do not change)
        self.probes = 0
        self.suspected = 0  # own probes that failed (suspicions raised)
        self.refuted = 0  # suspicions a helper refuted

    # ------------------------------------------------------------------ verdicts
    def members(self) -> int:
        """How many members the swarm has (at least 1)."""
        if self._count is None:
            self._count = max(1, len(set(self._members())))
        return self._count

    def health(self) -> float:
        """Lifeguard's local health multiplier: 1 when this node's loop wakes on time, up
        to :data:`MAX_HEALTH` when it is late by seconds (it then waits longer on others)."""
        return min(MAX_HEALTH, 1.0 + self.lag / 0.5)

    def cut_off(self, peer: str) -> str | None:
        """Why ``peer`` cannot be reached: :data:`OFFLINE` from presence, or
        :data:`UNREACHABLE` when a suspicion of it was confirmed at most
        :data:`PROBE_KEPT_S` ago. None for this node itself."""
        if peer == self.id:
            return None
        if not self._online(peer):
            return OFFLINE
        when = self._confirmed.get(peer)
        if when is not None and time.monotonic() - when <= PROBE_KEPT_S:
            return UNREACHABLE
        return None

    def alive(self, peer: str) -> None:
        """A sign of life from ``peer`` (a message it sent, a pull it made): it stands for a
        probe for :data:`EVIDENCE_S`."""
        self._evidence[peer] = time.monotonic()

    def partition(self) -> bool:
        """Whether this node sees a partition now: a bridge of its broker is down, a peer
        was confirmed cut off, or an aggregator forked its lineage (:meth:`told_partition`),
        within :data:`PARTITION_S`."""
        now = time.monotonic()
        return (
            self._bridge_down()
            or now - self._told <= PARTITION_S
            or any(now - t <= PARTITION_S for t in self._confirmed.values())
        )

    def told_partition(self) -> None:
        """An announcement forked its lineage at its own attempt: its aggregator found a
        member it followed cut off. This node then probes a silent peer at once, with
        helpers (a peer that answers is still waited on: only the timing changes)."""
        self._told = time.monotonic()

    def begin_round(self) -> None:
        """A round starts: :meth:`cut_lately` looks back to now."""
        self.since = time.monotonic()

    def cut_lately(self, peer: str) -> bool:
        """Whether ``peer`` is cut off now or was found cut off since the round began: it
        may have missed what was said meanwhile (an announcement), even once healed."""
        return self.cut_off(peer) is not None or self._cut_at.get(peer, -1.0) >= self.since

    # ------------------------------------------------------------------ probing
    def _fresh(self, peer: str, now: float) -> bool:
        """Whether a probe of ``peer`` would tell nothing new: a recent one, a recent sign of
        life, or a verdict of cut off still kept (the waits renew it)."""
        if self.cut_off(peer) == UNREACHABLE:
            return True
        last = self._last.get(peer)
        evidence = self._evidence.get(peer, -math.inf)
        return (last is not None and now - last[0] < PROBE_TTL_S) or now - evidence < EVIDENCE_S

    async def _suspect(self, peer: str) -> None:
        """Probe ``peer``; when it fails, ask helpers before confirming (one at a time per
        peer: a second caller waits for the first)."""
        pending = self._pending.get(peer)
        if pending is not None:
            await asyncio.shield(pending)
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending[peer] = done
        try:
            await self._probe_and_confirm(peer)
        finally:
            del self._pending[peer]
            done.set_result(None)
            now = time.monotonic()
            if self.cut_off(peer) == UNREACHABLE:  # kept confirmed while it stays cut off
                self._next[peer] = now + PROBE_TTL_S
            else:
                spread = self.members() / TARGET_RATE
                self._next[peer] = now + PROBE_EVERY_S * self.health() + self.rng.uniform(0, spread)

    async def _probe_and_confirm(self, peer: str) -> None:
        """One own probe of ``peer``. A peer confirmed cut off stays so while its probes
        fail (no helper asked again); in a partition the helpers are asked beside the own
        probe rather than after it (the partition is known: time matters more)."""
        before = self.cut_off(peer)
        was_cut = before == UNREACHABLE
        early: asyncio.Future[dict[str, bool | None]] | None = None
        if not was_cut and self._ask is not None and self.partition():
            early = asyncio.ensure_future(self._indirect(peer))
        if self._slots is None:
            self._slots = asyncio.Semaphore(IN_FLIGHT)
        try:
            async with self._slots:
                result = await self._probe(peer, self.probe_timeout * self.health())
        except BaseException:
            if early is not None:
                early.cancel()
            raise
        self.probes += 1
        now = time.monotonic()
        self._last[peer] = (now, result)
        if result:
            self.answered.add(peer)
            self._confirmed.pop(peer, None)
        own = verdict(
            self._online(peer),
            result,
            peer in self.answered or self._answered(peer),
            self._bridge_down(),
        )
        if own == UNREACHABLE and was_cut:
            self._confirmed[peer] = self._cut_at[peer] = time.monotonic()
        elif own == UNREACHABLE:
            self.suspected += 1
            answers = await (early if early is not None else self._indirect(peer))
            if confirmed(own, answers):
                self._confirmed[peer] = self._cut_at[peer] = time.monotonic()
            else:
                self.refuted += 1
                log.info("%s: %s suspected, refuted by %s", self.id, peer, sorted(answers))
        elif early is not None:  # its own probe answered: nothing to confirm
            await cancel_and_wait(early)
        after = self.cut_off(peer)
        if after != before:
            log.warning(
                "%s: %s %s", self.id, peer, f"cannot be reached ({after})" if after else "reachable"
            )
            self._changed()

    def _helpers(self, peer: str) -> list[str]:
        """:data:`HELPERS` other members to ask about ``peer``: those online first; none
        that is offline or confirmed cut off (its answer would not come), none that
        ``may_ask`` refuses."""
        others = sorted(
            p
            for p in set(self._members()) - {self.id, peer}
            if self.cut_off(p) is None and self._may_ask(p)  # it can reach and answer it
        )
        self.rng.shuffle(others)
        others.sort(key=lambda p: not self._online(p))
        return others[:HELPERS]

    async def _indirect(self, peer: str) -> dict[str, bool | None]:
        """Ask helpers to probe ``peer``; their answers within the wait (None: no answer)."""
        helpers = self._helpers(peer) if self._ask is not None else []
        if not helpers or self._ask is None:
            return {}
        answers: dict[str, bool | None] = dict.fromkeys(helpers)
        self._asked[peer] = answers
        event = asyncio.Event()
        self._events[peer] = event
        try:
            for helper in helpers:
                self._tasks.spawn(self._ask(helper, "probe_req", {"peer": peer}))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), HELP_WAIT_S * self.health())
        finally:
            self._asked.pop(peer, None)
            self._events.pop(peer, None)
        return answers

    # ------------------------------------------------------------------ helping others
    def on_message(self, sender: str, kind: str, body: Any) -> str | None:
        """A ``probe_req`` or ``probe_ack`` from ``sender``; returns why it was dropped
        (malformed, unasked, too soon, too busy), or None when it was taken."""
        try:
            peer, ok = check_probe_message(kind, body, self._members())
        except ValueError as exc:
            return f"malformed: {exc}"
        self.alive(sender)
        if kind == "probe_ack":
            asked = self._asked.get(peer)
            if asked is None or sender not in asked or asked[sender] is not None:
                return "unasked"
            asked[sender] = ok
            if ok is True or all(a is not None for a in asked.values()):
                self._events[peer].set()
            return None
        now = time.monotonic()
        if now - self._helping.get((sender, peer), -math.inf) < PROBE_TTL_S:
            return "too soon"
        if peer != self.id and self._help_in_flight >= HELP_IN_FLIGHT:
            return "busy"
        self._helping = {k: t for k, t in self._helping.items() if now - t < PROBE_TTL_S}
        self._helping[(sender, peer)] = now
        self._tasks.spawn(self._help(sender, peer))
        return None

    async def _help(self, asker: str, peer: str) -> None:
        """Probe ``peer`` for ``asker`` (a fresh own probe is reused) and answer it."""
        if peer == self.id:
            ok: bool | None = True  # it asks about this node, which is evidently up
        else:
            last = self._last.get(peer)
            if last is not None and time.monotonic() - last[0] < PROBE_TTL_S:
                ok = last[1]
            else:
                self._help_in_flight += 1
                try:
                    ok = await self._probe(peer, self.probe_timeout * self.health())
                finally:
                    self._help_in_flight -= 1
                self._last[peer] = (time.monotonic(), ok)
                if ok:
                    self.answered.add(peer)
        if self._ask is not None:
            await self._ask(asker, "probe_ack", {"peer": peer, "ok": ok})

    # ------------------------------------------------------------------ entry points
    async def check(self, peer: str) -> str | None:
        """:meth:`cut_off`, after a probe when this node sees a partition
        (:meth:`partition`) and holds no fresh evidence of ``peer``: a wait starts on it."""
        if peer == self.id or not self._online(peer):
            return self.cut_off(peer)
        now = time.monotonic()
        last = self._last.get(peer)
        probed = last is not None and now - last[0] < PROBE_TTL_S
        if (
            self.partition()
            and not probed
            and now - self._evidence.get(peer, -math.inf) >= EVIDENCE_S
        ):
            await self._suspect(peer)
        return self.cut_off(peer)

    async def refresh(self, peers: Iterable[str]) -> None:
        """Probe every online peer of ``peers`` (concurrently, :data:`IN_FLIGHT` at most)
        that this node holds no fresh evidence of (a recent probe or sign of life)."""
        now = time.monotonic()
        due = [
            p for p in set(peers) if p != self.id and self._online(p) and not self._fresh(p, now)
        ]
        if due:
            await asyncio.gather(*(self._suspect(p) for p in due))

    def _note_lag(self, slept: float, asked: float) -> None:
        late = max(0.0, slept - asked)
        self.lag = max(late, self.lag * 0.9)

    @contextlib.asynccontextmanager
    async def watching(self, peers: Callable[[], Iterable[str]]) -> AsyncIterator[None]:
        """While inside, probe each peer of ``peers()`` once it has been silent for its
        :func:`suspicion_delay` (since the wait's start and its last sign of life), then every
        :data:`PROBE_EVERY_S` or so (a flip of a verdict calls ``changed``, which wakes the
        wait); measures the lag of this node's loop meanwhile (:meth:`health`)."""
        start = time.monotonic()
        first: dict[str, float] = {}  # peer -> when it may be probed first
        delay: dict[str, float] = {}  # peer -> its suspicion delay in this wait

        async def loop() -> None:
            while True:
                now = time.monotonic()
                n = self.members()
                for p in set(peers()):
                    if p == self.id or p in self._pending or not self._online(p):
                        continue
                    if p not in first:
                        delay[p] = suspicion_delay(n, self.health(), self.partition(), self.rng)
                        first[p] = start + delay[p]
                    quiet_since = max(first[p], self._evidence.get(p, -math.inf) + delay[p])
                    if now >= quiet_since and now >= self._next.get(p, 0.0):
                        self._tasks.spawn(self._suspect(p))
                t0 = time.monotonic()
                await asyncio.sleep(TICK_S)
                self._note_lag(time.monotonic() - t0, TICK_S)

        async with background(loop()):
            yield

    async def aclose(self) -> None:
        """Cancel the probes and answers still under way."""
        await self._tasks.aclose()
