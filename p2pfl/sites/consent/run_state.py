"""One run as a site daemon follows it: the spec, the votes and commits heard, the commit
this site acted on, its decision, its worker (rebuilt from the retained messages when the
daemon starts)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from p2pfl.algorithms.cards.probe import OutsideCode
from p2pfl.sites.consent.agreement import decided, out_of_reach
from p2pfl.sites.consent.run_spec import RunSpec
from p2pfl.sites.policy.rules import Decision
from p2pfl.sites.runs.worker import RunWorker


@dataclass
class RunState:
    """One run as this daemon follows it (rebuilt from the retained messages at start)."""

    run_id: str
    spec: RunSpec
    proposer: str
    proposed_ts: float
    votes: dict[str, dict[str, Any]] = field(default_factory=dict)
    commits: dict[str, dict[str, Any]] = field(default_factory=dict)  # committer → body
    held: dict[str, tuple[dict[str, Any], bytes]] = field(default_factory=dict)  # waiting
    members: tuple[str, ...] | None = None  # the commit this site acted on
    acted_on: str | None = None  # its committer
    decision: Decision | None = None
    worker: RunWorker | None = None
    heard_at: float = field(default_factory=time.monotonic)  # when this daemon heard it
    leaving: str | None = None  # why this site stops its worker on purpose (drained)
    waiting: str = ""  # why a committed run waits for a slot
    tasks: list[asyncio.Task] = field(default_factory=list)
    outside: OutsideCode | None = None  # what a child process learned of its outside code
    metrics: dict[str, float] = field(default_factory=dict)  # its node's latest test_* figures

    @property
    def deadline(self) -> float:
        return self.proposed_ts + self.spec.vote_deadline_s

    def accepted(self) -> set[str]:
        return {s for s, v in self.votes.items() if v.get("vote") == "accept"}

    def out_of_reach(self) -> str | None:
        """Why the run can no longer commit, whatever votes are still to come, by the votes
        heard (:func:`~p2pfl.sites.consent.agreement.out_of_reach`); None while it may."""
        return out_of_reach(self.vote_values(), self.spec.quorum.min_accept, self.named())

    def decided(self) -> bool:
        """Whether the votes heard decide the run before its deadline
        (:func:`~p2pfl.sites.consent.agreement.decided`): its proposer may commit it."""
        return decided(self.vote_values(), self.spec.quorum.min_accept, self.named())

    def vote_values(self) -> dict[str, str]:
        """Each site's vote heard: ``accept``, ``reject`` or ``pending``."""
        return {s: v["vote"] for s, v in self.votes.items()}

    def named(self) -> list[str] | None:
        """The sites the spec names; None for a run open to any site."""
        return None if self.spec.members == "any" else self.spec.members
