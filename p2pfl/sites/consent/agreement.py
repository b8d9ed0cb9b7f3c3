"""How sites agree on a run without a server (docs/design.md, "Site policy"): the pure
rules of propose, vote, commit.

- :func:`tally`: the members a run commits with (every site that voted ``accept``, in
  the spec's ``members`` when it names them), or why it aborts (fewer than ``min_accept``);
- :func:`out_of_reach`: why a run that names its members can no longer commit, whatever
  the votes still to come: its proposer aborts it then, before the deadline;
- :func:`decided`: whether the votes heard let a run commit before its deadline (every
  site it names voted, or its quorum accepted): its proposer commits it then;
- :func:`committers`: who commits, in order: the proposer first, then the accepting sites
  ranked by a pure function of ``(run_id, site)``, so every site names the same fallback
  committer without a vote on it (the rotating aggregator's handover, applied to commits);
- :func:`winning_commit`: of several commits of one run (a partition let two committers
  act), the one by the committer ranked first; members of another stop.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

VoteValue = Literal["accept", "reject", "pending"]


@dataclass(frozen=True)
class Tally:
    """A run's votes counted: ``members`` (sorted) when it commits, else ``aborted`` (why)."""

    members: tuple[str, ...]
    aborted: str | None = None


def tally(
    votes: Mapping[str, VoteValue],
    min_accept: int,
    members: Iterable[str] | None = None,
    expected: Iterable[str] = (),
) -> Tally:
    """The members a run commits with: every site whose vote is ``accept`` (of ``members``,
    the sites the spec names; None: any site). Fewer than ``min_accept`` of them: aborted,
    with the count, the sites still pending, and the sites that did not vote in time (of
    ``members``, or of the ``expected`` sites when the spec names none)."""
    named = None if members is None else set(members)
    accepted = sorted(
        s for s, v in votes.items() if v == "accept" and (named is None or s in named)
    )
    if len(accepted) >= min_accept:
        return Tally(tuple(accepted))
    pending = sorted(s for s, v in votes.items() if v == "pending")
    silent = sorted((named if named is not None else set(expected)) - set(votes))
    why = f"{len(accepted)} of the {min_accept} accepting sites needed"
    if pending:
        why += f" ({len(pending)} still pending: {', '.join(pending)})"
    if silent:
        why += f"; no vote in time from {', '.join(silent)}"
    return Tally((), why)


def out_of_reach(
    votes: Mapping[str, VoteValue], min_accept: int, members: Iterable[str] | None
) -> str | None:
    """Why the run can no longer commit, whatever the votes still to come: fewer than
    ``min_accept`` of the sites it names (``members``) have not rejected it (a pending vote,
    or none yet, may still accept). None while they might reach it, and always for a run
    open to any site (``members`` None: a site not heard yet may still accept)."""
    if members is None:
        return None
    named = set(members)
    rejected = sorted(s for s, v in votes.items() if v == "reject" and s in named)
    left = len(named) - len(rejected)
    if left >= min_accept:
        return None
    return (
        f"{len(rejected)} of the {len(named)} sites asked rejected it ({', '.join(rejected)}): "
        f"at most {left} may accept, {min_accept} needed"
    )


def decided(votes: Mapping[str, VoteValue], min_accept: int, members: Iterable[str] | None) -> bool:
    """Whether a run may commit before its deadline: every site it names (``members``) has
    voted ``accept`` or ``reject`` (a ``pending`` vote waits for its operator), or, for a
    run open to any site (``members`` None), ``min_accept`` sites have accepted (its
    proposer then waits for the others: :func:`commit_grace_s`). The commit is
    :func:`tally`'s, as at the deadline."""
    if members is None:
        return sum(v == "accept" for v in votes.values()) >= min_accept
    return all(votes.get(s) in ("accept", "reject") for s in set(members))


def commit_grace_s(vote_deadline_s: float) -> float:
    """How long the proposer of a run open to any site waits, once its quorum accepted, for
    the sites it has heard from that have not voted yet: a quarter of the vote's deadline,
    between 2 s and 10 s (it commits at once when every one of them has voted)."""
    return min(10.0, max(2.0, vote_deadline_s / 4))


def rank(run_id: str, site: str) -> str:
    """The key that orders fallback committers: SHA-256 over ``run_id:site``."""
    return hashlib.sha256(f"{run_id}:{site}".encode()).hexdigest()


def committers(run_id: str, proposer: str, accepted: Iterable[str]) -> list[str]:
    """Who commits ``run_id``, in order: its ``proposer``, then the other ``accepted`` sites
    by :func:`rank`. The site at position ``k`` commits when no commit came ``k`` grace
    periods after the vote deadline."""
    rest = sorted({s for s in accepted if s != proposer}, key=lambda s: rank(run_id, s))
    return [proposer, *rest]


def winning_commit(run_id: str, proposer: str, commits: Mapping[str, tuple[str, ...]]) -> str:
    """Of several commits of ``run_id`` (committer → the members it committed), the
    committer whose commit stands: the one ranked first by :func:`committers` over every
    committer. Raises ``ValueError`` when there is none."""
    if not commits:
        raise ValueError("no commit")
    return next(s for s in committers(run_id, proposer, commits) if s in commits)


def grace_s(vote_deadline_s: float) -> float:
    """How long each fallback committer waits after the one before it: a quarter of the
    vote's deadline, between 3 s and 60 s (a pure function of the spec, so every site
    counts the same turns)."""
    return min(60.0, max(3.0, vote_deadline_s / 4))
