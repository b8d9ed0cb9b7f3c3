"""What every member of a centralized round agrees on, and the rules both sides of the
rotating aggregator follow (docs/design.md, "Rotating aggregator"; the messages:
docs/wire.md, "Rotating aggregator").

- :class:`RoundPlan`: the roster, the participants and the method's server state of a round;
- :func:`draw_plan`: a round's drawn members (the client fraction) and participants,
  drawn alike by every node that knows the roster and the server state;
  :func:`announced_plan`: the plan an announcement carries; :func:`live_members`: the
  roster live presence gives;
- :func:`check_announcement`: an untrusted ``announce`` body, checked before it is used;
- :func:`waits_on`: whether a wait of a round should go on waiting for a peer.

The round driver (:mod:`p2pfl.rounds.rotation.centralized`) and the aggregator's role
(:mod:`p2pfl.rounds.rotation.aggregator`) both use them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from p2pfl.algorithms.base import CentralizedAlgorithm, draw_members
from p2pfl.rounds.rotation.lineage import check_lineage
from p2pfl.services.bundle import NodeServices


@dataclass
class RoundPlan:
    """What every member of round ``round`` agrees on before it starts. ``drawn``: the
    members the client fraction drew (:func:`~p2pfl.algorithms.base.draw_members`), None
    when the fraction is 1 (every member is drawn); ``participants`` are among them."""

    round: int
    roster: list[str]
    participants: list[str]
    server: dict[str, Any] = field(default_factory=dict)
    drawn: list[str] | None = None


def live_members(services: NodeServices) -> list[str]:
    """The members of the swarm that are online now, sorted: the roster of a plan drawn
    from live presence."""
    return sorted(p for p in set(services.cfg.node_ids) if services.peers.is_online(p))


def drawn_of(
    alg: CentralizedAlgorithm, seed: int, round_no: int, roster: list[str]
) -> list[str] | None:
    """The members the method's client fraction draws for round ``round_no`` from
    ``roster`` (:func:`~p2pfl.algorithms.base.draw_members`), None when it draws them all."""
    if alg.fraction >= 1:
        return None
    return draw_members(roster, alg.fraction, seed, round_no)


def draw_plan(
    alg: CentralizedAlgorithm, seed: int, round_no: int, roster: list[str], server: dict[str, Any]
) -> RoundPlan:
    """Round ``round_no``'s plan over ``roster``: the client fraction draws its members
    (:func:`drawn_of`; all of them at fraction 1), then the method draws its participants
    among them from ``server`` with a generator seeded by the swarm's seed and the round, so
    every node draws the same."""
    drawn = drawn_of(alg, seed, round_no, roster)
    rng = np.random.default_rng([seed, round_no, 0x5E1EC7])
    pool = roster if drawn is None else drawn
    return RoundPlan(round_no, roster, alg.participants(server, pool, round_no, rng), server, drawn)


def announced_plan(
    alg: CentralizedAlgorithm, seed: int, round_no: int, body: dict[str, Any]
) -> RoundPlan:
    """Round ``round_no``'s plan as a checked announcement of round ``round_no - 1`` gives
    it (:func:`check_announcement`): its roster, participants and server state, and the
    members the client fraction draws from that roster."""
    return RoundPlan(
        round_no,
        body["roster"],
        body["participants"],
        body["server"],
        drawn_of(alg, seed, round_no, body["roster"]),
    )


def waits_on(services: NodeServices, peer: str, round_no: int) -> bool:
    """Whether a wait of round ``round_no`` should go on waiting for ``peer``: it is in
    step (online, near this round, not joining after it) and has not finished the round
    already (settled on another attempt)."""
    return (
        services.peers.in_step(peer, round_no)
        and (services.peers.reported_round(peer) or 0) < round_no
    )


def _check_ids(value: Any, allowed: set[str], what: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{what} must be a list of node ids")
    unknown = set(value) - allowed
    if unknown:
        raise ValueError(f"{what} names unknown nodes {sorted(unknown)[:5]}")
    return sorted(set(value))


def check_announcement(body: Any, members: set[str]) -> dict[str, Any]:
    """Validate an (untrusted) announcement body; raise ``ValueError`` if it is malformed."""
    if not isinstance(body, dict):
        raise ValueError("announcement must be a map")
    roster = _check_ids(body.get("roster"), members, "roster")
    if not roster:
        raise ValueError("announcement has an empty roster")
    participants = _check_ids(body.get("participants"), set(roster), "participants")
    server = body.get("server", {})
    if not isinstance(server, dict):
        raise ValueError("server state must be a map")
    receivers = _check_ids(body.get("receivers", []), members, "receivers")
    common = body.get("common", False)
    if not isinstance(common, bool):
        raise ValueError("common must be a bool")
    aggregated = _check_ids(body.get("aggregated", []), members, "aggregated")
    claims = body.get("claims", {})
    if not isinstance(claims, dict) or not all(
        p in aggregated and isinstance(n, int) and not isinstance(n, bool) and n > 0
        for p, n in claims.items()
    ):
        raise ValueError("claims must map aggregated nodes to positive sample counts")
    reports = body.get("reports", {})
    if not isinstance(reports, dict) or not all(
        p in aggregated and isinstance(rep, dict) for p, rep in reports.items()
    ):
        raise ValueError("reports must map aggregated nodes to maps")
    out = {
        "roster": roster,
        "participants": participants,
        "server": server,
        "receivers": receivers,
        "common": common,
        "aggregated": aggregated,
        "claims": claims,
        "reports": reports,
    }
    # semi-asynchronous rounds (timing.quorum) only: the late uploads counted, with their
    # staleness in rounds; the members the round closed without; the median report latency
    if "late" in body:
        late = body["late"]
        if not isinstance(late, dict) or not all(
            p in aggregated and isinstance(s, int) and not isinstance(s, bool) and s >= 1
            for p, s in late.items()
        ):
            raise ValueError("late must map aggregated nodes to a staleness of 1 or more rounds")
        out["late"] = dict(late)
    # what the aggregator's defence did to the uploads it aggregated (present when it did
    # something): refused (left out of the aggregate) and clipped (pulled onto its bound,
    # peer -> distance over the bound); an auditor recomputes both
    if "refused" in body:
        refused = _check_ids(body["refused"], set(aggregated), "refused")
        out["refused"] = refused
    if "clipped" in body:
        clipped = body["clipped"]
        if not isinstance(clipped, dict) or not all(
            p in aggregated
            and isinstance(x, (int, float))
            and not isinstance(x, bool)
            and math.isfinite(x)
            and x > 0
            for p, x in clipped.items()
        ):
            raise ValueError("clipped must map aggregated nodes to finite positive ratios")
        out["clipped"] = {p: float(x) for p, x in sorted(clipped.items())}
    if "closed_without" in body:
        out["closed_without"] = _check_ids(body["closed_without"], members, "closed_without")
    if "lineage" in body:  # docs/wire.md, "Partitions"
        out["lineage"] = check_lineage(body["lineage"])
    if "report_s" in body:
        latency = body["report_s"]
        if (
            not isinstance(latency, (int, float))
            or isinstance(latency, bool)
            or not math.isfinite(latency)
            or latency < 0
        ):
            raise ValueError("report_s must be a finite non-negative number of seconds")
        out["report_s"] = float(latency)
    # under privacy.dp with the clip defence: the DP noise allowance the aggregator's clip
    # measured with (docs/algorithms.md, "DP and the defence"), which an auditor bounds
    if "noise_spread" in body:
        spread = body["noise_spread"]
        if (
            not isinstance(spread, (int, float))
            or isinstance(spread, bool)
            or not math.isfinite(spread)
            or spread < 0
        ):
            raise ValueError("noise_spread must be a finite non-negative number")
        out["noise_spread"] = float(spread)
    return out
