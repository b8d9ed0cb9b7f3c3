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
   the record's ``lineage``), evaluates, records (:meth:`NodeServices.round_record`: the
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

**What a member hears** (docs/wire.md, "Topics"): every member hears every gossip topic
(announcements and audit verdicts, a few a round), but presence only as far as its part in
the round needs (:meth:`CentralizedRounds.hearing`). Every member's presence, while it may
aggregate or audit (it waits on the participants, pulls their uploads and draws the next
roster from live presence), while it observes, and from the start until its first round;
the presence of the round's first :data:`HEADS` aggregators (and their auditors) only,
otherwise. A broker thus delivers ``O(N)`` presence messages a round instead of ``N²``.
Each change of hearing waits (:data:`FRESH_S` at most) for the retained presence of the
peers newly heard, so the view a member decides on is live.

The plan and the announcement that carries the next one (:class:`RoundPlan`,
:func:`check_announcement`) are in :mod:`p2pfl.rounds.rotation.plans`, shared with the aggregator's role.

Each step is told to observers (:meth:`NodeServices.publish_status`): ``training``,
``waiting`` (for an aggregator or an announcement), ``aggregating`` (the aggregator's side),
``evaluating``, and each pull that arrived.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from p2pfl.algorithms.base import CentralizedAlgorithm, Method
from p2pfl.config.schema import TopologyConfig
from p2pfl.learning.state import State
from p2pfl.learning.train import round_lr
from p2pfl.rounds.rotation.aggregator import AggregatorRole
from p2pfl.rounds.rotation.audit import audit_active, auditor_of
from p2pfl.rounds.rotation.auditor import AuditRole
from p2pfl.rounds.rotation.election import succession
from p2pfl.rounds.rotation.lineage import Lineage
from p2pfl.rounds.rotation.partition import follow_bridges, member_reach
from p2pfl.rounds.rotation.plans import (
    RoundPlan,
    announced_plan,
    check_announcement,
    draw_plan,
    drawn_of,
    live_members,
    waits_on,
)
from p2pfl.rounds.rotation.secure_round import KINDS as SECURE_KINDS
from p2pfl.rounds.rotation.secure_round import SecureRounds
from p2pfl.services.bundle import NodeServices
from p2pfl.services.training import TrainOutcome
from p2pfl.wire.codec import state_nbytes
from p2pfl.wire.envelope import Envelope
from p2pfl.wire.transport import TransportError

log = logging.getLogger(__name__)

ROUNDS_KEPT = 3  # uploads and results kept for late pulls
# a member hears the presence of the aggregators of its current attempt and of the next one
HEADS = 2
FRESH_S = 3.0  # how long a change of hearing waits for the retained presence of new peers

__all__ = ["ROUNDS_KEPT", "CentralizedRounds", "RoundPlan", "check_announcement"]


class _Behind(Exception):  # noqa: N818 (control flow, never leaves this module)
    """This member fell behind the swarm (``round``: the latest round the swarm finished)."""

    def __init__(self, round_no: int):
        super().__init__(round_no)
        self.round = round_no


class CentralizedRounds:
    """Runs a :class:`CentralizedAlgorithm` for one node: the client side every round, and
    the succession that says in which rounds (and attempts) it is elected; its
    :class:`~p2pfl.rounds.rotation.aggregator.AggregatorRole` (:attr:`role`) does the aggregator's side
    and serves its uploads and results."""

    def __init__(self, services: NodeServices):
        assert isinstance(services.method, CentralizedAlgorithm)
        self.services = services
        self.alg: CentralizedAlgorithm = services.method
        self.id = services.id
        self.cfg = services.cfg
        self.members = set(services.cfg.node_ids)
        self.rosters: dict[int, list[str]] = {}
        self.current = (0, 0)  # (round, attempt) this member is at
        self.applied = 0  # last round whose result this member applied (or gave up on)
        self._announced: dict[int, dict[int, tuple[str, dict[str, Any]]]] = {}
        self._wanted: dict[int, int] = {}  # round -> highest attempt a peer asked us to run
        # the newest announcement heard too far ahead: (round, attempt, sender, body)
        self._newest: tuple[int, int, str, dict[str, Any]] | None = None
        # the audit of each round's aggregate (signed swarms): verdicts heard, and the
        # aggregators an auditor caught, skipped as aggregators from then on
        self.audited = audit_active(services.cfg, self.alg)
        # semi-asynchronous rounds (timing.quorum): what each applied round counted (its
        # aggregated uploads and the late ones' staleness), and this node's late offers
        self._counted: dict[int, tuple[list[str] | None, list[str], dict[str, int]]] = {}
        self._late_offers: dict[int, dict[str, Any]] = {}  # round offered to -> report
        # this node's side as an aggregator: reports, uploads, results and their pulls
        self.role = AggregatorRole(
            services,
            self._aggregator,
            self._auditor,
            counted=self._counted_before,
            max_late=min(services.cfg.timing.max_staleness, ROUNDS_KEPT - 1),
        )
        # privacy.secagg: the members' and the aggregator's sides of secure aggregation
        privacy = services.cfg.privacy
        self.secure = (
            SecureRounds(services, self._aggregator) if privacy and privacy.secagg else None
        )
        self.role.secure = self.secure
        # the audit of each round's aggregate (signed swarms): its verdicts and convictions
        self.audit = AuditRole(
            services, self._aggregator, self._auditor, self.role.upload, self.role.late_upload
        )
        # docs/wire.md, "Partitions": who is reachable, and the model lineage followed
        self.reach = member_reach(services)
        self.lineage = Lineage()
        self.role.reach, self.role.lineage, self.audit.reach = self.reach, self.lineage, self.reach

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
        """A member hears every member."""
        return None

    async def start(self) -> list[str]:
        """Hear, from before the node connects, the peers it needs until its first round
        (:meth:`hearing_at_start`), and wait for them at the startup barrier."""
        heard = self.hearing_at_start()
        await self.services.exchange.hear(heard, fresh_within=0)  # before it connects
        return self.services.neighbours if heard is None else heard

    # ------------------------------------------------------------------ small helpers
    @property
    def tr(self):
        return self.services.transport

    def _online(self, peer: str) -> bool:
        return self.services.is_online(peer)

    def _aggregator(self, round_no: int, attempt: int) -> str | None:
        roster = self.rosters.get(round_no)
        if not roster or attempt >= len(roster):
            return None
        return succession(round_no, roster)[attempt]

    def _auditor(self, round_no: int, attempt: int) -> str | None:
        """Who audits attempt ``attempt`` of ``round_no`` (None without an audit, or while
        the round's roster is unknown)."""
        roster, agg = self.rosters.get(round_no), self._aggregator(round_no, attempt)
        if not self.audited or not roster or agg is None:
            return None
        return auditor_of(self.cfg.seed, round_no, attempt, roster, agg)

    def hearing(self, plan: RoundPlan, attempt: int) -> list[str] | None:
        """Whose presence this node needs at attempt ``attempt`` of ``plan``'s round: None
        (every member's) when it aggregates or audits one of the attempts up to
        ``attempt + HEADS - 1``; otherwise those attempts' aggregators and auditors, whose
        presence says when to fail over and whose results it pulls."""
        return self._hearing_in(plan.round, plan.roster, attempt)

    def hearing_at_start(self) -> list[str] | None:
        """Whose presence this node hears from its start until its first round (and waits
        for at the startup barrier): round 1's, as :meth:`hearing` gives it on round 1's
        roster (the topology's members); every member's when it resumes (it observes
        first)."""
        if self.services.resumed_round >= 1:
            return None
        return self._hearing_in(1, sorted(self.members), 0)

    def _hearing_in(self, r: int, roster: list[str], attempt: int) -> list[str] | None:
        order = succession(r, roster)
        heads = order[: attempt + HEADS]
        auditors = (
            {auditor_of(self.cfg.seed, r, a, roster, agg) for a, agg in enumerate(heads)}
            if self.audited
            else set()
        )
        if self.id in heads or self.id in auditors:
            return None
        return sorted((set(heads) | auditors) - {self.id})

    async def _hear(self, peers: list[str] | None) -> None:
        """Hear the presence of ``peers`` (None: every member's) and no other's
        (:meth:`~p2pfl.wire.transport.Transport.hear_presence`)."""
        await self.tr.hear_presence(peers, FRESH_S, members=sorted(self.members))

    def _behind(self, round_no: int) -> int | None:
        """The latest round the swarm reports finished when this node, at ``round_no``, has
        fallen :data:`~p2pfl.services.peers.LAG_ROUNDS` behind it; None when in step."""
        return self.services.behind(round_no, sorted(self.members - {self.id}))

    def _check_behind(self, round_no: int) -> None:
        ahead = self._behind(round_no)
        if ahead is not None:
            raise _Behind(ahead)

    def _stale(self, env: Envelope, what: str) -> bool:
        """Drop (and count) a message of a round already applied or a dead attempt."""
        rnd, att = self.current
        if env.round <= self.applied:
            self.services.drop("stale_round", f"{what} {env.round}/{env.attempt} from {env.sender}")
            return True
        if env.round == rnd and env.attempt < att:
            self.services.drop(
                "stale_attempt", f"{what} {env.round}/{env.attempt} from {env.sender}"
            )
            return True
        return False

    # ------------------------------------------------------------------ incoming
    def _too_far(self, env: Envelope, what: str) -> bool:
        if env.round > max(self.applied, self.current[0]) + ROUNDS_KEPT and self.applied:
            self.services.drop("future_round", f"{what} {env.round} from {env.sender}")
            return True
        return False

    def _secure_message(self, env: Envelope) -> None:
        """An ``sa_*`` message (docs/wire.md, "Secure aggregation"), unless stale or unasked."""
        if self.secure is None:
            self.services.drop("unexpected_kind", f"{env.kind} from {env.sender}: no secagg")
        elif not (self._stale(env, env.kind) or self._too_far(env, env.kind)):
            self.secure.on_message(env)

    def on_gossip(self, env: Envelope) -> None:
        if env.kind in SECURE_KINDS:
            self._secure_message(env)
            return
        if env.kind == "audit" and env.sender in self.members:
            if not (self._stale(env, "audit") or self._too_far(env, "audit")):
                self.audit.on_verdict(env)
            return
        if env.kind != "announce" or env.sender not in self.members:
            return
        if self._stale(env, "announce"):
            return
        if self._too_far(env, "announce"):
            self._keep_newest(env)
            return
        expected = self._aggregator(env.round, env.attempt)
        if expected is not None and expected != env.sender:
            self.services.drop(
                "not_aggregator", f"announce {env.round}/{env.attempt} from {env.sender}"
            )
            return
        try:
            body = check_announcement(env.body, self.members)
            # the next round's participants must be among the members its seed draws
            drawn = drawn_of(self.alg, self.cfg.seed, env.round + 1, body["roster"])
            if drawn is not None and not set(body["participants"]) <= set(drawn):
                raise ValueError("participants outside the client fraction's draw")
        except ValueError as exc:
            self.services.drop("malformed", f"announce from {env.sender}: {exc}")
            return
        self._announced.setdefault(env.round, {})[env.attempt] = (env.sender, body)
        self.services.notify()

    def _keep_newest(self, env: Envelope) -> None:
        """Keep the newest announcement too far ahead to use now (one, checked, of a round
        live presence reports at most one ahead): when this node finds it has fallen behind
        and observes (:meth:`_observe`), it starts from it rather than waiting for the next
        one, which may wait on this node (after a partition heals: docs/wire.md,
        "Partitions")."""
        newest = self._newest
        if newest is not None and newest[0] >= env.round:
            return
        if env.round > self._swarm_round() + 1:
            return
        try:
            body = check_announcement(env.body, self.members)
            drawn = drawn_of(self.alg, self.cfg.seed, env.round + 1, body["roster"])
            if drawn is not None and not set(body["participants"]) <= set(drawn):
                return
        except ValueError:
            return
        self._newest = (env.round, env.attempt, env.sender, body)

    def on_inbox(self, env: Envelope) -> None:
        if env.kind in SECURE_KINDS:
            self._secure_message(env)
            return
        if env.kind != "report" or env.sender not in self.members:
            return
        if self._stale(env, "report") or self._too_far(env, "report"):
            return
        # a fast peer may report a round this node has not started yet (roster unknown)
        if self._aggregator(env.round, env.attempt) not in (None, self.id):
            self.services.drop("misdirected_report", f"{env.round}/{env.attempt} from {env.sender}")
            return
        if not self.role.collect(env):  # a malformed body: dropped
            return
        self.role.late_report(env.round, env.attempt)  # announced already: once more
        self._wanted[env.round] = max(self._wanted.get(env.round, 0), env.attempt)
        self.services.notify()

    def on_peer_online(self, peer: str) -> None:
        """Nothing to resend: a member that comes online catches up from the next
        announcement (it observes a round first)."""

    async def serve_pull(self, env: Envelope) -> None:
        """This node's uploads and results (:meth:`AggregatorRole.serve_pull`)."""
        await self.role.serve_pull(env)

    def _forget_old(self, round_no: int) -> None:
        floor = round_no - ROUNDS_KEPT
        self.role.forget(floor)
        for d in (self._announced, self._counted, self._late_offers):
            for r in [r for r in d if r <= floor]:
                del d[r]
        self.audit.forget(floor)
        if self.secure is not None:
            self.secure.forget(floor)

    # ------------------------------------------------------------------ quorum rounds
    def _counted_before(self, peer: str, trained: int) -> bool:
        """Whether ``peer``'s upload of round ``trained`` was counted already, fresh in that
        round or late in a later one, or cannot be one (``peer`` was not among that round's
        participants), as far as the rounds this node applied tell; True, so the upload is
        refused, when this node did not take part in round ``trained`` (it cannot tell)."""
        participants, aggregated, late = self._counted.get(trained, (None, [], {}))
        if participants is None or peer not in participants:
            return True
        if peer in aggregated and peer not in late:
            return True
        return any(lt.get(peer) == k - trained for k, (_, _, lt) in self._counted.items())

    async def _offer_late(
        self, trained: int, body: dict[str, Any], own: dict[str, Any]
    ) -> dict[str, Any] | None:
        """This node's upload of round ``trained`` missed its round's close (``body``: the
        announcement of ``trained`` it takes): offer it to the round after the newest one
        announced by its rightful aggregator (each round's roster comes from the
        announcement before it), as ``{n, report, late: trained}`` to that round's first
        aggregator, when that round exists and is at most ``max_late`` rounds later.
        Returns ``{round, staleness}`` for the record, None when not offered."""
        newest = trained
        while newest + 1 in self._announced:  # the swarm may be further on already
            later = self._announced[newest + 1]
            attempt = max(later)
            order = succession(newest + 1, body["roster"])
            if attempt >= len(order) or later[attempt][0] != order[attempt]:
                break
            newest, body = newest + 1, later[attempt][1]
        target, staleness = newest + 1, newest + 1 - trained
        if target > self.cfg.rounds or staleness > self.role.max_late:
            return None
        roster = body["roster"]
        self.rosters.setdefault(target, roster)  # the plan of ``target`` will hold it too
        report = {"n": own["n"], "report": own["report"], "late": trained}
        self._late_offers[target] = report
        self.role.offer_late(target, trained, report)
        agg = succession(target, roster)[0]
        if agg != self.id:
            try:
                await self.tr.send(agg, "report", target, report, attempt=0)
            except TransportError as exc:
                log.warning("%s: round %d: late offer to %s failed: %s", self.id, target, agg, exc)
        log.info("%s: round %d's upload was late: offered to round %d", self.id, trained, target)
        return {"round": target, "staleness": staleness}

    def _sent(
        self, round_no: int, body: dict[str, Any], own: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        """What this node sent for the upload ``body`` counted of it: its late offer when the
        announcement counts that one, else its report of the round (for the audit's own
        entry check)."""
        if self.id in body.get("late", {}):
            return self._late_offers.get(round_no)
        return own

    # ------------------------------------------------------------------ succession
    def _superseded_at(self, round_no: int, attempt: int) -> Callable[[], bool]:
        """Whether a later attempt than ``attempt`` of ``round_no`` was announced."""
        return lambda: self._superseding(round_no, attempt) is not None

    def _superseding(self, round_no: int, attempt: int) -> int | None:
        later = [a for a in self._announced.get(round_no, {}) if a > attempt]
        return max(later) if later else None

    # ------------------------------------------------------------------ client side
    async def _pull_result(
        self, aggregator: str, round_no: int, attempt: int
    ) -> tuple[State | None, str | None]:
        try:
            state = await self.tr.pull(
                aggregator,
                round_no,
                "result",
                max(1.0, self.cfg.timing.round_timeout_s),
                attempt=attempt,
                max_bytes=self.services.pull_limit,
            )
            state = await self.services.decoded(aggregator, state)  # docs/wire.md, "Compression"
        except TransportError as exc:
            return None, str(exc)
        self.services.publish_status(round_no, pull=(aggregator, "result", state_nbytes(state)))
        # the aggregator is a peer: its result passes admission like any state (finite,
        # norm bound; the method's apply checks the layout), or the round fails over
        why = self.services.admit(state, self.alg.model_state(), layout=False)
        if why is not None:
            self.services.reject(aggregator, f"result: {why}", round_no)
            return None, f"result refused: {why}"
        return state, None

    def _secure_member(
        self, plan: RoundPlan, attempt: int, agg: str, own: dict[str, Any] | None
    ) -> None:
        """privacy.secagg: this member's side of attempt ``attempt`` runs while it waits
        (not for an aggregator it will fail over from at once)."""
        gone = agg != self.id and (agg in self.audit.convicted or not self._online(agg))
        if self.secure is not None and not gone:
            n = None if own is None else own["n"]
            self.secure.start_member(plan, attempt, agg, n, self.role.upload(plan.round))

    async def _settle(
        self, plan: RoundPlan, participated: bool, own: dict[str, Any] | None
    ) -> dict[str, Any]:
        """Attempts 0, 1, … of round ``plan.round`` until one result is applied (or every
        candidate is gone); returns the facts of the attempt that settled it (on its
        aggregator, with the method's server-rule facts under ``server_facts``)."""
        svc, cfg, r = self.services, self.cfg, plan.round
        order = succession(r, plan.roster)
        failovers: list[dict[str, Any]] = []
        late_offer: dict[str, Any] | None = None  # where this round's late upload went
        attempt = 0
        while attempt < len(order):
            self.current = (r, attempt)
            announced = {a: v for a, v in self._announced.get(r, {}).items() if a >= attempt}
            if announced:  # this attempt or a later one is over: take its result
                attempt = max(announced)
                self.current = (r, attempt)
            await self._hear(self.hearing(plan, attempt))
            if announced:
                sender, body = announced[attempt]
                if participated and own is not None and self.id in body.get("closed_without", []):
                    # the round closed at its quorum without this node: offer the upload on
                    if late_offer is None:
                        late_offer = await self._offer_late(r, body, own)
                needs = self.alg.needs_result(
                    participated, self.id in body["participants"], r >= cfg.rounds
                )
                audits = self._auditor(r, attempt) == self.id  # it checks what it is served
                received = None
                if (needs or audits) and (self.id in body["receivers"] or body["common"]):
                    received, error = await self._pull_result(sender, r, attempt)
                    if error is not None:
                        log.warning("%s: round %d: result pull failed: %s", self.id, r, error)
                        failovers.append({"attempt": attempt, "aggregator": sender, "why": error})
                        attempt += 1
                        continue
                sent = self._sent(r, body, own)
                caught, audit = await self.audit.check(
                    plan, attempt, sender, body, received, sent, self._superseded_at(r, attempt)
                )
                if caught is not None:
                    failovers.append({"attempt": attempt, "aggregator": sender, "why": caught})
                    attempt += 1
                    continue
                return {
                    "aggregator": sender,
                    "attempt": attempt,
                    "announcement": body,
                    "received": received if needs else None,
                    "failovers": failovers,
                    **({"offered_late": late_offer} if late_offer else {}),
                    **audit,
                }
            agg = order[attempt]
            self._secure_member(plan, attempt, agg, own)
            if agg == self.id:

                def superseded(attempt: int = attempt) -> bool:
                    return self._superseding(r, attempt) is not None

                out = await self.role.aggregate(plan, attempt, own, superseded)
                if out is None:
                    later = self._superseding(r, attempt) or attempt + 1
                    failovers.append({"attempt": attempt, "aggregator": agg, "why": "superseded"})
                    attempt = later
                    continue
                announcement, received, facts, server_facts = out
                sent = self._sent(r, announcement, own)
                caught, audit = await self.audit.check(
                    plan, attempt, agg, announcement, None, sent, self._superseded_at(r, attempt)
                )
                if caught is not None:  # the swarm fails the round over: so does this node
                    failovers.append({"attempt": attempt, "aggregator": agg, "why": caught})
                    attempt += 1
                    continue
                return {
                    "aggregator": agg,
                    "attempt": attempt,
                    "announcement": announcement,
                    "received": received,
                    "failovers": failovers,
                    **facts,
                    **audit,
                    "server_facts": server_facts,  # the method's: under the record's "method"
                }
            if agg in self.audit.convicted:  # an auditor caught it: every member skips it alike
                failovers.append({"attempt": attempt, "aggregator": agg, "why": "convicted"})
                attempt += 1
                continue
            cut_off = await self.reach.check(agg)  # presence, the direct lane, bridges
            if cut_off is not None:
                failovers.append({"attempt": attempt, "aggregator": agg, "why": cut_off})
                attempt += 1
                continue
            svc.publish_status(r, "waiting")  # for this attempt's aggregator
            if own is not None:
                try:
                    await self.tr.send(agg, "report", r, own, attempt=attempt)
                except TransportError as exc:
                    log.warning("%s: round %d: report to %s failed: %s", self.id, r, agg, exc)
            if attempt > 0 and r in self._late_offers:  # attempt 0 had it when it was made
                try:
                    await self.tr.send(agg, "report", r, self._late_offers[r], attempt=attempt)
                except TransportError as exc:
                    log.warning("%s: round %d: late offer to %s failed: %s", self.id, r, agg, exc)
            deadline = time.monotonic() + cfg.timing.aggregator_timeout

            def settled(attempt: int = attempt, agg: str = agg) -> bool:
                return (
                    any(a >= attempt for a in self._announced.get(r, {}))
                    or not waits_on(svc, agg, r)
                    or self.reach.cut_off(agg) is not None
                    or self._wanted.get(r, 0) > attempt
                    or self._behind(r) is not None
                )

            async with self.reach.watching(lambda agg=agg: [agg]):
                await svc.wait_for(settled, deadline)
            self._check_behind(r)
            if any(a >= attempt for a in self._announced.get(r, {})):
                continue  # taken at the top of the loop
            if self._wanted.get(r, 0) > attempt:
                failovers.append({"attempt": attempt, "aggregator": agg, "why": "taken over"})
                attempt = self._wanted[r]
                continue
            if (svc.reported_round(agg) or 0) >= r:  # it settled the round without us
                raise _Behind(r)
            why = self.reach.cut_off(agg) or "deadline"
            log.warning("%s: round %d: aggregator %s %s; next peer", self.id, r, agg, why)
            failovers.append({"attempt": attempt, "aggregator": agg, "why": why})
            attempt += 1
        log.warning("%s: round %d: no aggregator finished the round", self.id, r)
        return {
            "aggregator": None,
            "attempt": attempt,
            "announcement": None,
            "received": None,
            "failovers": failovers,
        }

    async def _observe(self, after: int) -> dict[str, Any] | None:
        """Wait for the first announcement of a round after ``after`` (any member may have
        sent it: this node does not know that round's roster) and pull what a non-uploader
        gets. Returns the settle facts, or None when nothing came before the deadline; raises
        :class:`_Behind` when presence shows the swarm :data:`LAG_ROUNDS` past ``after``."""
        svc, cfg = self.services, self.cfg
        await self._hear(None)  # the next roster is unknown: any member may aggregate
        if self._newest is not None and self._newest[0] > after:  # heard while behind
            r, attempt, sender, body = self._newest
            self._announced.setdefault(r, {})[attempt] = (sender, body)
        deadline = time.monotonic() + cfg.timing.startup_timeout_s + cfg.timing.aggregator_timeout
        while True:
            # the swarm may be further on than ``after`` said (a node that resumes from a
            # freeze decides on the presence it held before its reconnect): announcements of
            # its rounds are then too far to keep, so presence that shows it ahead restarts
            # the catch-up from there rather than waiting for an announcement never kept
            def heard() -> bool:
                return (
                    any(r > after for r in self._announced) or self._behind(after + 1) is not None
                )

            if not await svc.wait_for(heard, deadline):
                return None
            if not any(r > after for r in self._announced):
                self._check_behind(after + 1)  # raises _Behind: the run loop catches up
            r = max(r for r in self._announced if r > after)  # the newest: the current model
            attempt = max(self._announced[r])
            sender, body = self._announced[r][attempt]
            self.current = (r, attempt)
            received = None
            if body["common"] or self.id in body["receivers"]:
                received, error = await self._pull_result(sender, r, attempt)
                if error is not None:
                    log.warning("%s: catching up on round %d: %s", self.id, r, error)
                    del self._announced[r][attempt]
                    if not self._announced[r]:
                        del self._announced[r]
                    continue
            return {
                "round": r,
                "aggregator": sender,
                "attempt": attempt,
                "announcement": body,
                "received": received,
                "failovers": [],
            }

    # ------------------------------------------------------------------ one round
    async def _round(self, plan: RoundPlan | None, after: int) -> tuple[dict[str, Any], RoundPlan]:
        """Run one round as a member (``plan`` given) or as an observer (``plan`` None,
        waiting for the first round after ``after``); returns the record and the next plan."""
        svc, cfg, alg = self.services, self.cfg, self.alg
        meter = svc.meter()
        participated = False
        trained: TrainOutcome | None = None
        lr = round_lr(cfg.training, plan.round if plan else after + 1)
        svc.begin_round(plan.round if plan is not None else after + 1)
        self.reach.begin_round()
        if plan is not None:
            r = plan.round
            self.rosters[r] = plan.roster
            self.current = (r, 0)
            await self._hear(self.hearing(plan, 0))
            self.role.round_started(r)
            participated = self.id in plan.participants
            own = None
            if participated:
                svc.publish_status(r, "training")
                trained = await svc.train(r)
                self.role.keep_upload(r, await asyncio.to_thread(alg.upload))
                n = svc.claimed_samples(len(svc.data.train_y), r)
                own = {
                    "n": n,
                    "report": alg.report(trained.result, lr),
                    "lineage": self.lineage.name,
                }
            t_comm = time.monotonic()
            settled = await self._settle(plan, participated, own)
            if self.secure is not None:  # the member's part, beside the aggregator's facts
                self.secure.stop_member()
                mine = self.secure.member_facts(r)
                settled["secagg"] = {
                    **({"member": mine} if mine else {}),
                    **settled.get("secagg", {}),
                }
        else:
            t_comm = time.monotonic()
            svc.publish_status(after + 1, "waiting")  # for the next announcement
            settled = await self._observe(after)
            if settled is None:
                raise TimeoutError(f"no announcement heard after round {after}")
            r = settled.pop("round")
        comm_s = time.monotonic() - t_comm
        facts: dict[str, Any] = {}
        apply_error: str | None = None
        if settled["received"] is not None:
            before = alg.checkpoint()
            try:
                facts = await asyncio.to_thread(
                    alg.apply, settled["received"], settled["announcement"]
                )
            except (ValueError, RuntimeError) as exc:  # the aggregator's bytes are untrusted
                alg.restore(before)
                svc.drop("bad_result", f"round {r} from {settled['aggregator']}: {exc}")
                settled["received"] = None
                apply_error = str(exc)
            else:
                body = settled["announcement"] or {}
                svc.merged_from = sorted({settled["aggregator"], *body.get("aggregated", [])})
        if settled["announcement"] is not None and apply_error is None:
            self.lineage.adopt(settled["announcement"])  # its model is the one now held
        self.applied = r
        svc.publish_status(r, "evaluating")
        evaluated = await svc.evaluate()
        announcement = settled.pop("announcement")
        received = settled.pop("received")
        server_facts = settled.pop("server_facts", None)
        if announcement is not None:
            nxt = announced_plan(alg, cfg.seed, r + 1, announcement)
        else:  # nobody finished the round: go on with whoever is still here
            server = plan.server if plan is not None else {}
            await self._hear(None)  # on a live view of every member
            nxt = draw_plan(alg, cfg.seed, r + 1, live_members(svc), server)
        aggregated = announcement["aggregated"] if announcement else []
        if announcement is not None:  # what the round counted, and how fast it reported
            who = plan.participants if plan is not None else None
            self._counted[r] = (who, aggregated, announcement.get("late", {}))
            if "report_s" in announcement:
                self.role.latencies.append(announcement["report_s"])
        fields = {
            "participated": participated,
            "aggregated": aggregated,
            "observer": plan is None,
            "received": received is not None,
            "roster": plan.roster if plan else None,
            "lineage": self.lineage.name,
            **settled,  # aggregator, attempt, failovers (and the aggregator's own facts)
        }
        if cfg.timing.quorum is not None:  # semi-asynchronous rounds
            body = announcement or {}
            fields["late"] = body.get("late", {})  # late uploads counted: their staleness
            fields["closed_without"] = body.get("closed_without", [])
        if plan is not None and plan.drawn is not None:  # a client fraction below 1
            fields["drawn"] = plan.drawn
            fields["sat_out"] = self.id not in plan.drawn  # it still applies and evaluates
        if apply_error is not None:
            fields["apply_error"] = apply_error
        record = svc.round_record(
            r,
            meter=meter,
            evaluated=evaluated,
            lr=lr,
            trained=trained,
            comm_s=comm_s,
            peers=aggregated,
            driver=fields,
            method=(server_facts, facts),  # then after_train's (trained.facts)
        )
        self._forget_old(r)
        return record, nxt

    # ------------------------------------------------------------------ lifecycle
    def _swarm_round(self) -> int:
        """The latest round an online member reports having finished (0: none)."""
        return self.services.swarm_round(sorted(self.members - {self.id}))

    def first_plan(self) -> RoundPlan | None:
        """Round 1's plan on the topology's members (a member absent at the start sits in
        round 1's roster; nobody waits on it, and round 2's roster, drawn from the
        aggregator's live presence, leaves it out), or None when this node joins a swarm
        already under way (a heard peer's presence reports a finished round) or resumes
        from a checkpoint."""
        if self._swarm_round() >= 1 or self.services.resumed_round >= 1:
            return None
        roster = sorted(self.members)  # every node draws the same, whatever it hears
        server = self.alg.initial_server_state(roster)
        return draw_plan(self.alg, self.cfg.seed, 1, roster, server)

    async def _start_observing(self, after: int) -> None:
        """Skip to observing the round after ``after``: announcements of the rounds before are
        stale, and peers learn not to wait on this node before round ``after + 2``."""
        self.applied = max(self.applied, after)
        self.current = (after, 0)
        await self.services.report_round(after, joined=after + 2)

    async def run(self) -> None:
        """Every round from round 1, or, when the swarm is under way (or this node resumes,
        or falls :data:`~p2pfl.services.peers.LAG_ROUNDS` behind), from the next announcement
        on (observing first)."""
        svc, cfg = self.services, self.cfg
        await follow_bridges(svc)
        plan = self.first_plan()
        after = 0
        if plan is None:
            after = max(self._swarm_round(), svc.resumed_round)
            log.info("%s: swarm under way (round %d); catching up", self.id, after)
            await self._start_observing(after)
        caught_up_from: int | None = None
        while True:
            if plan is not None and await svc.sit_out_offline(plan.round):
                after, plan = max(self._swarm_round(), plan.round - 1), None  # catch up
                await self._start_observing(after)
            if plan is not None and self.id not in plan.roster:
                log.info("%s: not in round %d's roster; observing", self.id, plan.round)
                after, plan = plan.round - 1, None
            if plan is not None and (ahead := self._behind(plan.round)) is not None:
                log.warning(
                    "%s: the swarm finished round %d, this node is at %d: catching up",
                    self.id,
                    ahead,
                    plan.round,
                )
                caught_up_from, after, plan = plan.round, ahead, None
                await self._start_observing(after)
            if plan is not None and plan.round > cfg.rounds:
                break
            if plan is None and after >= cfg.rounds:
                break
            try:
                record, plan = await self._round(plan, after)
            except TimeoutError as exc:
                log.warning("%s: stopping: %s", self.id, exc)
                break
            except _Behind as behind:
                log.warning(
                    "%s: the swarm finished round %d while this node settled round %d: catching up",
                    self.id,
                    behind.round,
                    self.current[0],
                )
                caught_up_from, after, plan = self.current[0], behind.round, None
                await self._start_observing(after)
                continue
            if caught_up_from is not None:
                record["caught_up_from"], caught_up_from = caught_up_from, None
            after = record["round"]
            observer = " (observer)" if record["observer"] else ""
            await svc.finish_round(
                record, f"aggregator {record['aggregator']} attempt {record['attempt']}{observer}"
            )
            await svc.report_round(record["round"])
