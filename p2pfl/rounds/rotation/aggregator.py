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
rounds"; the rules: :mod:`p2pfl.rounds.rotation.quorum`, applied by :mod:`p2pfl.rounds.rotation.quorum_close`):
the collection closes at a quorum of the live expected uploaders or at a deadline adapted
from the report latencies recent announcements carried; a member whose report missed the
close offers its upload to a later round as a ``late`` report (``{n, report, late: t}``,
``t`` the round it trained for), and the aggregator of that round counts it with the weight
``n · (1 + s)^-a``, unless the member's fresh upload of the round is in (one upload per
member and round: the fresh one), or that upload was counted already (``counted``). With
``quorum`` None none of this runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from p2pfl.algorithms.base import Aggregate, Upload
from p2pfl.learning.state import State
from p2pfl.rounds.rotation.audit import screened_uploads
from p2pfl.rounds.rotation.hearing import Hearing
from p2pfl.rounds.rotation.late import LateOffers
from p2pfl.rounds.rotation.lineage import Lineage, check_lineage
from p2pfl.rounds.rotation.partition import abandon_when_cut, name_result
from p2pfl.rounds.rotation.plans import RoundPlan, draw_plan, live_members, waits_on
from p2pfl.rounds.rotation.quorum import staleness_weight
from p2pfl.rounds.rotation.quorum_close import Closing, QuorumClose
from p2pfl.rounds.rotation.reach import Reachability
from p2pfl.rounds.rotation.role import RotationRole
from p2pfl.rounds.rotation.roster import on_the_wire
from p2pfl.rounds.rotation.rotation import Rotation
from p2pfl.rounds.rotation.secure_round import PART as MASKED
from p2pfl.rounds.rotation.secure_round import SecureRounds
from p2pfl.services.bundle import NodeServices
from p2pfl.services.exchange import PreparedState
from p2pfl.wire.envelope import Envelope
from p2pfl.wire.errors import TransportError

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


@dataclass(frozen=True)
class AggregatorFacts:
    """The aggregator's facts of the attempt it announced, for its round's record."""

    upload_failed: dict[str, str]  # the uploads that could not be pulled, with why
    aggregate_s: float
    collect_s: float
    serve_s: float
    lineage_merged: list[str]  # the other lineages the result merged (docs/wire.md, "Partitions")
    quorum: Closing | None  # how the collection closed (quorum rounds)
    secagg: dict[str, Any] | None  # the secure sum's facts (privacy.secagg)
    error: str | None  # why the server rule failed

    def record(self) -> dict[str, Any]:
        """The record's fields: ``upload_failed``, ``aggregate_s``, ``collect_s``,
        ``serve_s``, and as far as they apply ``lineage_merged``, ``quorum``, ``secagg`` and
        ``aggregate_error`` (``aggregated`` is the announcement's, as every member's)."""
        out: dict[str, Any] = {
            "upload_failed": self.upload_failed,
            "aggregate_s": self.aggregate_s,
            "collect_s": self.collect_s,
            "serve_s": self.serve_s,
        }
        if self.lineage_merged:
            out["lineage_merged"] = self.lineage_merged
        if self.quorum is not None:
            out["quorum"] = self.quorum.record()
        if self.secagg is not None:
            out["secagg"] = self.secagg
        if self.error is not None:
            out["aggregate_error"] = self.error
        return out


@dataclass(frozen=True)
class Announced:
    """An attempt this node aggregated and announced: the announcement, what this node
    receives of its result, its facts, and the method's server-rule facts (each prefixed
    ``agg_``)."""

    announcement: dict[str, Any]
    received: State | None
    facts: AggregatorFacts
    server_facts: dict[str, Any]


class AggregatorRole(RotationRole):
    """The aggregator's side of a :class:`CentralizedAlgorithm` for one node, and the serving
    of its uploads and results. ``rotation`` says who aggregates and who audits an attempt:
    an upload is served to those two only. ``late``: the node's late offers, which tell
    quorum rounds (:class:`~p2pfl.rounds.rotation.quorum_close.QuorumClose`) which uploads were counted
    already (None: none can be told). ``secure``: the node's secure
    aggregation (privacy.secagg; None: off); ``reach`` and ``lineage``: its view of who is
    reachable (a peer cut off is not waited on) and the lineage it follows (docs/wire.md,
    "Partitions"; None: neither, as in tests)."""

    def __init__(
        self,
        services: NodeServices,
        rotation: Rotation,
        late: LateOffers | None = None,
        secure: SecureRounds | None = None,
        reach: Reachability | None = None,
        lineage: Lineage | None = None,
        hearing: Hearing | None = None,
    ) -> None:
        super().__init__(services)
        self.hearing = hearing  # whose presence it hears (every member's to draw a roster)
        self.rotation = rotation
        self._reports: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
        self._uploads: OrderedDict[int, State] = OrderedDict()
        self._results: OrderedDict[tuple[int, int], Aggregate] = OrderedDict()
        self._prepared: dict[tuple[int, int, str, int], PreparedState] = {}
        self._served: dict[tuple[int, int], set[str]] = {}  # who pulled each result
        self._prepare_lock = asyncio.Lock()
        self.quorum = QuorumClose(services, late)  # timing.quorum
        self.secure = secure
        self.reach = reach
        self.lineage = lineage
        self._announcements: dict[tuple[int, int], dict[str, Any]] = {}  # made by this node
        self._bases: dict[tuple[int, int], list[str]] = {}  # the roster each one changes
        self._reannounced: dict[tuple[int, int], float] = {}
        # the announcements late reports asked for again, sent by :meth:`reannounce`
        self._again: asyncio.Queue[tuple[int, int]] = asyncio.Queue()

    # ------------------------------------------------------------------ what it holds
    def keep_upload(self, round_no: int, state: State) -> None:
        """This node's upload of round ``round_no``, for its aggregators' pulls."""
        self._uploads[round_no] = state
        self.quorum.upload_kept(round_no)

    def round_started(self, round_no: int) -> None:
        """This node began round ``round_no`` (its report latencies are measured from now)."""
        self.quorum.round_started(round_no)

    def offer_late(self, round_no: int, trained: int, report: dict[str, Any]) -> None:
        """This node offers its upload of round ``trained`` (its ``report`` message, ``{n,
        report, late}``) to round ``round_no``: served there as part ``late``, and counted by
        this node itself when it aggregates that round without a fresh upload."""
        self.quorum.offer_late(round_no, trained, report)

    def late_upload(self, round_no: int) -> State | None:
        """The upload this node offered late to round ``round_no`` (None: none)."""
        trained = self.quorum.offered(round_no)
        return None if trained is None else self._uploads.get(trained)

    def upload(self, round_no: int) -> State | None:
        """This node's upload of round ``round_no`` (None when it did not train)."""
        return self._uploads.get(round_no)

    def collect(self, env: Envelope) -> bool:
        """Keep the ``report`` in ``env`` (the driver checked its round, attempt and
        addressee); drop it as ``malformed`` and return False when its body is not one."""
        body = env.body
        n = body.get("n") if isinstance(body, dict) else None
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            self.services.ledger.drop("malformed", f"report from {env.sender}: bad sample count")
            return False
        try:
            report = self.alg.check_report(body.get("report", {}))
        except ValueError as exc:
            self.services.ledger.drop("malformed", f"report from {env.sender}: {exc}")
            return False
        key = (env.round, env.attempt)
        if "late" in body:  # an upload of an earlier round, offered late (quorum rounds)
            return self.quorum.keep_late(env, n, report)
        kept: dict[str, Any] = {"n": n, "report": report}
        if "lineage" in body:  # docs/wire.md, "Partitions"
            try:
                kept["lineage"] = check_lineage(body["lineage"])
            except ValueError as exc:
                self.services.ledger.drop("malformed", f"report from {env.sender}: {exc}")
                return False
        self._reports.setdefault(key, {})[env.sender] = kept
        self.quorum.arrived_now(key, env.sender)
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
        for d in (self._announcements, self._reannounced, self._bases):
            for key in [k for k in d if k[0] <= floor]:
                del d[key]
        self.quorum.forget(floor)

    # ------------------------------------------------------------------ serving
    async def _prepared_for(self, key: tuple[int, int, str], state: State) -> PreparedState:
        full = (*key, id(state))
        what = "result" if key[2] == "result" else "model"
        async with self._prepare_lock:
            if full not in self._prepared:
                self._prepared[full] = await self.services.exchange.prepare(state, key[0], what)
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
            trained = self.quorum.offered(env.round)
            return ("upload",), (trained if trained is not None else env.round)
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
                self.rotation.aggregator(env.round, env.attempt),
                self.rotation.auditor(env.round, env.attempt),
            ):
                reason = f"not the aggregator or auditor of {env.round}/{env.attempt}"
            elif env.round not in self._uploads:
                reason = f"no upload for round {env.round}"
            else:
                state = self._uploads[env.round]
        elif part == "late":
            if env.sender not in (
                self.rotation.aggregator(env.round, env.attempt),
                self.rotation.auditor(env.round, env.attempt),
            ):
                reason = f"not the aggregator or auditor of {env.round}/{env.attempt}"
            else:
                state = self.late_upload(env.round)
                if state is None:
                    reason = f"no late upload offered to round {env.round}"
        elif part == MASKED and self.secure is not None:  # privacy.secagg: A only
            state, reason = self.secure.masked_for(env)
            if state is not None:  # as it is: no attack, no compression (random field)
                await self.services.exchange.send_state(
                    env, await self.services.exchange.prepare(state)
                )
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
            await self.services.exchange.refuse_pull(env, reason or "nothing for this node")
            return
        if self.services.exchange.streams is not None:  # top-k: served from a stream (below)
            stream, tag = self._stream_of(env, str(part))
            what = "result" if part == "result" else "model"
            await self.services.exchange.serve_stream(env, stream, tag, state, env.round, what)
        else:
            prepared = await self._prepared_for((env.round, env.attempt, str(part)), state)
            await self.services.exchange.send_state(env, prepared)
        if part == "result":
            self._served.setdefault((env.round, env.attempt), set()).add(env.sender)
            self.services.peers.notify()

    # ------------------------------------------------------------------ one attempt
    async def aggregate(
        self,
        plan: RoundPlan,
        attempt: int,
        own: dict[str, Any] | None,
        superseded: Callable[[], bool],
    ) -> Announced | None:
        """Run attempt ``attempt`` of round ``plan.round`` as its aggregator, with ``own``
        this node's report (None when it did not train); None as soon as ``superseded()``
        says a later attempt of the round was announced meanwhile (this one is dead: its
        result is never announced)."""
        svc, cfg, r = self.services, self.cfg, plan.round
        t0 = time.monotonic()
        expected = [p for p in plan.participants if p != self.id]
        quorum = cfg.timing.quorum
        log.info("%s: aggregating round %d attempt %d", self.id, r, attempt)
        svc.ledger.publish_status(r, "aggregating")
        closing: Closing | None = None
        if quorum is None:

            def ready() -> bool:
                got = self._reports.get((r, attempt), {})
                return superseded() or all(p in got or not self._waits(p, r) for p in expected)

            unheard = lambda: [p for p in expected if p not in self._reports.get((r, attempt), {})]  # noqa: E731
            async with self._watching(unheard):
                await svc.peers.wait_for(ready, t0 + cfg.timing.round_timeout_s)
        else:
            closing = await self.quorum.close(
                plan,
                attempt,
                own is not None and r in self._uploads,
                superseded,
                t0,
                expected,
                lambda: self._reports.get((r, attempt), {}),
            )
        if superseded():
            return None
        got = self._reports.get((r, attempt), {})
        reports = {
            p: rep
            for p, rep in got.items()
            if p in expected and svc.robust.trusted(p, r)  # reputation: a distrusted upload waits
        }
        # quorum rounds: the participants the round closed without, and the late offers it
        # counts instead of dropping (a member's fresh upload of the round replaces its late one)
        closed_without = sorted(p for p in expected if p not in got)
        late = (
            self.quorum.late_offers_for(
                r, attempt, reports, own is not None and r in self._uploads, self._uploads
            )
            if quorum is not None
            else {}
        )
        template = self._uploads.get(r)
        if template is None:  # it did not train: its current model's part stands in
            template = await asyncio.to_thread(self.alg.upload)
            # the defence's reference, served to the attempt's auditor as its "upload" (it
            # is never counted: only a reported upload is aggregated)
            self._uploads[r] = template
        inputs = svc.robust.measure_with(reference=template)
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
        if self.hearing is not None:  # the next roster is drawn from a live view of all
            await self.hearing.hear_all()
        nxt = draw_plan(self.alg, cfg.seed, r + 1, live_members(svc), result.server)
        if self.hearing is not None:  # and only then: the members' reports need not reach it
            await self.hearing.hear(self.hearing.of(plan, attempt))
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
            **screened_uploads(svc.robust.defence, uploads),  # refused, clipped: audited
        }
        if inputs.noise_spread > 0:  # the DP allowance clip measured with: audited
            announcement["noise_spread"] = inputs.noise_spread
        if self.reach is not None and self.lineage is not None:  # who may fork it, probed now
            await self.reach.refresh(self.lineage.followers)
        merged = name_result(self.lineage, self.reach, announcement, got, r, attempt, self.id)
        if quorum is not None:
            announcement["late"] = done.counted_late
            announcement["closed_without"] = closed_without
            latency = self.quorum.latency(r, attempt, reports, own)
            if latency is not None:
                announcement["report_s"] = latency
        self._announcements[(r, attempt)] = announcement
        self._bases[(r, attempt)] = plan.roster
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
            await svc.peers.wait_for(
                lambda: all(not self._waits(n, r) for n in unserved()),
                t_serve + cfg.timing.round_timeout_s,
            )
        facts = AggregatorFacts(
            upload_failed=done.failed,
            aggregate_s=round(done.agg_s, 4),
            collect_s=round(done.t_agg - t0, 4),
            serve_s=round(time.monotonic() - t_serve, 4),
            lineage_merged=merged,
            quorum=closing,
            secagg=secagg,
            error=done.error,
        )
        rule = result.facts if isinstance(result.facts, dict) else {}
        server_facts = {f"agg_{k}": v for k, v in rule.items()}
        return Announced(
            announcement, result.results.get(self.id, result.common), facts, server_facts
        )

    # ------------------------------------------------------------------ partitions
    def announced(self, round_no: int, attempt: int) -> dict[str, Any] | None:
        """This node's announcement of ``(round_no, attempt)``, its roster whole (None: none)."""
        return self._announcements.get((round_no, attempt))

    async def _gossip_announcement(self, round_no: int, attempt: int) -> None:
        """Announce ``(round_no, attempt)``: the next roster by difference against the
        round's (:func:`~p2pfl.rounds.rotation.roster.on_the_wire`)."""
        key = (round_no, attempt)  # a protocol 3 peer heard: whole, as it reads it
        base = self._bases.get(key) if self.services.exchange.speaks_4 else None
        body = on_the_wire(self._announcements[key], base, self.services.cfg.node_ids)
        try:
            await self.services.exchange.gossip(round_no, body, kind="announce", attempt=attempt)
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
        self._again.put_nowait(key)

    async def reannounce(self) -> None:
        """Announce again each attempt :meth:`late_report` asked for, in turn, for as long
        as it runs (the driver holds it for its rounds: :func:`~p2pfl.background.background`)."""
        while True:
            key = await self._again.get()
            if key in self._announcements:  # not forgotten meanwhile
                await self._gossip_announcement(*key)

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
        running = set(parts)  # the pulls still under way, watched while they run
        async with self._watching(lambda: sorted(running)):
            pulled, failed = await svc.exchange.pull_many(
                parts,
                r,
                timeout,
                attempt=attempt,
                reference=lambda _part: template,  # admission: layout, finite, norm
                abandon=None if self.reach is None else abandon_when_cut(svc, self.reach, running),
            )
        failed.update(cut)
        claims = svc.robust.cap_claims({p: (reports.get(p) or late[p])["n"] for p in pulled})
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
