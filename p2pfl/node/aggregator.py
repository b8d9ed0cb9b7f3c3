"""The aggregator's role under the rotating aggregator (docs/design.md, "Rotating aggregator";
the messages: docs/wire.md, "Rotating aggregator").

The round driver (:class:`~p2pfl.node.centralized.CentralizedRounds`) owns one
:class:`AggregatorRole` and decides when this node is the aggregator of an attempt; the
role does the work of that attempt and serves what this node holds for its peers:

1. **collect**: each ``report`` addressed to this node is checked (a positive sample count,
   the method's :meth:`~p2pfl.algorithms.base.CentralizedAlgorithm.check_report`) and kept
   by ``(round, attempt)``;
2. **aggregate** attempt ``a`` of round ``r``: wait (``round_timeout_s`` at most) for the
   participants' reports, pull their uploads (admission: layout, finite, norm; claimed
   sample counts capped; a distrusted peer's upload waits), run the pure server rule
   (:meth:`~p2pfl.algorithms.base.CentralizedAlgorithm.aggregate`), draw the next plan from
   live presence and announce ``(r, a)`` on this node's gossip topic; then stay in the
   round until every member that needs the result has pulled it (bounded), so the bytes
   it costs count in this round's record. The attempt is abandoned as soon as the driver
   says a later one was announced;
3. **serve**: part ``upload`` (this node's own upload of a round, kept by the driver) only to
   the rightful aggregator of the attempt named in the pull; part ``result`` what this
   node's result of that attempt gives the requester (its own part, or the common part).
   Each state is packed once, however many peers ask.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from p2pfl.algorithms.base import Aggregate, CentralizedAlgorithm, Upload
from p2pfl.learning.state import State
from p2pfl.node.plans import RoundPlan, draw_plan, live_members, waits_on
from p2pfl.node.services import NodeServices
from p2pfl.wire.envelope import Envelope
from p2pfl.wire.transfers import PreparedState
from p2pfl.wire.transport import TransportError

log = logging.getLogger(__name__)


class AggregatorRole:
    """The aggregator's side of a :class:`CentralizedAlgorithm` for one node, and the serving
    of its uploads and results. ``aggregator_of(round, attempt)`` is the driver's answer to
    who aggregates that attempt (None while the round's roster is unknown), and
    ``auditor_of(round, attempt)`` who audits it (None without an audit): an upload is
    served to those two only."""

    def __init__(
        self,
        services: NodeServices,
        aggregator_of: Callable[[int, int], str | None],
        auditor_of: Callable[[int, int], str | None] = lambda _r, _a: None,
    ) -> None:
        assert isinstance(services.method, CentralizedAlgorithm)
        self.services = services
        self.alg: CentralizedAlgorithm = services.method
        self.id = services.id
        self.cfg = services.cfg
        self.members = set(services.cfg.node_ids)
        self.aggregator_of = aggregator_of
        self.auditor_of = auditor_of  # who may also pull uploads (None: no audit)
        self._reports: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
        self._uploads: OrderedDict[int, State] = OrderedDict()
        self._results: OrderedDict[tuple[int, int], Aggregate] = OrderedDict()
        self._prepared: dict[tuple[int, int, str, int], PreparedState] = {}
        self._served: dict[tuple[int, int], set[str]] = {}  # who pulled each result
        self._prepare_lock = asyncio.Lock()

    # ------------------------------------------------------------------ what it holds
    def keep_upload(self, round_no: int, state: State) -> None:
        """This node's upload of round ``round_no``, for its aggregators' pulls."""
        self._uploads[round_no] = state

    def upload(self, round_no: int) -> State | None:
        """This node's upload of round ``round_no`` (None when it did not train)."""
        return self._uploads.get(round_no)

    def collect(self, env: Envelope) -> bool:
        """Keep the ``report`` in ``env`` (the driver checked its round, attempt and
        addressee); drop it as ``malformed`` and return False when its body is not one."""
        body = env.body
        n = body.get("n") if isinstance(body, dict) else None
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            self.services.drop("malformed", f"report from {env.sender}: bad sample count")
            return False
        try:
            report = self.alg.check_report(body.get("report", {}))
        except ValueError as exc:
            self.services.drop("malformed", f"report from {env.sender}: {exc}")
            return False
        self._reports.setdefault((env.round, env.attempt), {})[env.sender] = {
            "n": n,
            "report": report,
        }
        return True

    def forget(self, floor: int) -> None:
        """Drop the uploads, reports and results of round ``floor`` and before."""
        for d in (self._uploads,):
            for r in [r for r in d if r <= floor]:
                del d[r]
        for key in [k for k in self._results if k[0] <= floor]:
            del self._results[key]
        for key in [k for k in self._prepared if k[0] <= floor]:
            del self._prepared[key]
        for key in [k for k in self._reports if k[0] <= floor]:
            del self._reports[key]
        for key in [k for k in self._served if k[0] <= floor]:
            del self._served[key]

    # ------------------------------------------------------------------ serving
    async def _prepared_for(self, key: tuple[int, int, str], state: State) -> PreparedState:
        full = (*key, id(state))
        what = "result" if key[2] == "result" else "model"
        async with self._prepare_lock:
            if full not in self._prepared:
                self._prepared[full] = await self.services.prepare(state, key[0], what)
        return self._prepared[full]

    async def serve_pull(self, env: Envelope) -> None:
        """``upload``: only to the rightful aggregator of the attempt named; ``result``: what
        this aggregator's result gives the requester (its own part, or the common part)."""
        body = env.body if isinstance(env.body, dict) else {}
        part, reason, state = body.get("part"), None, None
        if env.sender not in self.members:
            reason = "not a member"
        elif part == "upload":
            if env.sender not in (
                self.aggregator_of(env.round, env.attempt),
                self.auditor_of(env.round, env.attempt),
            ):
                reason = f"not the aggregator or auditor of {env.round}/{env.attempt}"
            elif env.round not in self._uploads:
                reason = f"no upload for round {env.round}"
            else:
                state = self._uploads[env.round]
        elif part == "result":
            agg = self._results.get((env.round, env.attempt))
            if agg is None:
                reason = f"no result for {env.round}/{env.attempt}"
            else:
                state = agg.results.get(env.sender, agg.common)
                if state is None:
                    reason = "nothing for this node"
        else:
            reason = f"unknown part {part!r}"
        if reason is not None or state is None:
            await self.services.refuse_pull(env, reason or "nothing for this node")
            return
        prepared = await self._prepared_for((env.round, env.attempt, str(part)), state)
        await self.services.send_state(env, prepared)
        if part == "result":
            self._served.setdefault((env.round, env.attempt), set()).add(env.sender)
            self.services.notify()

    # ------------------------------------------------------------------ one attempt
    async def aggregate(
        self,
        plan: RoundPlan,
        attempt: int,
        own: dict[str, Any] | None,
        superseded: Callable[[], bool],
    ) -> tuple[dict[str, Any], State | None, dict[str, Any], dict[str, Any]] | None:
        """Run attempt ``attempt`` of round ``plan.round`` as its aggregator, with ``own``
        this node's report (None when it did not train); return (announcement, what this
        node receives, the aggregator's facts, the method's server-rule facts, each
        prefixed ``agg_``) or None as soon as ``superseded()`` says a later attempt of the
        round was announced meanwhile (this one is dead: its result is never announced).
        The aggregator's facts: ``aggregated``, ``upload_failed``, ``aggregate_s``,
        ``collect_s``, ``serve_s``, and ``aggregate_error`` when the server rule failed."""
        svc, cfg, r = self.services, self.cfg, plan.round
        t0 = time.monotonic()
        expected = [p for p in plan.participants if p != self.id]
        log.info("%s: aggregating round %d attempt %d", self.id, r, attempt)
        svc.publish_status(r, "aggregating")

        def ready() -> bool:
            got = self._reports.get((r, attempt), {})
            return superseded() or all(p in got or not waits_on(svc, p, r) for p in expected)

        await svc.wait_for(ready, t0 + cfg.timing.round_timeout_s)
        if superseded():
            return None
        reports = {
            p: rep
            for p, rep in self._reports.get((r, attempt), {}).items()
            if p in expected and svc.trusted(p, r)  # reputation: a distrusted upload waits
        }
        template = self._uploads.get(r)
        if template is None:  # it did not train: its current model's part stands in
            template = await asyncio.to_thread(self.alg.upload)
            # the defence's reference, served to the attempt's auditor as its "upload" (it
            # is never counted: only a reported upload is aggregated)
            self._uploads[r] = template
        svc.defence.reference = template
        timeout = max(1.0, cfg.timing.round_timeout_s)
        pulled, failed = await svc.pull_many(
            {p: "upload" for p in reports},
            r,
            timeout,
            attempt=attempt,
            reference=lambda _part: template,  # admission: layout, finite, norm
        )
        claims = svc.cap_claims({p: reports[p]["n"] for p in pulled})
        uploads: dict[str, Upload] = {}
        for peer, res in sorted(pulled.items()):
            uploads[peer] = Upload(claims[peer], res, reports[peer]["report"])
        if own is not None and r in self._uploads:
            uploads[self.id] = Upload(own["n"], self._uploads[r], own["report"])
        if superseded():
            return None
        t_agg = time.monotonic()
        # nobody uploaded (``aggregated`` is empty): nothing changes, the plan goes on
        result = Aggregate(results={}, common=None, server=plan.server)
        error: str | None = None
        if uploads:
            try:
                result = await asyncio.to_thread(
                    self.alg.aggregate, uploads, plan.server, plan.roster, r
                )
            except (ValueError, ArithmeticError, RuntimeError) as exc:
                log.error("%s: round %d: server rule failed: %s", self.id, r, exc)
                result = Aggregate({}, None, server=plan.server)
                error = str(exc)
        agg_s = time.monotonic() - t_agg
        if superseded():
            return None
        nxt = draw_plan(self.alg, cfg.seed, r + 1, live_members(svc), result.server)
        roster, participants = nxt.roster, nxt.participants
        self._results[(r, attempt)] = result
        announcement = {
            "roster": roster,
            "participants": sorted(participants),
            "server": result.server,
            "receivers": sorted(result.results),
            "common": result.common is not None,
            "aggregated": sorted(uploads),
            # the weight and report each upload counted with: what an auditor recomputes
            # from, and what each member checks against what it sent
            "claims": {p: uploads[p].n for p in sorted(uploads)},
            "reports": {p: uploads[p].report for p in sorted(uploads)},
        }
        try:
            await svc.transport.gossip(r, announcement, kind="announce", attempt=attempt)
        except TransportError as exc:
            log.warning("%s: round %d: announcement not sent: %s", self.id, r, exc)
        # stay in the round until every member that needs the result has it (bounded), so
        # the bytes it costs are counted in this round's record
        pullers = {
            n
            for n in set(roster) | set(uploads)
            if n != self.id
            and (n in result.results or result.common is not None)
            and self.alg.needs_result(n in uploads, n in participants, r >= cfg.rounds)
        }
        t_serve = time.monotonic()
        await svc.wait_for(
            lambda: all(
                n in self._served.get((r, attempt), ()) or not waits_on(svc, n, r) for n in pullers
            ),
            t_serve + cfg.timing.round_timeout_s,
        )
        facts: dict[str, Any] = {
            "aggregated": sorted(uploads),
            "upload_failed": failed,
            "aggregate_s": round(agg_s, 4),
            "collect_s": round(t_agg - t0, 4),
            "serve_s": round(time.monotonic() - t_serve, 4),
        }
        if error is not None:
            facts["aggregate_error"] = error
        rule = result.facts if isinstance(result.facts, dict) else {}
        server_facts = {f"agg_{k}": v for k, v in rule.items()}
        return announcement, result.results.get(self.id, result.common), facts, server_facts
