"""The next roster by difference, and an announcement without what a member derives
(docs/wire.md, "Roster by difference").

An announcement of round ``r`` carries round ``r + 1``'s roster as a change against round
``r``'s, which every member of round ``r`` holds (it ran the round on it):
``roster_base`` (the digest of round ``r``'s roster), ``roster_add`` and ``roster_drop``
(sorted member ids) and ``roster_digest`` (the digest of the roster they give). A roster
that changed more than it stayed travels whole (``roster``), as before. A member that does
not hold the base (an observer, a member catching up) or whose copy differs asks the
aggregator for the whole roster (``roster_req`` to its inbox; the answer, ``roster``, is
taken only when it gives the announced digest): :class:`RosterRequests`.

- :func:`roster_digest`: the digest of a roster (BLAKE2b-128 over the sorted ids);
- :func:`by_difference`: the wire form of the next roster of an announcement;
- :func:`resolve`: the next roster an (untrusted) announcement gives against the base a
  member holds, or :class:`MissingBase`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Iterable
from typing import Any

from p2pfl.background import TaskSet
from p2pfl.errors import P2PFLError
from p2pfl.services.bundle import NodeServices
from p2pfl.wire.envelope import Envelope
from p2pfl.wire.errors import TransportError

log = logging.getLogger(__name__)

DIGEST_CHARS = 32  # BLAKE2b-128, hex
DELTA_KEYS = ("roster_base", "roster_add", "roster_drop", "roster_digest")
PENDING_KEPT = 64  # announcements held while their roster is asked for (the oldest goes)


class MissingBase(P2PFLError, ValueError):
    """An announcement names its roster against a base this member does not hold."""


def roster_digest(roster: Iterable[str]) -> str:
    """The digest of ``roster`` (order and repeats do not matter)."""
    data = "\n".join(sorted(set(roster))).encode()
    return hashlib.blake2b(data, digest_size=DIGEST_CHARS // 2).hexdigest()


def by_difference(base: list[str], roster: list[str]) -> dict[str, Any]:
    """The announcement's fields for ``roster`` against ``base`` (the round's roster):
    the change and both digests, or ``{roster}`` whole when the change is not smaller."""
    old, new = set(base), set(roster)
    add, drop = sorted(new - old), sorted(old - new)
    if len(add) + len(drop) >= len(new):
        return {"roster": sorted(new)}
    return {
        "roster_base": roster_digest(old),
        "roster_add": add,
        "roster_drop": drop,
        "roster_digest": roster_digest(new),
    }


def on_the_wire(
    announcement: dict[str, Any], base: list[str] | None, members: Iterable[str]
) -> dict[str, Any]:
    """``announcement`` (whole, as the aggregator keeps it) as it is sent, against
    ``base`` (the round's roster; None: whole, as protocol 3 reads it) and ``members`` (the
    swarm's): the next roster by difference (:func:`by_difference`), and nothing a member
    derives itself: no ``participants`` (drawn from the roster and server state as every
    member draws them: :func:`~p2pfl.rounds.rotation.plans.draw_plan`), no ``aggregated``
    (the keys of ``claims``), no ``receivers`` when they are the aggregated members, no
    empty ``reports`` entry, and ``claims`` as ``claims_of`` (which members, a bitmap over
    the sorted members) and ``claims_n`` (their counts, in that order). :func:`resolve` and
    the announcement's check give the whole announcement back."""
    if base is None:
        return announcement
    body = {k: v for k, v in announcement.items() if k not in ("roster", "participants")}
    claims = body.pop("claims", {})
    aggregated = sorted(claims)
    if body.get("aggregated") == aggregated:
        del body["aggregated"]
    if body.get("receivers") == aggregated:
        del body["receivers"]
    ids = sorted(set(members))
    at = {m: i for i, m in enumerate(ids)}
    if set(claims) <= at.keys():
        bits = sum(1 << at[p] for p in claims)
        body["claims_of"] = bits.to_bytes(_bitmap_bytes(len(ids)), "little")
        body["claims_n"] = [claims[p] for p in aggregated]
    else:  # not the swarm's members: sent as it is, for the check to refuse
        body["claims"] = claims
    reports = {p: rep for p, rep in body.get("reports", {}).items() if rep != {}}
    if reports:
        body["reports"] = reports
    else:
        body.pop("reports", None)
    body.update(by_difference(base, announcement["roster"]))
    return body


def _bitmap_bytes(n: int) -> int:
    return (n + 7) // 8


def _claims_of(body: dict[str, Any], members: set[str]) -> dict[str, Any]:
    """``claims`` from ``claims_of`` and ``claims_n`` (:func:`on_the_wire`); ValueError when
    they are malformed (the counts themselves are the announcement's check's)."""
    bitmap, counts = body.get("claims_of"), body.get("claims_n")
    ids = sorted(members)
    if not isinstance(bitmap, (bytes, bytearray)) or len(bitmap) != _bitmap_bytes(len(ids)):
        raise ValueError(f"claims_of must be a bitmap of {_bitmap_bytes(len(ids))} bytes")
    bits = int.from_bytes(bitmap, "little")
    if bits >> len(ids):
        raise ValueError("claims_of sets bits past the members")
    named = [m for i, m in enumerate(ids) if bits >> i & 1]
    if not isinstance(counts, list) or len(counts) != len(named):
        raise ValueError("claims_n must give one count per member claims_of sets")
    rest = {k: v for k, v in body.items() if k not in ("claims_of", "claims_n")}
    return {**rest, "claims": dict(zip(named, counts, strict=True))}


def _digest(value: Any, what: str) -> str:
    if not isinstance(value, str) or len(value) != DIGEST_CHARS:
        raise ValueError(f"{what} must be a {DIGEST_CHARS}-character digest")
    return value


def _ids(value: Any, members: set[str], what: str) -> set[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{what} must be a list of node ids")
    if len(value) > len(members) or not set(value) <= members:
        raise ValueError(f"{what} names unknown nodes")
    return set(value)


def _restored(body: dict[str, Any], members: set[str]) -> dict[str, Any]:
    """An announcement as :func:`on_the_wire` sends it (it has no ``participants``) with
    what it left out put back: ``claims`` from ``claims_of`` and ``claims_n``,
    ``aggregated`` (the keys of ``claims``), ``receivers`` (the aggregated members), and an
    empty ``reports`` entry for each aggregated member without one. ValueError when the
    compact claims are malformed; other malformed fields are left to the check."""
    if "participants" in body:
        return body  # whole, as protocol 3 sends it
    if "claims_of" in body or "claims_n" in body:
        if "claims" in body:
            raise ValueError("claims and claims_of are exclusive")
        body = _claims_of(body, members)
    claims = body.get("claims", {})
    if not isinstance(claims, dict):
        return body  # the announcement's check refuses it
    aggregated = sorted(claims)
    body = {"aggregated": aggregated, "receivers": aggregated, **body}
    reports = body.get("reports", {})
    if not isinstance(reports, dict):
        return body
    full = {p: reports.get(p, {}) for p in body["aggregated"] if isinstance(p, str)}
    return {**body, "reports": {**full, **reports}}


def resolve(body: dict[str, Any], base: list[str] | None, members: set[str]) -> dict[str, Any]:
    """``body`` (an untrusted announcement map) with its next roster whole (``roster``):
    as it came, or rebuilt from the change against ``base`` (the roster this member holds of
    the announced round; None: none). Raises :class:`MissingBase` when the base is not the
    one named, ``ValueError`` when the fields are malformed or give another digest."""
    body = _restored(body, members)
    if "roster" in body or not any(k in body for k in DELTA_KEYS):
        return body  # whole (or missing: the announcement's own check says so)
    if not all(k in body for k in DELTA_KEYS):
        raise ValueError(f"a roster by difference needs {list(DELTA_KEYS)}")
    named = _digest(body["roster_base"], "roster_base")
    wanted = _digest(body["roster_digest"], "roster_digest")
    add = _ids(body["roster_add"], members, "roster_add")
    drop = _ids(body["roster_drop"], members, "roster_drop")
    if base is None or roster_digest(base) != named:
        raise MissingBase("the roster's base is not held")
    roster = (set(base) - drop) | add
    if roster_digest(roster) != wanted:
        raise ValueError("the roster's change does not give its digest")
    whole = {k: v for k, v in body.items() if k not in DELTA_KEYS}
    whole["roster"] = sorted(roster)
    return whole


class RosterRequests:
    """The announcements one member holds until their roster comes whole (it lacked their
    base), and its requests for them: one ``roster_req`` per announcement."""

    def __init__(self, services: NodeServices) -> None:
        self.services = services
        self.members = set(services.cfg.node_ids)
        self._held: dict[tuple[int, int, str], Envelope] = {}
        self._served: set[tuple[int, int, str]] = set()  # (round, attempt, asker) answered
        self.tasks = TaskSet(lambda exc: log.debug("%s: roster: %r", services.id, exc))

    async def ask(self, env: Envelope) -> None:
        """Hold ``env`` (an announcement whose base this member lacks) and ask its sender
        for the whole roster, once per announcement."""
        key = (env.round, env.attempt, env.sender)
        if key in self._held:
            return
        if len(self._held) >= PENDING_KEPT:
            del self._held[min(self._held)]
        self._held[key] = env
        try:
            await self.services.exchange.send(
                env.sender, "roster_req", env.round, {}, attempt=env.attempt
            )
        except TransportError as exc:
            log.warning("%s: roster of %d/%d not asked: %s", self.services.id, *key[:2], exc)

    def answer(self, env: Envelope) -> Envelope | str:
        """The held announcement ``env`` (a ``roster`` answer) completes, with its roster
        whole; or why the answer is dropped (unasked, malformed, another digest)."""
        held = self._held.get((env.round, env.attempt, env.sender))
        if held is None:
            return "unasked"
        body = env.body
        if not isinstance(body, dict) or set(body) != {"roster"}:
            return "malformed: roster must be a map of ['roster']"
        try:
            roster = _ids(body["roster"], self.members, "roster")
        except ValueError as exc:
            return f"malformed: {exc}"
        if roster_digest(roster) != held.body.get("roster_digest"):
            return "malformed: the roster does not give the announced digest"
        del self._held[(env.round, env.attempt, env.sender)]
        whole = {k: v for k, v in held.body.items() if k not in DELTA_KEYS}
        whole["roster"] = sorted(roster)
        return dataclasses.replace(held, body=whole)

    async def serve(self, env: Envelope, announcement: dict[str, Any] | None) -> str | None:
        """Answer ``env`` (a ``roster_req`` for ``announcement``, this node's announcement
        of the attempt it names; None: it made none) with the whole roster, once per asker
        and attempt; returns why it was not answered."""
        key = (env.round, env.attempt, env.sender)
        if env.body != {}:
            return "malformed: roster_req must be an empty map"
        if announcement is None:
            return "unknown announcement"
        if key in self._served:
            return "answered already"
        self._served.add(key)
        try:
            await self.services.exchange.send(
                env.sender,
                "roster",
                env.round,
                {"roster": announcement["roster"]},
                attempt=env.attempt,
            )
        except TransportError as exc:
            log.warning("%s: roster to %s not sent: %s", self.services.id, env.sender, exc)
        return None

    def forget(self, floor: int) -> None:
        """Drop the held announcements and the answers of round ``floor`` and before."""
        for key in [k for k in self._held if k[0] <= floor]:
            del self._held[key]
        self._served = {k for k in self._served if k[0] > floor}
