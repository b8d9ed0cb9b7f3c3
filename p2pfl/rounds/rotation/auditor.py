"""The audit's side of a centralized round for one node (docs/design.md, "Auditing the
aggregator"): as the round's auditor, pull the announced uploads, recompute, compare and
gossip the verdict; as any other member, check its own entry of the announcement and wait
(bounded) for the verdict; and keep the verdicts heard and the aggregators convicted. The
pure parts (who audits, the recomputation, the comparison) are :mod:`p2pfl.rounds.rotation.audit`'s;
the round driver (:mod:`p2pfl.rounds.rotation.centralized`) owns one :class:`AuditRole`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from p2pfl.learning.defence import Defence
from p2pfl.learning.state import State
from p2pfl.rounds.rotation.aggregator import AggregatorRole
from p2pfl.rounds.rotation.audit import (
    check_own_entry,
    check_verdict,
    compare,
    screened_uploads,
    spread_problem,
)
from p2pfl.rounds.rotation.audit import recompute as recompute_aggregate
from p2pfl.rounds.rotation.plans import RoundPlan, waits_on
from p2pfl.rounds.rotation.reach import Reachability
from p2pfl.rounds.rotation.role import RotationRole
from p2pfl.rounds.rotation.rotation import Rotation
from p2pfl.services.bundle import NodeServices
from p2pfl.wire.envelope import Envelope
from p2pfl.wire.errors import TransportError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AuditCheck:
    """The audit of one attempt, as a member saw it: why the round fails over (None: it
    does not) and the record's ``audit`` (None: the attempt is not audited, or was
    superseded before its verdict)."""

    failover: str | None
    record: dict[str, Any] | None


class AuditRole(RotationRole):
    """The verdicts of one node's swarm and this node's part in each audit. ``rotation``
    says who aggregates and who audits an attempt; ``uploads`` holds this node's own
    uploads and the ones it offered late (quorum rounds); ``reach`` the node's view of who
    is reachable (docs/wire.md, "Partitions": an auditor cut off is not waited on; None:
    no view)."""

    def __init__(
        self,
        services: NodeServices,
        rotation: Rotation,
        uploads: AggregatorRole,
        reach: Reachability | None = None,
    ) -> None:
        super().__init__(services)
        self.rotation = rotation
        self.uploads = uploads
        self.verdicts: dict[tuple[int, int], dict[str, Any]] = {}
        # aggregators an auditor caught: every member skips them as aggregators from then on
        self.convicted: set[str] = set()
        self.reach = reach

    def forget(self, floor: int) -> None:
        """Drop the verdicts of round ``floor`` and before (convictions stay)."""
        for key in [k for k in self.verdicts if k[0] <= floor]:
            del self.verdicts[key]

    def on_verdict(self, env: Envelope) -> None:
        """Keep the verdict of the rightful auditor of ``(round, attempt)``; a ``mismatch``
        convicts the aggregator it names (signed, so every member holds the same proof). The
        driver has dropped stale and far-ahead messages already."""
        if self.rotation.auditor(env.round, env.attempt) != env.sender:
            self.services.ledger.drop(
                "not_auditor", f"audit {env.round}/{env.attempt} from {env.sender}"
            )
            return
        try:
            body = check_verdict(env.body)
        except ValueError as exc:
            self.services.ledger.drop("malformed", f"audit from {env.sender}: {exc}")
            return
        if body["aggregator"] != self.rotation.aggregator(env.round, env.attempt):
            self.services.ledger.drop("malformed", f"audit from {env.sender}: not this attempt's")
            return
        self.note(env.round, env.attempt, body)
        self.services.peers.notify()

    def note(self, round_no: int, attempt: int, body: dict[str, Any]) -> None:
        """Keep a verdict (heard or this node's own); a ``mismatch`` convicts."""
        self.verdicts[(round_no, attempt)] = body
        if body["verdict"] == "mismatch" and body["aggregator"] not in self.convicted:
            self.convicted.add(body["aggregator"])
            log.warning(
                "%s: round %d: the audit caught aggregator %s (%s); skipped from now on",
                self.id,
                round_no,
                body["aggregator"],
                body["why"],
            )

    async def check(
        self,
        plan: RoundPlan,
        attempt: int,
        aggregator: str,
        body: dict[str, Any],
        received: State | None,
        own: dict[str, Any] | None,
        superseded: Callable[[], bool] = lambda: False,
    ) -> AuditCheck:
        """The audit of attempt ``attempt`` of ``plan.round`` (docs/design.md, "Auditing
        the aggregator"): the auditor recomputes and announces its verdict; every other
        member checks its own entry of the announcement and waits (bounded) for the
        verdict, or until ``superseded()`` says a later attempt of the round was announced
        (members that moved on do not audit this one: the round fails over to the later
        attempt, ``superseded``)."""
        svc, r = self.services, plan.round
        auditor = self.rotation.auditor(r, attempt)
        if auditor is None:
            return AuditCheck(None, None)
        t0 = time.monotonic()
        record: dict[str, Any] = {"auditor": auditor}
        own_entry = check_own_entry(body, self.id, own)
        if own_entry is not None:
            log.warning("%s: round %d: aggregator %s: %s", self.id, r, aggregator, own_entry)
            record["own_entry"] = own_entry
        if auditor == self.id:
            verdict = await self._recompute_and_announce(plan, attempt, aggregator, body, received)
            record.update(verdict)
        else:
            reach = self.reach
            watch = contextlib.nullcontext() if reach is None else reach.watching(lambda: [auditor])
            async with watch:
                await svc.peers.wait_for(
                    lambda: (
                        (r, attempt) in self.verdicts
                        or superseded()
                        or not waits_on(svc, auditor, r)
                        or (reach is not None and reach.cut_lately(auditor))
                    ),
                    t0 + self.cfg.timing.aggregator_timeout,
                )
            heard = self.verdicts.get((r, attempt))
            if heard is None and superseded():
                return AuditCheck("superseded", None)
            record["verdict"] = heard["verdict"] if heard else None  # None: auditor silent
            if heard and heard["why"]:
                record["why"] = heard["why"]
        record["audit_s"] = round(time.monotonic() - t0, 4)
        caught = record.get("verdict") == "mismatch"
        return AuditCheck(f"audit: {record.get('why', 'mismatch')}" if caught else None, record)

    async def _recompute_and_announce(
        self,
        plan: RoundPlan,
        attempt: int,
        aggregator: str,
        body: dict[str, Any],
        received: State | None,
    ) -> dict[str, Any]:
        """As the auditor: pull every upload the announcement names from its uploader,
        recompute the aggregate, compare, announce the verdict (signed) and keep it."""
        svc, r = self.services, plan.round
        # every aggregated upload (part ``late`` for one counted late), and the aggregator's
        # own (its defence's reference)
        late = body.get("late", {})
        names = sorted({*body["aggregated"], aggregator} - {self.id})
        pulled, _failed = await svc.exchange.pull_many(
            {p: "late" if p in late and p != aggregator else "upload" for p in names},
            r,
            max(1.0, self.cfg.timing.round_timeout_s),
            attempt=attempt,
        )
        mine = self.uploads.late_upload(r) if self.id in late else self.uploads.upload(r)
        if self.id in body["aggregated"] and mine is not None:
            pulled[self.id] = mine
        inputs_of = dict(pulled)  # what each aggregated node counted with
        if aggregator in late and aggregator != self.id:  # its late upload, beside its reference
            extra, _ = await svc.exchange.pull_many(
                {aggregator: "late"},
                r,
                max(1.0, self.cfg.timing.round_timeout_s),
                attempt=attempt,
            )
            inputs_of.pop(aggregator, None)
            inputs_of.update(extra)
        nbytes = sum(svc.exchange.size_of(s) for p, s in pulled.items() if p != self.id)
        nbytes += sum(
            svc.exchange.size_of(s) for p, s in inputs_of.items() if pulled.get(p) is not s
        )
        missing = sorted(set(body["aggregated"]) - set(inputs_of))
        why: str | None
        own_spread = svc.robust.defence.inputs.noise_spread
        spread_why = spread_problem(body.get("noise_spread"), own_spread)
        if missing:
            verdict, why = "incomplete", f"uploads missing: {missing}"
        elif spread_why is not None:
            verdict, why = "mismatch", spread_why
        else:
            inputs = {p: inputs_of[p] for p in body["aggregated"]}
            defence = Defence(self.cfg.defence, self.cfg.rounds)
            try:
                expected = await asyncio.to_thread(
                    recompute_aggregate,
                    self.alg,
                    self.cfg,
                    aggregator,
                    plan,
                    inputs,
                    body,
                    pulled.get(aggregator),
                    defence,
                )
                screening = (screened_uploads(defence, inputs), body)
                why = compare(expected, self.id, received, body["server"], screening)
                verdict = "ok" if why is None else "mismatch"
            except (ValueError, KeyError, TypeError, RuntimeError, ArithmeticError) as exc:
                verdict, why = "incomplete", f"cannot recompute: {exc}"
        message = {"aggregator": aggregator, "verdict": verdict, "why": why or ""}
        self.note(r, attempt, check_verdict(message))
        try:
            await svc.exchange.gossip(r, message, kind="audit", attempt=attempt)
        except TransportError as exc:
            log.warning("%s: round %d: audit verdict not sent: %s", self.id, r, exc)
        out: dict[str, Any] = {"verdict": verdict, "audit_bytes": nbytes}
        if why:
            out["why"] = why
        return out
