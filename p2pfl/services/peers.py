"""The peers port: what a node knows of its peers' presence, the waits woken when it
changes, and the gate that refuses a neighbour for good reason.

- **presence view**: who is online, what round a peer reports, whether it is in step with a
  round, whether this node fell behind (docs/wire.md, "Rounds and catch-up");
- **waits**: :meth:`PeerView.wait_for` a predicate, woken by :meth:`PeerView.notify`
  whenever a message or a presence change arrives, bounded by a deadline;
- **the refused-peer gate**: a neighbour whose announced model layout differs from this
  node's is refused (:meth:`PeerView.check_layout`; docs/wire.md, "Model layout"): its
  status reads ``refused``, so no round counts it and no pull of it is served.

Presence is untrusted: every field read here is checked for its type.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from p2pfl.learning.layout import fingerprint_holds, layout_difference, parse_layout
from p2pfl.learning.layout import summary as layout_summary

log = logging.getLogger(__name__)

# a peer this many rounds or more away from a node's round is not in step with it: the node
# does not wait on it, and a node that far behind its neighbours catches up
LAG_ROUNDS = 3


class PeerView:
    """Node ``node_id``'s view of its peers: ``presence`` is the live map peer → latest
    presence (the transport's, updated as presence arrives); ``dropped`` counts what the
    gate refuses (``layout_mismatch``)."""

    def __init__(self, node_id: str, presence: Mapping[str, dict[str, Any]], dropped: Counter):
        self.id = node_id
        self._presence = presence
        self._dropped = dropped
        self._changed = asyncio.Event()
        self._refused: dict[str, str] = {}
        self._layout_asks: set[str] = set()  # peers whose tensor list is to be asked now
        self._layouts_asked: set[tuple[str, str]] = set()  # (peer, fp) asked already
        self._layouts_served: set[str] = set()  # askers answered
        self._whole_layouts: dict[str, dict[str, Any]] = {}  # peer → its layout, as answered
        self._refused_fp: dict[str, str | None] = {}  # peer → the fp its refusal is of

    # ------------------------------------------------------------------ presence view
    def status(self, peer: str) -> str:
        """``peer``'s latest presence status (``online``, ``done``, ``offline``, ``unknown``),
        or ``refused`` for a neighbour this node refuses (:meth:`refusal`)."""
        if peer in self._refused:
            return "refused"
        return str(self._presence.get(peer, {}).get("status", "unknown"))

    def is_online(self, peer: str) -> bool:
        """Whether ``peer`` is this node or its presence is ``online``."""
        return peer == self.id or self.status(peer) == "online"

    def online(self, peers: list[str]) -> list[str]:
        """The peers of ``peers`` whose presence is ``online`` (order kept)."""
        return [p for p in peers if self.status(p) == "online"]

    def reported_round(self, peer: str) -> int | None:
        """The round ``peer``'s presence reports having finished, None when it reports none
        (presence is untrusted: anything but an int counts as none)."""
        r = self._presence.get(peer, {}).get("round")
        return r if isinstance(r, int) and not isinstance(r, bool) else None

    def joined_round(self, peer: str) -> int:
        """The first round ``peer`` ran since it (re)joined the swarm (1 when it reports
        none): a node that joined late or caught up skipped the rounds before."""
        j = self._presence.get(peer, {}).get("joined")
        return j if isinstance(j, int) and not isinstance(j, bool) and j >= 1 else 1

    def in_step(self, peer: str, round_no: int) -> bool:
        """Whether ``peer`` is online and can take part in round ``round_no`` with this node
        (docs/wire.md, "Rounds and catch-up"): it is in a round less than
        :data:`LAG_ROUNDS` away (behind or ahead) and did not skip ``round_no`` by joining
        after it. A peer that is not in step is not waited on."""
        if not self.is_online(peer):
            return False
        current = (self.reported_round(peer) or 0) + 1
        return abs(current - round_no) < LAG_ROUNDS and self.joined_round(peer) <= round_no

    def swarm_round(self, peers: list[str]) -> int:
        """The latest round an online peer of ``peers`` reports having finished (0: none)."""
        rounds = [self.reported_round(p) for p in self.online(peers)]
        return max((r for r in rounds if r is not None), default=0)

    def behind(self, round_no: int, peers: list[str]) -> int | None:
        """When an online peer of ``peers`` is :data:`LAG_ROUNDS` or more rounds ahead of
        ``round_no``, the latest round such a peer reports finished (the node should catch
        up to the round after it); None when this node is in step."""
        swarm = self.swarm_round(peers)
        return swarm if swarm + 1 >= round_no + LAG_ROUNDS else None

    def progress(self, peers: list[str], last_round: int) -> int:
        """How far ``peers`` have gone in a ``last_round``-round run (what a catch-up
        round's pace is measured by; docs/wire.md, "Rounds and catch-up"): the latest round
        an online one reports finished, at most ``last_round``, or ``last_round`` when one
        is ``done`` (a done peer's round claim is not read); 0 when none reports one."""
        if any(self.status(p) == "done" for p in peers):
            return last_round
        return min(self.swarm_round(peers), last_round)

    def catch_up_to(self, round_no: int, peers: list[str], last_round: int) -> int | None:
        """The round a node about to run ``round_no`` of a ``last_round``-round run skips to
        (docs/wire.md, "Rounds and catch-up"), None when it runs ``round_no``:

        - the round after :meth:`behind`'s, when an online peer is :data:`LAG_ROUNDS` ahead,
          or ``last_round`` when that peer reports round ``last_round − LAG_ROUNDS + 1`` or
          later: a node that far behind would only run its last rounds behind the swarm;
        - ``last_round``, when a peer of ``peers`` is ``done``, none is online, and
          ``round_no`` is at least :data:`LAG_ROUNDS` − 1 rounds before it: the node would
          otherwise train the rest of the run alone, with nobody to merge with. A done
          peer's round claim is not read; the run's length is the node's own."""
        ahead = self.behind(round_no, peers)
        if ahead is not None and ahead + 1 <= last_round:
            return last_round if ahead + LAG_ROUNDS - 1 >= last_round else ahead + 1
        if round_no + LAG_ROUNDS - 1 <= last_round:
            statuses = {self.status(p) for p in peers}
            if "done" in statuses and "online" not in statuses:
                return last_round
        return None

    # ------------------------------------------------------------------ waits
    def notify(self) -> None:
        """Something a waiter may be waiting on changed: re-check every predicate."""
        self._changed.set()

    async def wait_for(self, predicate: Callable[[], bool], deadline: float) -> bool:
        """Wait until ``predicate()`` holds (True) or the monotonic ``deadline`` passes
        (False); the predicate is re-checked after every :meth:`notify`. A cancellation of
        the waiting task always ends the wait (``asyncio.wait``: ``asyncio.wait_for`` before
        Python 3.12 swallows one that lands as a notify wakes it)."""
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._changed.clear()
            changed = asyncio.ensure_future(self._changed.wait())
            try:
                await asyncio.wait({changed}, timeout=remaining)
            finally:
                changed.cancel()
        return True

    # ------------------------------------------------------------------ the refused-peer gate
    def refusal(self, peer: str) -> str | None:
        """Why this node refuses ``peer`` (None: it does not)."""
        return self._refused.get(peer)

    def check_layout(self, peer: str, info: Mapping[str, Any], own: dict[str, Any]) -> bool:
        """Whether ``peer``'s announced model layout (its presence ``info``) is this node's
        (``own``); a neighbour whose layout differs is refused before any weight moves
        (counted ``layout_mismatch``), and the error names both layouts and their first
        difference. A presence without a layout (a node of an older release) is taken on
        trust: every state it sends still passes the layout check of its pull."""
        if "layout" not in info:
            return True
        theirs = parse_layout(info.get("layout"), compact=True)
        if theirs is not None and "tensors" not in theirs and theirs["fp"] != own["fp"]:
            known = self._whole_layouts.get(peer)
            if known is not None and known["fp"] == theirs["fp"]:
                theirs = known  # its tensor list came already
            elif (peer, theirs["fp"]) not in self._layouts_asked:
                self._layouts_asked.add((peer, theirs["fp"]))
                self._layout_asks.add(peer)
        if theirs is None:
            why = "its presence announces a malformed layout"
        else:
            diff = layout_difference(own, theirs)
            if diff is None:
                self._refused.pop(peer, None)
                return True
            why = (
                f"its model layout {layout_summary(theirs)} differs from this node's "
                f"{layout_summary(own)}: {diff}"
            )
        fp = None if theirs is None else theirs["fp"]
        before = self._refused.get(peer)
        if before != why:
            self._refused[peer] = why
            if before is None or self._refused_fp.get(peer) != fp:  # not its list, come later
                self._dropped["layout_mismatch"] += 1
            self._refused_fp[peer] = fp
            log.error("%s: refusing neighbour %s: %s", self.id, peer, why)
        return False

    def layout_asks(self) -> list[str]:
        """The peers whose tensor list this node should ask for now (``layout_req``): each
        announced a compact layout (docs/wire.md, "Model layout") unlike this node's, once
        per peer and fingerprint."""
        asks = sorted(self._layout_asks)
        self._layout_asks.clear()
        return asks

    def layout_answer(self, peer: str, body: Any, own: dict[str, Any]) -> str | None:
        """Take ``peer``'s ``layout`` answer (``{layout}``, its whole layout) to name the
        first difference of its refusal; or why it is dropped: not asked of it, malformed,
        or not the layout its presence announced."""
        info = self._presence.get(peer, {}).get("layout")
        announced = info.get("fp") if isinstance(info, Mapping) else None
        if (peer, announced) not in self._layouts_asked:
            return "unexpected_layout"
        whole = parse_layout(body.get("layout")) if isinstance(body, dict) else None
        if whole is None or whole["fp"] != announced or not fingerprint_holds(whole):
            return "malformed"
        self._whole_layouts[peer] = whole
        self.check_layout(peer, {"layout": whole}, own)
        return None

    def serves_layout(self, asker: str) -> bool:
        """Whether a ``layout_req`` of ``asker`` is answered: once per asker."""
        if asker in self._layouts_served:
            return False
        self._layouts_served.add(asker)
        return True
