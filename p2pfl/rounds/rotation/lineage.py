"""Model lineages of a centralized swarm, and how a healed partition becomes one again
(docs/wire.md, "Partitions").

A **lineage** is a chain of announcements each applied on top of the one before: every
member that applies the same announcement holds the same global model, and names it by
the announcement's ``lineage``. Every member starts on :data:`ROOT`. The rules, pure:

- **fork** (:func:`result_lineage`): an aggregator whose base lineage was followed, in the
  round it last applied, by a member it cannot reach now (cut off, not departed: an
  ``offline`` member does not fork) names its result after itself,
  ``<round>.<attempt>.<aggregator>`` (:func:`fork_name`): the members across the cut may be
  carrying on the same lineage with another model, and from here the two sides are told
  apart. A side that stays cut off keeps its new name (its followers are all reachable).
- **merge** (:func:`winner`): every report carries its member's lineage. An aggregator that
  receives reports of more than one lineage (after a heal) aggregates them all (the losing
  side's members thus merge their models into the result) and names the result after the
  lineage the most reporting members followed (this node included); a tie goes to the
  lexicographically smallest name, so any aggregator names the same winner from the same
  reports.
- **adopt** (:meth:`Lineage.adopt`): a member that applies an announcement follows its
  lineage from then on, whatever it followed before; a round it settles without an
  announcement keeps its lineage.

Names are untrusted on the wire: :func:`check_lineage`.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

ROOT = "0"  # the lineage every member starts on (every member draws the same initial model)
MAX_NAME = 96
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def check_lineage(value: Any) -> str:
    """An untrusted lineage name: a non-empty string of at most :data:`MAX_NAME` characters
    from ``[A-Za-z0-9_.-]``; ValueError otherwise."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME or not _NAME.match(value):
        raise ValueError(f"lineage must be a short name of [A-Za-z0-9_.-], got {value!r:.40}")
    return value


def fork_name(round_no: int, attempt: int, aggregator: str) -> str:
    """The name of a lineage forked by ``aggregator`` at attempt ``attempt`` of ``round_no``."""
    return f"{round_no}.{attempt}.{aggregator}"


def winner(followed: Mapping[str, str]) -> str:
    """The lineage the most members of ``followed`` (member → lineage) follow; a tie goes to
    the smallest name. ValueError when empty."""
    if not followed:
        raise ValueError("no lineage to choose from")
    counts = Counter(followed.values())
    return min(counts, key=lambda name: (-counts[name], name))


def result_lineage(
    own: str,
    followers: Iterable[str],
    reporters: Mapping[str, str],
    cut_off: Callable[[str], bool],
    round_no: int,
    attempt: int,
    aggregator: str,
) -> tuple[str, list[str]]:
    """The lineage an aggregator names its result of ``(round_no, attempt)`` after, and the
    other lineages the result merged (sorted).

    ``own``: the aggregator's lineage; ``followers``: who followed it in the round the
    aggregator last applied (that announcement's ``aggregated``); ``reporters``: the
    lineage of each report aggregated; ``cut_off(member)``: the member cannot be reached
    now (not merely offline). The winner of ``reporters`` and ``own``
    (:func:`winner`) names the result; when that is ``own`` and one of its followers is
    cut off, the result forks (:func:`fork_name`)."""
    followed = {**reporters, aggregator: own}
    name = winner(followed)
    merged = sorted(set(followed.values()) - {name})
    if name == own and any(m != aggregator and cut_off(m) for m in followers):
        name = fork_name(round_no, attempt, aggregator)
    return name, merged


class Lineage:
    """The lineage one member follows (:attr:`name`) and who followed it in the round the
    member last applied (:attr:`followers`)."""

    def __init__(self) -> None:
        self.name = ROOT
        self.followers: list[str] = []

    def adopt(self, body: Mapping[str, Any]) -> None:
        """Follow the lineage of an applied announcement ``body`` (checked: its
        ``lineage`` and ``aggregated``); an announcement without one (a peer that predates
        lineages) keeps the current name."""
        self.name = body.get("lineage", self.name)
        self.followers = list(body.get("aggregated", []))
