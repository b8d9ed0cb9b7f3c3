"""The audit of a rotating aggregator: a member drawn by the round's seed recomputes the
aggregate from the signed uploads and announces whether it matches (docs/design.md,
"Auditing the aggregator"; the messages: docs/wire.md, "Rotating aggregator").

Aggregation is deterministic (fixed order, float64 accumulation, no randomness) and, in a
signed swarm, every upload reaches the auditor signed by its uploader. So the auditor of
attempt ``a`` of round ``r`` can pull each upload the announcement names (``aggregated``)
from its uploader, run the method's pure server rule as the aggregator ran it (same plan,
same weights and reports as announced, the aggregator's defence around the aggregator's own
upload, or the model part it serves as its upload when it did not train) and compare the
result with what the aggregator served it, tensor by tensor, and the announced server
state. Each member checks its own entry of the announced weights and
reports against what it sent; the auditor checks the rest.

This module holds the pure parts: who audits, the recomputation and the comparison.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
from collections.abc import Mapping
from typing import Any

import torch

from p2pfl.algorithms.base import Aggregate, CentralizedAlgorithm, Upload
from p2pfl.config.schema import TopologyConfig
from p2pfl.learning.defence import Defence, DefenceInputs
from p2pfl.learning.state import State
from p2pfl.rounds.rotation.plans import RoundPlan
from p2pfl.rounds.rotation.quorum import staleness_weight
from p2pfl.wire.envelope import same_body

VERDICTS = ("ok", "mismatch", "incomplete")


def audit_active(cfg: TopologyConfig, alg: CentralizedAlgorithm) -> bool:
    """Whether rounds are audited: ``security.sign`` and ``security.audit`` (uploads must be
    signed for the audit to prove anything)."""
    return cfg.security.sign and cfg.security.audit and alg.kind == "centralized"


def auditor_of(
    seed: int, round_no: int, attempt: int, roster: list[str], aggregator: str | None
) -> str | None:
    """The member who audits attempt ``attempt`` of round ``round_no``: drawn from the
    roster without the aggregator with a generator seeded by (seed, round, attempt), so every
    member names the same one; None when nobody else is in the roster."""
    pool = sorted(p for p in roster if p != aggregator)
    if not pool:
        return None
    return random.Random(f"{seed}:audit:{round_no}:{attempt}").choice(pool)


def check_own_entry(body: Mapping[str, Any], me: str, sent: Mapping[str, Any] | None) -> str | None:
    """None when the announcement's weight and report for ``me`` are what ``me`` sent
    (``sent``: its report message, ``{"n", "report"}``; None when it sent none), else why
    not. The weight may be lower (capped), never higher."""
    claims, reports = body.get("claims", {}), body.get("reports", {})
    if sent is None or me not in body.get("aggregated", []):
        return None
    if me not in claims or me not in reports:
        return "the announcement lacks this node's weight or report"
    if claims[me] > sent["n"]:
        return f"announced weight {claims[me]} > the {sent['n']} samples this node reported"
    if not same_body(reports[me], sent["report"]):
        return "the announced report is not the one this node sent"
    return None


SPREAD_TOLERANCE = 4.0
"""How many times the auditor's own DP noise spread an aggregator may announce: the spread
depends on each node's sample count (its σ and steps), so the auditor cannot recompute the
aggregator's exactly, but one announced far above any honest node's would let the
aggregator widen ``clip``'s bound at will."""


def spread_problem(announced: object, own: float) -> str | None:
    """None when the announcement's ``noise_spread`` (absent: 0) is one an honest
    aggregator of this swarm could have used, given the auditor's ``own`` spread (0 without
    DP): a finite number in ``[0, SPREAD_TOLERANCE · own]``; else why not."""
    value = 0.0 if announced is None else announced
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return f"noise_spread {announced!r} is not a finite number"
    if value < 0 or value > SPREAD_TOLERANCE * own:
        return (
            f"announced DP noise spread {value:.4g} outside [0, {SPREAD_TOLERANCE:g} x "
            f"this node's {own:.4g}]"
        )
    return None


def announced_inputs(
    round_no: int, body: Mapping[str, Any], reference: State | None
) -> DefenceInputs:
    """The defence inputs the aggregator of ``round_no`` measured with, rebuilt from its
    announcement ``body`` (its ``noise_spread``, absent: 0) and the state it serves as its
    upload (``reference``); rotation rounds discount no peer by staleness there (a late
    upload's discount is in its announced weight)."""
    return DefenceInputs(
        round_no, reference=reference, noise_spread=float(body.get("noise_spread", 0.0))
    )


def screened_uploads(defence: Defence, uploads: Mapping[str, Any]) -> dict[str, Any]:
    """What ``defence`` did to ``uploads`` in the round's aggregation, as an announcement
    carries it: ``refused`` (the uploads left out, sorted) and ``clipped`` (peer → its
    distance over the bound, ``centered_clip``), each only when not empty."""
    out: dict[str, Any] = {}
    refused = sorted(p for p in defence.rejected if p in uploads)
    if refused:
        out["refused"] = refused
    clipped = {p: x for p, x in sorted(defence.clipped.items()) if p in uploads}
    if clipped:
        out["clipped"] = clipped
    return out


def recompute(
    alg: CentralizedAlgorithm,
    cfg: TopologyConfig,
    aggregator: str,
    plan: RoundPlan,
    uploads: dict[str, State],
    body: Mapping[str, Any],
    reference: State | None = None,
    defence: Defence | None = None,
) -> Aggregate:
    """The aggregate of ``plan.round`` as ``aggregator`` had to compute it: the server rule
    of a copy of ``alg`` that is the aggregator (its id, a fresh defence measuring with
    :func:`announced_inputs`: from ``reference``, the state the aggregator serves as its
    upload, with the announced DP noise spread) over ``uploads`` with the announced weights
    (a late upload's claim discounted by its announced staleness,
    :func:`~p2pfl.rounds.rotation.quorum.staleness_weight`) and reports. ``alg`` itself is
    not changed. ``defence``: the fresh defence to use (a new one by default), which then
    holds what it refused and clipped (:func:`screened_uploads`)."""
    defence = defence if defence is not None else Defence(cfg.defence, cfg.rounds)
    defence.begin_round(announced_inputs(plan.round, body, reference))
    as_aggregator = copy.copy(alg)
    as_aggregator.ctx = dataclasses.replace(alg.ctx, node_id=aggregator, defence=defence)
    claims, reports = body.get("claims", {}), body.get("reports", {})
    late, a = body.get("late", {}), cfg.timing.staleness_exponent
    checked = {
        p: Upload(
            staleness_weight(int(claims[p]), int(late.get(p, 0)), a),
            uploads[p],
            alg.check_report(reports.get(p, {})),
        )
        for p in sorted(uploads)
    }
    return as_aggregator.aggregate(checked, plan.server, plan.roster, plan.round)


def compare(
    expected: Aggregate,
    me: str,
    received: State | None,
    announced_server: Any,
    screening: tuple[Mapping[str, Any], Mapping[str, Any]] | None = None,
) -> str | None:
    """None when the aggregator served ``me`` what the recomputation gives it (every tensor
    equal, bit for bit) and announced the same server state and, with ``screening``
    (``(recomputed, announced)``, :func:`screened_uploads`), the same refusals and
    clipping; else what differs."""
    if screening is not None:
        mine_s, theirs = screening
        if list(mine_s.get("refused", [])) != list(theirs.get("refused", [])):
            return "the announced refusals differ from the recomputed ones"
        if dict(mine_s.get("clipped", {})) != dict(theirs.get("clipped", {})):
            return "the announced clipping differs from the recomputed one"
    mine = expected.results.get(me, expected.common)
    if (mine is None) != (received is None):
        return "served a result where none was due" if mine is None else "served no result"
    if mine is not None and received is not None:
        if set(mine) != set(received):
            return "the result's tensors differ from the recomputed ones"
        for k in sorted(mine):
            a, b = mine[k].detach().cpu(), received[k].detach().cpu()
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
                return f"tensor {k!r} differs from the recomputed aggregate"
    if not same_body(expected.server, announced_server):
        return "the announced server state differs from the recomputed one"
    return None


def check_verdict(body: Any) -> dict[str, Any]:
    """An (untrusted) ``audit`` body: ``{aggregator, verdict, why}``; ``ValueError`` when
    malformed."""
    if not isinstance(body, dict):
        raise ValueError("audit verdict must be a map")
    aggregator, verdict, why = body.get("aggregator"), body.get("verdict"), body.get("why", "")
    if not isinstance(aggregator, str) or verdict not in VERDICTS or not isinstance(why, str):
        raise ValueError("audit verdict needs aggregator, verdict (ok/mismatch/incomplete), why")
    return {"aggregator": aggregator, "verdict": verdict, "why": why[:300]}
