"""What one member of a rotating-aggregator swarm knows of the rotation (docs/design.md,
"Rotating aggregator"): the roster of each round it learnt, the announcements it heard by
``(round, attempt)``, the attempts peers asked it to run, and where it stands
(:attr:`Rotation.current`, :attr:`Rotation.applied`); from them, who aggregates and who
audits an attempt, whether an attempt was superseded, and whether a message is stale.
Every other role of the centralized driver (:mod:`p2pfl.rounds.rotation.centralized`) reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from p2pfl.errors import P2PFLError
from p2pfl.rounds.rotation.audit import audit_active, auditor_of
from p2pfl.rounds.rotation.election import succession
from p2pfl.rounds.rotation.plans import check_announcement, draw_plan, drawn_of
from p2pfl.rounds.rotation.role import RotationRole
from p2pfl.rounds.rotation.roster import resolve
from p2pfl.services.bundle import NodeServices
from p2pfl.wire.envelope import Envelope

ROUNDS_KEPT = 3  # uploads, results and announcements kept for late pulls and late messages


class Behind(P2PFLError):  # noqa: N818 (control flow between the driver's roles)
    """This member fell behind the swarm (``round``: the latest round the swarm finished).
    Raised by a role and caught by :class:`~p2pfl.rounds.rotation.centralized.CentralizedRounds`,
    which catches up; it never leaves the driver."""

    def __init__(self, round_no: int):
        super().__init__(round_no)
        self.round = round_no


@dataclass(frozen=True)
class Heard:
    """A checked announcement of attempt ``attempt`` of round ``round``, from ``sender``."""

    round: int
    attempt: int
    sender: str
    body: dict[str, Any]


class Rotation(RotationRole):
    """One member's view of the rotation: :attr:`rosters` (round → roster),
    :attr:`announced` (round → attempt → :class:`Heard`), :attr:`wanted` (round → the
    highest attempt a peer reported to this node for), :attr:`current` (the ``(round,
    attempt)`` this member is at) and :attr:`applied` (the last round whose result it
    applied, or gave up on)."""

    def __init__(self, services: NodeServices) -> None:
        super().__init__(services)
        # the audit of each round's aggregate (signed swarms)
        self.audited = audit_active(services.cfg, self.alg)
        self.rosters: dict[int, list[str]] = {}
        self.current = (0, 0)
        self.applied = 0
        self.announced: dict[int, dict[int, Heard]] = {}
        self.wanted: dict[int, int] = {}

    # ------------------------------------------------------------------ who
    def aggregator(self, round_no: int, attempt: int) -> str | None:
        """Who aggregates attempt ``attempt`` of ``round_no`` (None while the round's roster
        is unknown, or past its last member)."""
        roster = self.rosters.get(round_no)
        if not roster or attempt >= len(roster):
            return None
        return succession(round_no, roster)[attempt]

    def auditor(self, round_no: int, attempt: int) -> str | None:
        """Who audits attempt ``attempt`` of ``round_no`` (None without an audit, or while
        the round's roster is unknown)."""
        roster, agg = self.rosters.get(round_no), self.aggregator(round_no, attempt)
        if not self.audited or not roster or agg is None:
            return None
        return auditor_of(self.cfg.seed, round_no, attempt, roster, agg)

    def others(self) -> list[str]:
        """Every member but this node, sorted."""
        return sorted(self.members - {self.id})

    # ------------------------------------------------------------------ the swarm
    def swarm_round(self) -> int:
        """The latest round an online member reports having finished (0: none)."""
        return self.services.peers.swarm_round(self.others())

    def behind(self, round_no: int) -> int | None:
        """The latest round the swarm reports finished when this node, at ``round_no``, has
        fallen :data:`~p2pfl.services.bundle.LAG_ROUNDS` behind it; None when in step."""
        return self.services.peers.behind(round_no, self.others())

    def check_behind(self, round_no: int) -> None:
        """Raise :class:`Behind` when this node, at ``round_no``, fell behind the swarm."""
        ahead = self.behind(round_no)
        if ahead is not None:
            raise Behind(ahead)

    # ------------------------------------------------------------------ announcements
    def check(self, round_no: int, body: Any) -> dict[str, Any]:
        """An untrusted announcement of ``round_no``, checked (:func:`check_announcement`,
        and the next round's participants among the members its seed draws), its roster
        whole (:func:`~p2pfl.rounds.rotation.roster.resolve` against this node's roster of
        ``round_no``); ValueError when it is malformed,
        :class:`~p2pfl.rounds.rotation.roster.MissingBase` when this node lacks that base."""
        if isinstance(body, dict):
            body = resolve(body, self.rosters.get(round_no), set(self.members))
            if "participants" not in body and isinstance(body.get("server", {}), dict):
                body = {**body, "participants": self._drawn(round_no + 1, body)}
        checked = check_announcement(body, self.members)
        drawn = drawn_of(self.alg, self.cfg.seed, round_no + 1, checked["roster"])
        if drawn is not None and not set(checked["participants"]) <= set(drawn):
            raise ValueError("participants outside the client fraction's draw")
        return checked

    def _drawn(self, round_no: int, body: dict[str, Any]) -> list[str] | None:
        """The participants of ``round_no`` an announcement that leaves them out gives: as
        every member draws them from its roster and server state
        (:func:`~p2pfl.rounds.rotation.plans.draw_plan`); None (refused by the check) when
        the roster is not a list of members."""
        roster = body.get("roster")
        if not isinstance(roster, list) or not set(roster) <= set(self.members) or not roster:
            return None
        server = body.get("server", {})
        return sorted(
            draw_plan(self.alg, self.cfg.seed, round_no, sorted(set(roster)), server).participants
        )

    def note(self, heard: Heard) -> None:
        """Keep an announcement heard (checked)."""
        self.announced.setdefault(heard.round, {})[heard.attempt] = heard

    def unnote(self, heard: Heard) -> None:
        """Forget an announcement whose result could not be had."""
        attempts = self.announced.get(heard.round, {})
        attempts.pop(heard.attempt, None)
        if not attempts:
            self.announced.pop(heard.round, None)

    def superseding(self, round_no: int, attempt: int) -> int | None:
        """The latest attempt of ``round_no`` announced after ``attempt`` (None: none)."""
        later = [a for a in self.announced.get(round_no, {}) if a > attempt]
        return max(later) if later else None

    def superseded_at(self, round_no: int, attempt: int) -> Callable[[], bool]:
        """Whether a later attempt than ``attempt`` of ``round_no`` was announced, asked
        anew at each call (a wait's predicate)."""
        return lambda: self.superseding(round_no, attempt) is not None

    # ------------------------------------------------------------------ messages
    def stale(self, env: Envelope, what: str) -> bool:
        """Drop (and count) a message of a round already applied or a dead attempt."""
        rnd, att = self.current
        if env.round <= self.applied:
            self.services.ledger.drop(
                "stale_round", f"{what} {env.round}/{env.attempt} from {env.sender}"
            )
            return True
        if env.round == rnd and env.attempt < att:
            self.services.ledger.drop(
                "stale_attempt", f"{what} {env.round}/{env.attempt} from {env.sender}"
            )
            return True
        return False

    def too_far(self, env: Envelope, what: str) -> bool:
        """Drop (and count) a message of a round too far ahead to keep."""
        if env.round > max(self.applied, self.current[0]) + ROUNDS_KEPT and self.applied:
            self.services.ledger.drop("future_round", f"{what} {env.round} from {env.sender}")
            return True
        return False

    def forget(self, floor: int) -> None:
        """Drop the announcements of round ``floor`` and before."""
        for r in [r for r in self.announced if r <= floor]:
            del self.announced[r]
