"""The aggregator's role under the rotating aggregator (docs/design.md, "Rotating aggregator";
the messages: docs/wire.md, "Rotating aggregator").

The round driver (:class:`~p2pfl.rounds.rotation.centralized.CentralizedRounds`) owns one
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
   the rightful aggregator of the attempt named in the pull; part ``late`` (the upload this
   node offered late to that round) likewise; part ``result`` what this node's result of
   that attempt gives the requester (its own part, or the common part). Each state is
   packed once, however many peers ask.

**Secure aggregation** (``privacy.secagg``): step 2 pulls no upload; the driver's
:class:`~p2pfl.rounds.rotation.secure_round.SecureRounds` runs SecAgg+ with the reporters and hands
back the method's :meth:`~p2pfl.algorithms.base.CentralizedAlgorithm.aggregate_sum` of the
masked sum; part ``masked`` (a member's masked vector) is served to the attempt's
aggregator only.

**Semi-asynchronous rounds** (``timing.quorum`` set; docs/algorithms.md, "Semi-asynchronous
rounds"; the rules: :mod:`p2pfl.rounds.rotation.quorum`): the collection closes at a quorum of the live
expected uploaders or at a deadline adapted from the report latencies recent announcements
carried; a member whose report missed the close offers its upload to a later round as a
``late`` report (``{n, report, late: t}``, ``t`` the round it trained for), and the
aggregator of that round counts it with the weight ``n · (1 + s)^-a``, unless the member's
fresh upload of the round is in (one upload per member and round: the fresh one), or that
upload was counted already (``counted``). With ``quorum`` None none of this runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from p2pfl.algorithms.base import Aggregate, CentralizedAlgorithm, Upload
from p2pfl.learning.state import State
from p2pfl.rounds.rotation.lineage import Lineage, check_lineage
from p2pfl.rounds.rotation.partition import name_result
from p2pfl.rounds.rotation.plans import RoundPlan, draw_plan, live_members, waits_on
from p2pfl.rounds.rotation.quorum import (
    LATENCY_WINDOW,
    close_deadline,
    close_reason,
    median_latency,
    quorum_count,
    staleness_weight,
)
from p2pfl.rounds.rotation.reach import Reachability
from p2pfl.rounds.rotation.secure_round import PART as MASKED
from p2pfl.rounds.rotation.secure_round import SecureRounds
from p2pfl.services.bundle import NodeServices
from p2pfl.wire.envelope import Envelope
from p2pfl.wire.transfers import PreparedState
from p2pfl.wire.transport import TransportError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Aggregated:
    """What one attempt's aggregation counted and produced (the plain pull-and-rule path and
    the secure one alike)."""

    uploads: dict[str, Upload]  # each member counted, with its weight and report
    claims: dict[str, Any]  # each counted member's (capped) claimed sample count
    failed: dict[str, str]  # the uploads that could not be pulled, with why
    counted_late: dict[str, int]  # each late upload counted, with its staleness
    result: Aggregate  # the server rule's result (empty when ``error``)
    error: str | None  # why the server rule failed, None when it ran
    agg_s: float  # seconds the server rule (or the secure sum) took
    t_agg: float  # when it began (``time.monotonic``)


class AggregatorRole:
    """The aggregator's side of a :class:`CentralizedAlgorithm` for one node, and the serving
    of its uploads and results. ``aggregator_of(round, attempt)`` is the driver's answer to
    who aggregates that attempt (None while the round's roster is unknown), and
    ``auditor_of(round, attempt)`` who audits it (None without an audit): an upload is
    served to those two only. ``counted(peer, t)`` says whether ``peer``'s upload of round
    ``t`` was counted already (or cannot be told): such an upload offered late is refused;
    ``max_late`` is the most rounds a late upload may be counted after its own."""

    def __init__(
        self,
        services: NodeServices,
        aggregator_of: Callable[[int, int], str | None],
        auditor_of: Callable[[int, int], str | None] = lambda _r, _a: None,
        counted: Callable[[str, int], bool] = lambda _p, _t: True,
        max_late: int = 0,
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
        # semi-asynchronous rounds (timing.quorum): late offers heard, when each report
        # arrived and each round began here, and the latencies recent announcements carried
        self.counted = counted
        self.max_late = max_late
        self._late_reports: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
        self._late_offer: dict[int, tuple[int, dict[str, Any]]] = {}  # round -> (t, report)
        self._arrived: dict[tuple[int, int], dict[str, float]] = {}
        self._started: dict[int, float] = {}
        self._ready: dict[int, float] = {}  # when this node's own upload of a round was kept
        self.latencies: deque[float] = deque(maxlen=LATENCY_WINDOW)
        # privacy.secagg: the driver's secure aggregation (None: off)
        self.secure: SecureRounds | None = None
        # docs/wire.md, "Partitions": the driver's view of who is reachable (a peer cut off
        # is not waited on) and the lineage this node follows (None: neither, as in tests)
        self.reach: Reachability | None = None
        self.lineage: Lineage | None = None
        self._announcements: dict[tuple[int, int], dict[str, Any]] = {}  # made by this node
        self._reannounced: dict[tuple[int, int], float] = {}
        self._tasks: set[asyncio.Future] = set()

    # ------------------------------------------------------------------ what it holds
    def keep_upload(self, round_no: int, state: State) -> None:
        """This node's upload of round ``round_no``, for its aggregators' pulls."""
        self._uploads[round_no] = state
        self._ready[round_no] = time.monotonic()

    def round_started(self, round_no: int) -> None:
        """This node began round ``round_no`` (its report latencies are measured from now)."""
        self._started.setdefault(round_no, time.monotonic())

    def offer_late(self, round_no: int, trained: int, report: dict[str, Any]) -> None:
        """This node offers its upload of round ``trained`` (its ``report`` message, ``{n,
        report, late}``) to round ``round_no``: served there as part ``late``, and counted by
        this node itself when it aggregates that round without a fresh upload."""
        self._late_offer[round_no] = (trained, report)

    def late_upload(self, round_no: int) -> State | None:
        """The upload this node offered late to round ``round_no`` (None: none)."""
        offer = self._late_offer.get(round_no)
        return None if offer is None else self._uploads.get(offer[0])

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
        key = (env.round, env.attempt)
        if "late" in body:  # an upload of an earlier round, offered late (quorum rounds)
            trained = body["late"]
            if self.cfg.timing.quorum is None:
                self.services.drop("malformed", f"late report from {env.sender}: no quorum")
                return False
            if not isinstance(trained, int) or isinstance(trained, bool):
                self.services.drop("malformed", f"late report from {env.sender}: bad round")
                return False
            if not 1 <= env.round - trained <= self.max_late:
                self.services.drop(
                    "stale_upload", f"late report {trained} for {env.round} from {env.sender}"
                )
                return False
            late = {"n": n, "report": report, "trained": trained}
            self._late_reports.setdefault(key, {})[env.sender] = late
            return True
        kept: dict[str, Any] = {"n": n, "report": report}
        if "lineage" in body:  # docs/wire.md, "Partitions"
            try:
                kept["lineage"] = check_lineage(body["lineage"])
            except ValueError as exc:
                self.services.drop("malformed", f"report from {env.sender}: {exc}")
                return False
        self._reports.setdefault(key, {})[env.sender] = kept
        self._arrived.setdefault(key, {}).setdefault(env.sender, time.monotonic())
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
        for d in (self._late_reports, self._arrived, self._announcements, self._reannounced):
            for key in [k for k in d if k[0] <= floor]:
                del d[key]
        for d2 in (self._late_offer, self._started, self._ready):
            for r in [r for r in d2 if r <= floor]:
                del d2[r]

    # ------------------------------------------------------------------ serving
    async def _prepared_for(self, key: tuple[int, int, str], state: State) -> PreparedState:
        full = (*key, id(state))
        what = "result" if key[2] == "result" else "model"
        async with self._prepare_lock:
            if full not in self._prepared:
                self._prepared[full] = await self.services.prepare(state, key[0], what)
        return self._prepared[full]

    def _stream_of(self, env: Envelope, part: str) -> tuple[tuple[str, ...], Any]:
        """The top-k stream (docs/wire.md, "Compression") a pull of ``part`` is answered
        from, and the tag of the state in it: this node's uploads (``upload`` and ``late``,
        tagged by the round trained for), its common result, or its result for the
        requester ((round, attempt))."""
        if part == "result":
            agg = self._results[(env.round, env.attempt)]
            whose = env.sender if env.sender in agg.results else ""
            return ("result", whose), (env.round, env.attempt)
        if part == "late":
            offer = self._late_offer.get(env.round)
            return ("upload",), (offer[0] if offer is not None else env.round)
        return ("upload",), env.round

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
        elif part == "late":
            if env.sender not in (
                self.aggregator_of(env.round, env.attempt),
                self.auditor_of(env.round, env.attempt),
            ):
                reason = f"not the aggregator or auditor of {env.round}/{env.attempt}"
            else:
                state = self.late_upload(env.round)
                if state is None:
                    reason = f"no late upload offered to round {env.round}"
        elif part == MASKED and self.secure is not None:  # privacy.secagg: A only
            state, reason = self.secure.masked_for(env)
            if state is not None:  # as it is: no attack, no compression (random field)
                await self.services.send_state(env, await self.services.prepare(state))
                return
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
        if self.services.streams is not None:  # top-k: served from a stream (below)
            stream, tag = self._stream_of(env, str(part))
            what = "result" if part == "result" else "model"
            await self.services.serve_stream(env, stream, tag, state, env.round, what)
        else:
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
        ``collect_s``, ``serve_s``, and ``aggregate_error`` when the server rule failed;
        with ``timing.quorum``, ``quorum`` ``{needed, closed_by, deadline_s}``."""
        svc, cfg, r = self.services, self.cfg, plan.round
        t0 = time.monotonic()
        expected = [p for p in plan.participants if p != self.id]
        quorum = cfg.timing.quorum
        log.info("%s: aggregating round %d attempt %d", self.id, r, attempt)
        svc.publish_status(r, "aggregating")
        closing: dict[str, Any] | None = None
        if quorum is None:

            def ready() -> bool:
                got = self._reports.get((r, attempt), {})
                return superseded() or all(p in got or not self._waits(p, r) for p in expected)

            unheard = lambda: [p for p in expected if p not in self._reports.get((r, attempt), {})]  # noqa: E731
            async with self._watching(unheard):
                await svc.wait_for(ready, t0 + cfg.timing.round_timeout_s)
        else:
            closing = await self._collect_quorum(plan, attempt, own, superseded, t0, expected)
        if superseded():
            return None
        got = self._reports.get((r, attempt), {})
        reports = {
            p: rep
            for p, rep in got.items()
            if p in expected and svc.trusted(p, r)  # reputation: a distrusted upload waits
        }
        # quorum rounds: the participants the round closed without, and the late offers it
        # counts instead of dropping (a member's fresh upload of the round replaces its late one)
        closed_without = sorted(p for p in expected if p not in got)
        late = self._late_offers_for(r, attempt, reports, own) if quorum is not None else {}
        template = self._uploads.get(r)
        if template is None:  # it did not train: its current model's part stands in
            template = await asyncio.to_thread(self.alg.upload)
            # the defence's reference, served to the attempt's auditor as its "upload" (it
            # is never counted: only a reported upload is aggregated)
            self._uploads[r] = template
        svc.defence.reference = template
        secagg: dict[str, Any] | None = None
        done: Aggregated | None
        if self.secure is not None:  # privacy.secagg: the masked sum replaces pull + rule
            t_agg = time.monotonic()
            out = await self.secure.aggregate(plan, attempt, reports, own, template, superseded)
            if out is None:
                return None
            counted, summed, error, secagg = out
            claims = {p: u.n for p, u in counted.items()}
            agg_s = time.monotonic() - t_agg
            done = Aggregated(counted, claims, {}, {}, summed, error, agg_s, t_agg)
        else:
            done = await self._aggregate_uploads(
                plan, attempt, reports, late, own, template, superseded
            )
            if done is None:
                return None
        uploads, claims, result = done.uploads, done.claims, done.result
        nxt = draw_plan(self.alg, cfg.seed, r + 1, live_members(svc), result.server)
        roster, participants = nxt.roster, nxt.participants
        self._results[(r, attempt)] = result
        announcement: dict[str, Any] = {
            "roster": roster,
            "participants": sorted(participants),
            "server": result.server,
            "receivers": sorted(result.results),
            "common": result.common is not None,
            "aggregated": sorted(uploads),
            # the weight and report each upload counted with: what an auditor recomputes
            # from, and what each member checks against what it sent (a late upload's
            # weight is its claim discounted by its staleness, ``late``)
            "claims": {p: claims[p] for p in sorted(uploads)},
            "reports": {p: uploads[p].report for p in sorted(uploads)},
        }
        if svc.defence.noise_spread > 0:  # the DP allowance clip measured with: audited
            announcement["noise_spread"] = svc.defence.noise_spread
        if self.reach is not None and self.lineage is not None:  # who may fork it, probed now
            await self.reach.refresh(self.lineage.followers)
        merged = name_result(self.lineage, self.reach, announcement, got, r, attempt, self.id)
        if quorum is not None:
            announcement["late"] = done.counted_late
            announcement["closed_without"] = closed_without
            latency = self._latency(r, attempt, reports, own)
            if latency is not None:
                announcement["report_s"] = latency
        self._announcements[(r, attempt)] = announcement
        await self._gossip_announcement(r, attempt)
        # stay in the round until every member that needs the result has it (bounded), so
        # the bytes it costs are counted in this round's record; a quorum round does not
        # wait for the members it closed without (they pull when their training is done)
        pullers = {
            n
            for n in set(roster) | set(uploads)
            if n != self.id
            and n not in (closed_without if quorum is not None else ())
            and (n in result.results or result.common is not None)
            and self.alg.needs_result(n in uploads, n in participants, r >= cfg.rounds)
        }
        t_serve = time.monotonic()
        unserved = lambda: [n for n in pullers if n not in self._served.get((r, attempt), ())]  # noqa: E731
        async with self._watching(unserved):
            await svc.wait_for(
                lambda: all(not self._waits(n, r) for n in unserved()),
                t_serve + cfg.timing.round_timeout_s,
            )
        facts: dict[str, Any] = {
            "aggregated": sorted(uploads),
            "upload_failed": done.failed,
            "aggregate_s": round(done.agg_s, 4),
            "collect_s": round(done.t_agg - t0, 4),
            "serve_s": round(time.monotonic() - t_serve, 4),
        }
        if merged:
            facts["lineage_merged"] = merged
        if closing is not None:
            facts["quorum"] = closing
        if secagg is not None:
            facts["secagg"] = secagg
        if done.error is not None:
            facts["aggregate_error"] = done.error
        rule = result.facts if isinstance(result.facts, dict) else {}
        server_facts = {f"agg_{k}": v for k, v in rule.items()}
        return announcement, result.results.get(self.id, result.common), facts, server_facts

    # ------------------------------------------------------------------ partitions
    async def _gossip_announcement(self, round_no: int, attempt: int) -> None:
        try:
            await self.services.transport.gossip(
                round_no, self._announcements[(round_no, attempt)], kind="announce", attempt=attempt
            )
        except TransportError as exc:
            log.warning("%s: round %d: announcement not sent: %s", self.id, round_no, exc)

    def late_report(self, round_no: int, attempt: int) -> None:
        """A member reported to ``(round_no, attempt)`` after this node announced it: it
        missed the announcement (it was cut off then: docs/wire.md, "Partitions"), so the
        announcement goes out again (once a second at most)."""
        key = (round_no, attempt)
        now = time.monotonic()
        if key not in self._announcements or now - self._reannounced.get(key, -1e9) < 1.0:
            return
        self._reannounced[key] = now
        log.info("%s: round %d: a late report; announcing attempt %d again", self.id, *key)
        task = asyncio.ensure_future(self._gossip_announcement(round_no, attempt))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _waits(self, peer: str, round_no: int) -> bool:
        """Whether a wait of round ``round_no`` goes on waiting for ``peer``: it is in step
        (:func:`waits_on`) and not cut off (docs/wire.md, "Partitions")."""
        if not waits_on(self.services, peer, round_no):
            return False
        return self.reach is None or self.reach.cut_off(peer) is None

    async def _cut_off(self, peers: dict[str, str]) -> dict[str, str]:
        """The peers of ``peers`` cut off now (after a fresh probe), with why."""
        if self.reach is None:
            return {}
        await self.reach.refresh(peers)
        verdicts = {p: self.reach.cut_off(p) for p in peers}
        return {p: why for p, why in verdicts.items() if why is not None}

    def _watching(self, peers: Callable[[], list[str]]) -> Any:
        """While a wait is on, re-probe the peers it waits on (nothing without a view)."""
        return contextlib.nullcontext() if self.reach is None else self.reach.watching(peers)

    async def _aggregate_uploads(
        self,
        plan: RoundPlan,
        attempt: int,
        reports: dict[str, dict[str, Any]],
        late: dict[str, dict[str, Any]],
        own: dict[str, Any] | None,
        template: State,
        superseded: Callable[[], bool],
    ) -> Aggregated | None:
        """Pull the reported (and late) uploads, admit them, and run the method's server
        rule; None as soon as ``superseded()``."""
        svc, cfg, r = self.services, self.cfg, plan.round
        timeout = max(1.0, cfg.timing.round_timeout_s)
        parts = {p: "upload" for p in reports}
        parts.update({p: "late" for p in late if p != self.id})
        cut = await self._cut_off(parts)  # a pull across a cut would wait out its timeout
        parts = {p: part for p, part in parts.items() if p not in cut}
        pulled, failed = await svc.pull_many(
            parts,
            r,
            timeout,
            attempt=attempt,
            reference=lambda _part: template,  # admission: layout, finite, norm
        )
        failed.update(cut)
        claims = svc.cap_claims({p: (reports.get(p) or late[p])["n"] for p in pulled})
        staleness = {p: r - late[p]["trained"] for p in late}
        a = cfg.timing.staleness_exponent
        uploads: dict[str, Upload] = {}
        for peer, res in sorted(pulled.items()):
            rep = reports.get(peer) or late[peer]
            weight = staleness_weight(claims[peer], staleness.get(peer, 0), a)
            uploads[peer] = Upload(weight, res, rep["report"])
        if own is not None and r in self._uploads:
            uploads[self.id] = Upload(own["n"], self._uploads[r], own["report"])
            claims[self.id] = own["n"]
        elif self.id in late and (mine := self.late_upload(r)) is not None:
            n_own = late[self.id]["n"]
            uploads[self.id] = Upload(
                staleness_weight(n_own, staleness[self.id], a), mine, late[self.id]["report"]
            )
            claims[self.id] = n_own
        counted_late = {p: staleness[p] for p in uploads if p in staleness}
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
        return Aggregated(uploads, claims, failed, counted_late, result, error, agg_s, t_agg)

    # ------------------------------------------------------------------ quorum rounds
    async def _collect_quorum(
        self,
        plan: RoundPlan,
        attempt: int,
        own: dict[str, Any] | None,
        superseded: Callable[[], bool],
        t0: float,
        expected: list[str],
    ) -> dict[str, Any]:
        """Wait until :func:`~p2pfl.rounds.rotation.quorum.close_reason` closes attempt ``attempt``:
        every live expected uploader reported, or ``ceil(quorum · live)`` of them (this node
        counts when it trained), or the deadline adapted from :attr:`latencies`, measured
        from this node's start of the round, passed (never later than ``round_timeout_s``
        after the collection began). Returns ``{needed, closed_by, deadline_s}``."""
        svc, cfg, r = self.services, self.cfg, plan.round
        quorum = float(cfg.timing.quorum or 1.0)
        deadline_s = close_deadline(list(self.latencies), cfg.timing.round_timeout_s)
        start = self._started.get(r, t0)
        close_at = min(start + deadline_s, t0 + cfg.timing.round_timeout_s)
        mine = [self.id] if own is not None and r in self._uploads else []

        def reason() -> tuple[str | None, int]:
            got = self._reports.get((r, attempt), {})
            live = [*mine, *(p for p in expected if waits_on(svc, p, r))]
            reported = {*mine, *(p for p in expected if p in got)}
            why = close_reason(live, reported, quorum, time.monotonic(), close_at)
            return why, quorum_count(quorum, len(live))

        await svc.wait_for(lambda: superseded() or reason()[0] is not None, close_at)
        why, needed = reason()
        return {
            "needed": needed,
            "closed_by": why or "deadline",
            "deadline_s": round(deadline_s, 4),
        }

    def _late_offers_for(
        self, r: int, attempt: int, reports: dict[str, Any], own: dict[str, Any] | None
    ) -> dict[str, dict[str, Any]]:
        """The late offers attempt ``attempt`` of round ``r`` counts: from members whose
        fresh upload of the round is not in, trusted, whose offered upload was not counted
        already; this node's own offer when it has no fresh upload of the round."""
        out: dict[str, dict[str, Any]] = {}
        for peer, late in sorted(self._late_reports.get((r, attempt), {}).items()):
            if peer in reports or peer == self.id or not self.services.trusted(peer, r):
                continue
            if self.counted(peer, late["trained"]):
                self.services.drop("stale_upload", f"late {late['trained']} from {peer}: counted")
                continue
            out[peer] = late
        offer = self._late_offer.get(r)
        if (own is None or r not in self._uploads) and offer is not None:
            trained, report = offer
            if trained in self._uploads and not self.counted(self.id, trained):
                out[self.id] = {"n": report["n"], "report": report["report"], "trained": trained}
        return out

    def _latency(
        self, r: int, attempt: int, reports: dict[str, Any], own: dict[str, Any] | None
    ) -> float | None:
        """The median latency of the round's counted fresh reports (and of this node's own
        upload), each from this node's start of the round to its arrival, in seconds."""
        start = self._started.get(r)
        if start is None:
            return None
        arrived = self._arrived.get((r, attempt), {})
        times = [arrived[p] for p in reports if p in arrived]
        if own is not None and r in self._ready:
            times.append(self._ready[r])
        return median_latency([max(0.0, t - start) for t in times])
