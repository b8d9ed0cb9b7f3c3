"""Round driver for centralized methods on a rotating aggregator peer (docs/design.md,
"Rotating aggregator"; the messages: docs/wire.md, "Rotating aggregator").

There is no server. Every node of the topology is a member (edges are not used by these
methods). Round ``r`` runs on a **plan** every member got from the same message: the
*roster* (the members of the round), the *participants* (who trains and uploads) and the
method's small *server state*. The plan of round 1 is computed alike by every node from
the members present after the startup barrier; the plan of round ``r + 1`` travels in the
announcement of round ``r``'s aggregator. Under a client fraction ``C < 1`` (the method's
``fraction`` knob; docs/algorithms.md, "Client fraction") the participants are among the
``max(1, round(C·K))`` members every node draws from the round's seed and roster
(``RoundPlan.drawn``); the others sit the round out (no training, report or upload) and
still pull, apply and evaluate the round's result; records carry ``drawn`` and ``sat_out``.

One round, seen from member ``i``:

1. a participant trains locally, keeps its upload (the method's ``upload_part``) for pulls
   and notes a small report;
2. attempt ``a = 0, 1, …``: the aggregator is ``succession(r, roster)[a]``
   (:mod:`p2pfl.rounds.rotation.election`) — the same for every member, without a vote;
3. a client sends its ``report`` tagged ``(r, a)`` to that aggregator and waits for its
   ``announce``; the aggregator waits (``round_timeout_s`` at most) for the participants'
   reports, pulls their uploads, runs the pure server rule
   (:meth:`~p2pfl.algorithms.base.CentralizedAlgorithm.aggregate`), computes the next plan
   from the live membership, and announces ``(r, a)`` on its gossip topic (the
   aggregator's role: :class:`~p2pfl.rounds.rotation.aggregator.AggregatorRole`, which also serves
   this node's uploads and results);
4. on the announcement a client pulls what it receives (``result``) — only its own part:
   FedPer's ``g``, DiversiFed's ``z_i``, pFedC's shared layers and its own heads;
5. **failover**: when the aggregator goes offline (Last Will), cannot be reached (a
   partition: :mod:`p2pfl.rounds.rotation.reach`; docs/wire.md, "Partitions"), misses the deadline
   (``aggregator_timeout``), or a later attempt is announced or requested, or its result is
   refused (admission; docs/design.md, "Robust aggregation") or caught by the audit, the
   member moves to attempt ``a + 1`` — the next peer in order — and reports again. In a
   signed swarm every member waits for the round's audit verdict before applying
   (:class:`~p2pfl.rounds.rotation.auditor.AuditRole`; docs/design.md, "Auditing the aggregator"),
   and a convicted aggregator is skipped from then on;
6. the member applies the result, follows its model lineage (:mod:`p2pfl.rounds.rotation.lineage`:
   the record's ``lineage``), evaluates, records (:meth:`~p2pfl.services.ledger.Ledger.round_record`: the
   method's ``apply`` facts, and on the aggregator its server-rule facts prefixed
   ``agg_``, under the record's ``method`` key), and starts round ``r + 1``.

Every message carries ``(round, attempt)``. An announcement or report of a round already
applied, or of an attempt older than the one a member is at, is dropped and counted
(``stale_round`` / ``stale_attempt``), so no round is applied twice and a late reply to a
dead attempt changes nothing. Uploads are served only to the rightful aggregator (and
auditor) of the attempt named in the pull. Every wait is bounded: a round a member cannot finish (every
candidate gone) keeps its model and goes on.

**Quorum rounds** (``timing.quorum``; docs/algorithms.md, "Semi-asynchronous rounds"): the
aggregator closes an attempt at a quorum of its live participants or at a deadline adapted
from the report latencies recent announcements carried (``report_s``, kept by every member
for whoever aggregates next). A participant the round closed without (``closed_without``)
applies the round's result as usual and offers its upload to the round after the newest
one announced, where it counts with the weight ``n · (1 + s)^-a``; records carry ``late``
and ``closed_without``, and the late member's ``offered_late``.

**Secure aggregation** (``privacy.secagg``; docs/design.md, "Secure aggregation"): while a
participant waits for an attempt's announcement, its side of SecAgg+ runs
(:class:`~p2pfl.rounds.rotation.secure_round.SecureRounds`, a task per attempt); records carry
``secagg``.

A member that starts while the swarm is past round 1 (its peers' presence says so), or that
an announcement left out of the next roster, *observes*: it waits for the next announcement,
pulls what any non-uploader receives (:attr:`Aggregate.common`) from that aggregator, and is
in the roster of the round after.

**What a member hears** (docs/wire.md, "Topics"): every gossip topic, but presence only as
far as its part in the round needs (:mod:`p2pfl.rounds.rotation.hearing`).

**Roles.** :class:`CentralizedRounds` is the driver: it routes messages, runs each round
(train, settle, apply, evaluate, record) and the catch-up loop, and composes the roles,
each given what it uses when it is built: the view of the rotation
(:class:`~p2pfl.rounds.rotation.rotation.Rotation`: rosters, announcements heard, who aggregates and
audits), whose presence it hears (:class:`~p2pfl.rounds.rotation.hearing.Hearing`), the member's own
steps (:class:`~p2pfl.rounds.rotation.member.Member`: train, report, pull and apply; late offers:
:class:`~p2pfl.rounds.rotation.late.LateOffers`), the attempts and their failovers
(:class:`~p2pfl.rounds.rotation.succession.Succession`), observing
(:class:`~p2pfl.rounds.rotation.observe.Observer`), the aggregator's role, the audit's, secure
aggregation's and the reachability of peers. The plan and the announcement that carries
the next one (:class:`RoundPlan`, :func:`check_announcement`) are in
:mod:`p2pfl.rounds.rotation.plans`.

Each step is told to observers (:meth:`~p2pfl.services.ledger.Ledger.publish_status`): ``training``,
``waiting`` (for an aggregator or an announcement), ``aggregating`` (the aggregator's side),
``evaluating``, and each pull that arrived.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from p2pfl.algorithms.base import Method
from p2pfl.background import background
from p2pfl.config.schema import TopologyConfig
from p2pfl.learning.train import round_lr
from p2pfl.rounds.rotation.aggregator import AggregatorRole
from p2pfl.rounds.rotation.auditor import AuditRole
from p2pfl.rounds.rotation.hearing import Hearing
from p2pfl.rounds.rotation.late import Counted, LateOffers
from p2pfl.rounds.rotation.lineage import Lineage
from p2pfl.rounds.rotation.member import Member
from p2pfl.rounds.rotation.observe import Observer
from p2pfl.rounds.rotation.partition import follow_bridges, member_reach
from p2pfl.rounds.rotation.plans import (
    RoundPlan,
    announced_plan,
    check_announcement,
    draw_plan,
    live_members,
)
from p2pfl.rounds.rotation.role import RotationRole
from p2pfl.rounds.rotation.roster import MissingBase, RosterRequests
from p2pfl.rounds.rotation.rotation import ROUNDS_KEPT, Behind, Heard, Rotation
from p2pfl.rounds.rotation.secure_round import KINDS as SECURE_KINDS
from p2pfl.rounds.rotation.secure_round import SecureRounds
from p2pfl.rounds.rotation.succession import Settled, Succession
from p2pfl.services.bundle import NodeServices
from p2pfl.services.training import TrainOutcome
from p2pfl.wire.envelope import Envelope

log = logging.getLogger(__name__)

__all__ = ["ROUNDS_KEPT", "CentralizedRounds", "RoundPlan", "check_announcement"]


class CentralizedRounds(RotationRole):
    """Runs a :class:`CentralizedAlgorithm` for one node: the client side every round, and
    the succession that says in which rounds (and attempts) it is elected; its
    :class:`~p2pfl.rounds.rotation.aggregator.AggregatorRole` (:attr:`role`) does the aggregator's side
    and serves its uploads and results."""

    def __init__(self, services: NodeServices):
        super().__init__(services)
        self.rotation = Rotation(services)
        rot = self.rotation
        self.hearing = Hearing(services, rot.audited)
        # docs/wire.md, "Partitions": who is reachable, and the model lineage followed
        self.reach = member_reach(services)
        self.lineage = Lineage()
        # semi-asynchronous rounds (timing.quorum): what each applied round counted, and
        # this node's late offers
        self.late = LateOffers(
            services, rot, min(services.cfg.timing.max_staleness, ROUNDS_KEPT - 1)
        )
        # privacy.secagg: the members' and the aggregator's sides of secure aggregation
        privacy = services.cfg.privacy
        self.secure = SecureRounds(services, rot.aggregator) if privacy and privacy.secagg else None
        # this node's side as an aggregator: reports, uploads, results and their pulls
        self.role = AggregatorRole(
            services,
            rot,
            self.late,
            secure=self.secure,
            reach=self.reach,
            lineage=self.lineage,
            hearing=self.hearing,
        )
        # the audit of each round's aggregate (signed swarms): its verdicts and convictions
        self.audit = AuditRole(services, rot, self.role, self.reach)
        self.member = Member(services, self.role, self.lineage, self.late)
        self.succession = Succession(
            services, rot, self.hearing, self.member, self.role, self.audit, self.reach, self.secure
        )
        self.observer = Observer(services, rot, self.hearing, self.member)
        # announcements whose roster came by difference against a base this node lacks
        self.rosters_asked = RosterRequests(services)

    # ------------------------------------------------------------------ what it declares
    @classmethod
    def selects(cls, method: type[Method], cfg: TopologyConfig) -> bool:
        """A centralized method, under a rotating aggregator."""
        return method.kind == "centralized"

    @classmethod
    def peers_of(cls, cfg: TopologyConfig, node_id: str) -> list[str]:
        """Every other member: any of them may aggregate a round."""
        return [n for n in cfg.node_ids if n != node_id]

    @classmethod
    def listens_to(cls, neighbours: list[str]) -> list[str] | None:
        """A member hears every member's messages."""
        return None

    async def start(self) -> list[str]:
        """Hear, from before the node connects, the peers it needs until its first round
        (:meth:`hearing_at_start`), and wait for them at the startup barrier."""
        heard = self.hearing_at_start()
        await self.services.exchange.hear(heard, fresh_within=0)  # before it connects
        return self.services.neighbours if heard is None else heard

    # ------------------------------------------------------------------ where it stands
    @property
    def rosters(self) -> dict[int, list[str]]:
        """The roster of each round this node learnt."""
        return self.rotation.rosters

    @property
    def current(self) -> tuple[int, int]:
        """The ``(round, attempt)`` this member is at."""
        return self.rotation.current

    @current.setter
    def current(self, value: tuple[int, int]) -> None:
        self.rotation.current = value

    @property
    def applied(self) -> int:
        """The last round whose result this member applied (or gave up on)."""
        return self.rotation.applied

    @applied.setter
    def applied(self, value: int) -> None:
        self.rotation.applied = value

    def hearing_at_start(self) -> list[str] | None:
        """Whose presence this node hears from its start until its first round
        (:meth:`~p2pfl.rounds.rotation.hearing.Hearing.at_start`)."""
        return self.hearing.at_start()

    # ------------------------------------------------------------------ incoming
    def _secure_message(self, env: Envelope) -> None:
        """An ``sa_*`` message (docs/wire.md, "Secure aggregation"), unless stale or unasked."""
        rot = self.rotation
        if self.secure is None:
            self.services.ledger.drop("unexpected_kind", f"{env.kind} from {env.sender}: no secagg")
        elif not (rot.stale(env, env.kind) or rot.too_far(env, env.kind)):
            self.secure.on_message(env)

    def on_gossip(self, env: Envelope) -> None:
        rot = self.rotation
        if env.sender in self.members:
            self.reach.alive(env.sender)  # a sign of life (docs/wire.md, "Partitions")
        if env.kind in SECURE_KINDS:
            self._secure_message(env)
            return
        if env.kind == "audit" and env.sender in self.members:
            if not (rot.stale(env, "audit") or rot.too_far(env, "audit")):
                self.audit.on_verdict(env)
            return
        if env.kind != "announce" or env.sender not in self.members:
            return
        if rot.stale(env, "announce"):
            return
        if rot.too_far(env, "announce"):
            self._keep_newest(env)
            return
        expected = rot.aggregator(env.round, env.attempt)
        if expected is not None and expected != env.sender:
            self.services.ledger.drop(
                "not_aggregator", f"announce {env.round}/{env.attempt} from {env.sender}"
            )
            return
        self._announce(env)

    def _announce(self, env: Envelope) -> None:
        """Note an announcement from its rightful aggregator, checked; one whose roster
        comes by difference against a base this node lacks waits for the whole roster
        (:class:`~p2pfl.rounds.rotation.roster.RosterRequests`)."""
        try:
            body = self.rotation.check(env.round, env.body)
        except MissingBase:
            self.rosters_asked.tasks.spawn(self.rosters_asked.ask(env))
            return
        except ValueError as exc:
            self.services.ledger.drop("malformed", f"announce from {env.sender}: {exc}")
            return
        self.rotation.note(Heard(env.round, env.attempt, env.sender, body))
        self.services.peers.notify()

    def on_inbox(self, env: Envelope) -> None:
        rot = self.rotation
        if env.kind in ("probe_req", "probe_ack"):  # docs/wire.md, "Partitions"
            if env.sender in self.members:
                why = self.reach.on_message(env.sender, env.kind, env.body)
                if why is not None and why.startswith("malformed"):
                    self.services.ledger.drop("malformed", f"{env.kind} from {env.sender}: {why}")
                elif why is not None:  # unasked, too soon, too busy: expected, not logged
                    self.services.ledger.count("probe_refused")
            return
        if env.sender in self.members:
            self.reach.alive(env.sender)
        if env.kind in ("roster_req", "roster") and env.sender in self.members:
            self._roster_message(env)
            return
        if env.kind in SECURE_KINDS:
            self._secure_message(env)
            return
        if env.kind != "report" or env.sender not in self.members:
            return
        if rot.stale(env, "report") or rot.too_far(env, "report"):
            return
        # a fast peer may report a round this node has not started yet (roster unknown)
        if rot.aggregator(env.round, env.attempt) not in (None, self.id):
            self.services.ledger.drop(
                "misdirected_report", f"{env.round}/{env.attempt} from {env.sender}"
            )
            return
        if not self.role.collect(env):  # a malformed body: dropped
            return
        self.role.late_report(env.round, env.attempt)  # announced already: once more
        rot.wanted[env.round] = max(rot.wanted.get(env.round, 0), env.attempt)
        self.services.peers.notify()

    def _roster_message(self, env: Envelope) -> None:
        """A ``roster_req`` (answered from this node's announcement) or the ``roster`` it
        asked for (the held announcement then goes on as if it had come whole)."""
        asked = self.rosters_asked
        if env.kind == "roster_req":
            mine = self.role.announced(env.round, env.attempt)
            asked.tasks.spawn(asked.serve(env, mine))
            return
        whole = asked.answer(env)
        if isinstance(whole, str):
            reason = "malformed" if whole.startswith("malformed") else "unexpected_roster"
            self.services.ledger.drop(reason, f"roster from {env.sender}: {whole}")
            return
        if self.rotation.stale(whole, "announce"):
            return
        if self.rotation.too_far(whole, "announce"):
            self._keep_newest(whole)
        else:
            self._announce(whole)

    def _keep_newest(self, env: Envelope) -> None:
        """An announcement too far ahead to use now, kept for a catch-up
        (:meth:`~p2pfl.rounds.rotation.observe.Observer.keep_newest`); one whose roster came
        by difference asks for it whole first."""
        try:
            self.observer.keep_newest(env)
        except MissingBase:
            self.rosters_asked.tasks.spawn(self.rosters_asked.ask(env))

    def on_peer_online(self, peer: str) -> None:
        """Nothing to resend: a member that comes online catches up from the next
        announcement (it observes a round first)."""

    async def serve_pull(self, env: Envelope) -> None:
        """This node's uploads and results (:meth:`AggregatorRole.serve_pull`)."""
        if env.sender in self.members:
            self.reach.alive(env.sender)  # transfer progress: it is reached
        await self.role.serve_pull(env)

    def _forget_old(self, round_no: int) -> None:
        floor = round_no - ROUNDS_KEPT
        self.role.forget(floor)
        self.rotation.forget(floor)
        self.late.forget(floor)
        self.audit.forget(floor)
        self.rosters_asked.forget(floor)
        if self.secure is not None:
            self.secure.forget(floor)

    # ------------------------------------------------------------------ one round
    async def _round(self, plan: RoundPlan | None, after: int) -> tuple[dict[str, Any], RoundPlan]:
        """Run one round as a member (``plan`` given) or as an observer (``plan`` None,
        waiting for the first round after ``after``); returns the record and the next plan."""
        svc, cfg, alg = self.services, self.cfg, self.alg
        meter = svc.ledger.meter()
        participated = False
        trained: TrainOutcome | None = None
        secagg: dict[str, Any] | None = None  # this member's and the aggregator's parts
        lr = round_lr(cfg.training, plan.round if plan else after + 1)
        svc.robust.begin_round(plan.round if plan is not None else after + 1)
        self.reach.begin_round()
        if plan is not None:
            r = plan.round
            self.rotation.rosters[r] = plan.roster
            self.rotation.current = (r, 0)
            await self.hearing.hear(self.hearing.of(plan, 0))
            self.role.round_started(r)
            participated = self.id in plan.participants
            own = None
            if participated:
                trained, own = await self.member.train(plan, lr)
            t_comm = time.monotonic()
            settled = await self.succession.settle(plan, participated, own)
            if self.secure is not None:  # the member's part, beside the aggregator's facts
                self.secure.stop_member()
                mine = self.secure.member_facts(r)
                theirs = settled.aggregated.secagg if settled.aggregated is not None else None
                secagg = {**({"member": mine} if mine else {}), **(theirs or {})}
        else:
            t_comm = time.monotonic()
            svc.ledger.publish_status(after + 1, "waiting")  # for the next announcement
            observed = await self.observer.observe(after)
            if observed is None:
                raise TimeoutError(f"no announcement heard after round {after}")
            settled = observed
            r = settled.round
        comm_s = time.monotonic() - t_comm
        announcement = settled.announcement
        # the round is settled: say so at once (the next round's lead is then heard with
        # this report in its retained presence), then hear whom the next round needs
        await svc.ledger.report_round(r)
        nxt = None if announcement is None else announced_plan(alg, cfg.seed, r + 1, announcement)
        if nxt is not None and r < cfg.rounds:
            await self.hearing.hear(self.hearing.between(nxt))
        applied = await self.member.apply(r, settled.aggregator, settled.received, announcement)
        self.rotation.applied = r
        svc.ledger.publish_status(r, "evaluating")
        evaluated = await svc.training.evaluate()
        if nxt is None:  # nobody finished the round: go on with whoever is still here
            server = plan.server if plan is not None else {}
            await self.hearing.hear(None)  # on a live view of every member
            nxt = draw_plan(alg, cfg.seed, r + 1, live_members(svc), server)
        aggregated = announcement["aggregated"] if announcement else []
        refused = announcement.get("refused", []) if announcement else []
        if refused:  # the aggregator's defence left these uploads out: not aggregated
            aggregated = [p for p in aggregated if p not in refused]
            if self.id in refused:
                log.warning(
                    "%s: round %d: aggregator %s's defence refused this node's upload",
                    self.id,
                    r,
                    settled.aggregator,
                )
        if announcement is not None:  # what the round counted, and how fast it reported
            who = plan.participants if plan is not None else None
            self.late.note(r, Counted(who, aggregated, announcement.get("late", {})))
            if "report_s" in announcement:
                self.role.quorum.latencies.append(announcement["report_s"])
        received = settled.received is not None and applied.error is None
        fields = self._fields(plan, settled, participated, aggregated, received, secagg)
        if cfg.timing.quorum is not None:  # semi-asynchronous rounds
            body = announcement or {}
            fields["late"] = body.get("late", {})  # late uploads counted: their staleness
            fields["closed_without"] = body.get("closed_without", [])
        if plan is not None and plan.drawn is not None:  # a client fraction below 1
            fields["drawn"] = plan.drawn
            fields["sat_out"] = self.id not in plan.drawn  # it still applies and evaluates
        if applied.error is not None:
            fields["apply_error"] = applied.error
        record = svc.ledger.round_record(
            r,
            meter=meter,
            evaluated=evaluated,
            lr=lr,
            trained=trained,
            comm_s=comm_s,
            peers=aggregated,
            driver=fields,
            method=(settled.server_facts, applied.facts),  # then after_train's (trained.facts)
        )
        self._forget_old(r)
        return record, nxt

    def _fields(
        self,
        plan: RoundPlan | None,
        settled: Settled,
        participated: bool,
        aggregated: list[str],
        received: bool,
        secagg: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """The driver's fields of the round's record that say how it settled, from the
        typed results of its roles (README.md, "Run directory", for each field)."""
        fields: dict[str, Any] = {
            "participated": participated,
            "aggregated": aggregated,
            "observer": plan is None,
            "received": received,
            "roster": plan.roster if plan else None,
            "lineage": self.lineage.name,
            "aggregator": settled.aggregator,
            "attempt": settled.attempt,
            "failovers": [f.record() for f in settled.failovers],
        }
        if settled.offered_late is not None:
            fields["offered_late"] = settled.offered_late.record()
        if settled.aggregated is not None:  # this node's own facts as the aggregator
            fields.update(settled.aggregated.record())
        if settled.audit is not None:
            fields["audit"] = settled.audit
        if secagg is not None:
            fields["secagg"] = secagg
        return fields

    # ------------------------------------------------------------------ lifecycle
    def first_plan(self) -> RoundPlan | None:
        """Round 1's plan on the topology's members (a member absent at the start sits in
        round 1's roster; nobody waits on it, and round 2's roster, drawn from the
        aggregator's live presence, leaves it out), or None when this node joins a swarm
        already under way (a heard peer's presence reports a finished round) or resumes
        from a checkpoint."""
        if self.rotation.swarm_round() >= 1 or self.services.ledger.resumed_round >= 1:
            return None
        roster = sorted(self.members)  # every node draws the same, whatever it hears
        server = self.alg.initial_server_state(roster)
        return draw_plan(self.alg, self.cfg.seed, 1, roster, server)

    async def run(self) -> None:
        """Every round from round 1, or, when the swarm is under way (or this node resumes,
        or falls :data:`~p2pfl.services.bundle.LAG_ROUNDS` behind), from the next announcement
        on (observing first). The announcements late reports ask for again go out while it
        runs."""
        try:
            async with background(self.role.reannounce()):
                await self._rounds()
        finally:
            await self.reach.aclose()
            await self.rosters_asked.tasks.aclose()

    async def _rounds(self) -> None:
        svc, cfg, rot = self.services, self.cfg, self.rotation
        await follow_bridges(svc)
        plan = self.first_plan()
        after = 0
        if plan is None:
            after = max(rot.swarm_round(), svc.ledger.resumed_round)
            log.info("%s: swarm under way (round %d); catching up", self.id, after)
            await self.observer.start(after)
        caught_up_from: int | None = None
        while True:
            if plan is not None and await svc.device.sit_out_offline(plan.round):
                after, plan = max(rot.swarm_round(), plan.round - 1), None  # catch up
                await self.observer.start(after)
            if plan is not None and self.id not in plan.roster:
                log.info("%s: not in round %d's roster; observing", self.id, plan.round)
                after, plan = plan.round - 1, None
            if plan is not None and (ahead := rot.behind(plan.round)) is not None:
                log.warning(
                    "%s: the swarm finished round %d, this node is at %d: catching up",
                    self.id,
                    ahead,
                    plan.round,
                )
                caught_up_from, after, plan = plan.round, ahead, None
                await self.observer.start(after)
            if plan is not None and plan.round > cfg.rounds:
                break
            if plan is None and after >= cfg.rounds:
                break
            try:
                record, plan = await self._round(plan, after)
            except TimeoutError as exc:
                log.warning("%s: stopping: %s", self.id, exc)
                break
            except Behind as behind:
                log.warning(
                    "%s: the swarm finished round %d while this node settled round %d: catching up",
                    self.id,
                    behind.round,
                    rot.current[0],
                )
                caught_up_from, after, plan = rot.current[0], behind.round, None
                await self.observer.start(after)
                continue
            if caught_up_from is not None:
                record["caught_up_from"], caught_up_from = caught_up_from, None
            after = record["round"]
            observer = " (observer)" if record["observer"] else ""
            await svc.ledger.finish_round(
                record, f"aggregator {record['aggregator']} attempt {record['attempt']}{observer}"
            )
