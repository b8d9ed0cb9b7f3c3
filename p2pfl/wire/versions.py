"""Protocol versions in a swarm whose devices upgrade one at a time (docs/wire.md,
"Protocol versions"; README.md, "Rolling upgrades").

A node runs :data:`p2pfl.PROTOCOL_VERSION` and still speaks every version down to
:data:`p2pfl.MIN_PROTOCOL_VERSION`: the envelope of protocol 3 is the envelope of protocol 4
(4 added announcements that carry the next roster by difference and leave out what a member
derives, and the kinds of :data:`NEW_IN_4`, which a protocol 3 node drops as malformed). So:

- an envelope of a version it speaks is accepted; one of any other version is dropped
  (``protocol_version``), with one log line per peer and version naming both versions and
  what to upgrade (:func:`refusal`);
- a node **speaks the oldest version run by a peer it hears online**, or that such a peer
  hears run (:func:`speaking`, :class:`PeerVersions`): it stamps that version on what it
  sends and, while it speaks 3, sends announcements whole and asks no helper to probe
  (:func:`speaks_4`), so a peer not yet upgraded reads everything it sends: of the kinds of
  :data:`NEW_IN_4` it then sends only ``roster_req`` to an aggregator that announced by
  difference and the answers to what a peer asked (both protocol 4 peers). Each node says
  once per peer which older version the peer runs (:func:`older_peer`).

What a peer *runs* comes from its presence (``protocol``, which every p2pfl node has always
announced), not from the ``v`` of its envelopes: an upgraded node speaking protocol 3 for an
old peer's sake still runs 4, so the swarm returns to 4 once the last old peer is upgraded
or offline. :class:`PeerVersions` keeps that view for one node.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from typing import Any

from p2pfl import MIN_PROTOCOL_VERSION, PROTOCOL_VERSION

# every line the transport writes goes to one logger, whichever of its modules writes it
log = logging.getLogger("p2pfl.wire.transport")

SPOKEN = range(MIN_PROTOCOL_VERSION, PROTOCOL_VERSION + 1)
TOLD_MAX = 1024  # (peer, version) pairs logged once; past it the drop counters still count
# the kinds protocol 4 added: indirect probes (docs/wire.md, "Partitions") and the whole
# roster asked of an aggregator ("Roster by difference"); a protocol 3 node drops them
NEW_IN_4 = frozenset({"probe_req", "probe_ack", "roster_req", "roster"})


def speaks(version: object) -> bool:
    """Whether this build reads and writes envelopes of ``version``."""
    return isinstance(version, int) and not isinstance(version, bool) and version in SPOKEN


def speaks_4(spoken: int) -> bool:
    """Whether a node that speaks ``spoken`` may send what protocol 4 added unasked:
    announcements by difference and ``probe_req``. False while a peer of protocol 3 is
    heard: announcements then go whole and a suspicion is confirmed by the node's own probe
    alone, as protocol 3 confirms it."""
    return spoken >= 4


def speaking(peers_run: Iterable[int]) -> int:
    """The version a node stamps on what it sends: the oldest that a peer heard online runs,
    among those this build speaks (a peer it cannot speak to is refused, not followed);
    :data:`p2pfl.PROTOCOL_VERSION` when none runs an older one."""
    return min((v for v in peers_run if speaks(v)), default=PROTOCOL_VERSION)


def refusal(node_id: str, peer: str, version: object) -> str:
    """The log line of a message refused for its protocol ``version``: both versions and the
    action to take."""
    ours = f"runs protocol {PROTOCOL_VERSION} (speaks {MIN_PROTOCOL_VERSION}–{PROTOCOL_VERSION})"
    if isinstance(version, int) and not isinstance(version, bool) and version > PROTOCOL_VERSION:
        action = (
            f"upgrade {node_id} to a p2pfl release that speaks protocol {version}; "
            f"until then it does not hear {peer!r}"
        )
    else:
        action = (
            f"upgrade {peer!r} to a p2pfl release that speaks protocol {PROTOCOL_VERSION} "
            f"(this release); until then {node_id} does not hear it"
        )
    return (
        f"{node_id}: peer {peer!r} sends protocol {version!r}; {node_id} {ours}: its messages "
        f"are dropped (protocol_version). {action} (README.md, 'Rolling upgrades')"
    )


def older_peer(node_id: str, peer: str, version: int) -> str:
    """The log line of a peer heard running an older protocol that this node still speaks."""
    return (
        f"{node_id}: peer {peer!r} runs protocol {version}, {node_id} runs {PROTOCOL_VERSION}: "
        f"accepted; {node_id} speaks protocol {version} (whole announcements, no indirect probes) "
        "while a peer runs it. "
        f"Upgrade {peer!r} to finish the rolling upgrade (README.md, 'Rolling upgrades')"
    )


def newer_peer(node_id: str, peer: str, version: int) -> str:
    """The log line of a peer heard running a newer protocol that still speaks this one."""
    return (
        f"{node_id}: peer {peer!r} runs protocol {version}, {node_id} runs {PROTOCOL_VERSION}: "
        f"{peer!r} speaks {PROTOCOL_VERSION} to this node; upgrade {node_id} to finish the "
        "rolling upgrade (README.md, 'Rolling upgrades')"
    )


class PeerVersions:
    """The protocol each peer runs, as one node hears it, and the version it speaks.

    :meth:`presence` records a peer's presence: the protocol it runs (``protocol``, else the
    envelope's ``v``) and the oldest one it hears run (``oldest``: a node announces in its
    presence :attr:`oldest` when that is older than its own). :attr:`speak` is the oldest of
    both over the peers heard online, so a member that does not hear an old peer's presence
    itself (a centralized member hears the round's aggregators only) still speaks to it
    once a peer that hears it says so. Only what a node hears first hand is announced, so
    the swarm returns to :data:`~p2pfl.PROTOCOL_VERSION` once the old peer is gone.
    :meth:`refused` logs a refused version once per peer and version. :attr:`messages`
    counts the messages accepted per envelope version."""

    def __init__(self, node_id: str):
        self.node_id = node_id
        self.runs: dict[str, int] = {}  # protocol each peer runs, from its latest presence
        self.hears: dict[str, int] = {}  # the oldest protocol each peer hears run
        self.online: set[str] = set()  # peers whose latest presence is not offline
        self.messages: Counter[int] = Counter()
        self._told: set[tuple[str, object]] = set()
        self.speak = PROTOCOL_VERSION
        self.oldest = PROTOCOL_VERSION  # the oldest protocol a peer heard online runs

    def presence(self, peer: str, v: int, info: dict[str, Any]) -> bool:
        """Record ``peer``'s presence ``info`` that came in an envelope of version ``v``;
        True when :attr:`speak` or :attr:`oldest` changed (this node's presence is then due
        again, in the version it now speaks)."""
        runs = info.get("protocol")
        if not isinstance(runs, int) or isinstance(runs, bool):
            runs = v
        self.runs[peer] = runs
        hears = info.get("oldest")
        self.hears[peer] = hears if speaks(hears) else PROTOCOL_VERSION  # type: ignore[assignment]
        if info.get("status") == "offline":
            self.online.discard(peer)
        else:
            self.online.add(peer)
            told = (peer, runs) in self._told or len(self._told) >= TOLD_MAX
            if runs != PROTOCOL_VERSION and not told:
                self._told.add((peer, runs))
                if runs < PROTOCOL_VERSION:
                    log.warning(older_peer(self.node_id, peer, runs))
                else:
                    log.warning(newer_peer(self.node_id, peer, runs))
        before = self.speak, self.oldest
        self.oldest = speaking(self.runs[p] for p in self.online)
        self.speak = min(self.oldest, speaking(self.hears[p] for p in self.online))
        if self.speak != before[0]:
            log.warning(
                "%s: now speaks protocol %d (runs %d)", self.node_id, self.speak, PROTOCOL_VERSION
            )
        return (self.speak, self.oldest) != before

    def refused(self, peer: str, version: object) -> None:
        """Log a message refused for its ``version`` (:func:`refusal`), once per peer and
        version; the caller counts it."""
        if (peer, version) not in self._told and len(self._told) < TOLD_MAX:
            self._told.add((peer, version))
            log.warning(refusal(self.node_id, peer, version))
