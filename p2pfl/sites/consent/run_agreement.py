"""How a site takes part in agreeing on runs, without a server (docs/design.md, "Site
policy"): :class:`RunAgreement` takes every message the broker brings (specs, votes,
commits, cancels; data reports and trust go to the series and the trust), and acts on it.

Agreement on retained messages (:mod:`p2pfl.sites.consent.messages`) under
``p2pfl/<swarm>/sites/``:

1. **spec**: ``p2pfl submit`` asks the local daemon to publish a run spec; its ``run_id``
   is the hash of the canonical spec (:func:`~p2pfl.sites.consent.run_spec.run_id`).
2. **vote**: every daemon the spec names (or every daemon, for ``members: any``) checks its
   policy (:func:`~p2pfl.sites.policy.rules.decide`) and publishes ``accept``, ``reject`` or
   ``pending`` with the reasons and the digest of the policy it checked. ``p2pfl vote``
   decides a pending one.
3. **commit**: the proposer publishes the accepted sites
   (:func:`~p2pfl.sites.consent.agreement.tally`), or ``aborted`` with the reason, as soon as
   the votes decide the run (:func:`~p2pfl.sites.consent.agreement.decided`: every site the
   spec names has voted; for ``members: any``, ``quorum.min_accept`` sites accepted and
   every site this daemon has heard from voted, or a grace has passed since the quorum:
   :func:`~p2pfl.sites.consent.agreement.commit_grace_s`), else at the deadline (the spec's
   time + ``vote_deadline_s``). Without a commit, the accepted sites commit in turn, one grace period apart
   (:func:`~p2pfl.sites.consent.agreement.committers`, :func:`~p2pfl.sites.consent.agreement.grace_s`). Of
   several commits, the first-ranked committer's stands
   (:func:`~p2pfl.sites.consent.agreement.winning_commit`): a member of another stops.
4. **run**: a committed member checks its policy again (stage ``commit``), and starts a
   worker (:class:`~p2pfl.sites.runs.worker.RunWorker`) when a slot is free
   (``limits.max_concurrent_runs``; else the run waits as ``pending`` with the reason). Its
   policy is checked again at every round the worker finishes (stage ``round``).
5. **cancel**: the proposer's cancel stops the run everywhere; a member's means it leaves.

A site votes only before the deadline, and joins a committed run only when it holds a vote
of its own on it: one cast in this life, or kept in its ledger across a restart. A daemon
that comes back on an empty ``state_dir`` hears its old accept among the retained messages,
and does not vote again nor train that run again (:data:`NO_VOTE`): on a spec heard among
them, it votes only once they are all in (:meth:`RunAgreement._settled`), and only if no
vote of its own came with them. A commit turn comes no sooner than
:data:`SETTLE_S` after the spec was heard, or after the last message the broker sent as
retained (a spec published live comes after those), so the retained commit of a finished
run arrives first.

A commit is taken from the proposer or from a site whose ``accept`` this daemon heard, and
only once every member it names has been heard accepting; one published before the deadline
(by the signer's clock) is refused, but the proposer's: its ``aborted`` of a run out of
reach, and its commit once the votes this daemon heard decide the run (held until then).
Every message that fails these checks, or :func:`~p2pfl.sites.consent.messages.decode`, is dropped,
logged and counted.

The ledger (:class:`~p2pfl.sites.consent.ledger.ConsentLedger`, ``state_dir/ledger.sqlite``) keeps
every spec, vote and commit as its signed bytes, and the run's status at this site.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict

from p2pfl.algorithms.cards.probe import OutsideCode
from p2pfl.errors import ConfigError
from p2pfl.sites.consent import messages as M
from p2pfl.sites.consent.agreement import (
    commit_grace_s,
    committers,
    grace_s,
    tally,
    winning_commit,
)
from p2pfl.sites.consent.ledger import FINAL, LedgerError, RunEntry
from p2pfl.sites.consent.run_spec import RunSpec, run_id, spec_from_dict
from p2pfl.sites.consent.run_state import RunState
from p2pfl.sites.consent.site_status import read_status
from p2pfl.sites.daemon.context import SiteContext
from p2pfl.sites.policy.rules import Decision, Reason
from p2pfl.sites.runs.series import SeriesCycles
from p2pfl.sites.runs.slots import WorkerSlots
from p2pfl.sites.trust.crl_updates import TrustUpdates

log = logging.getLogger("p2pfl.sites.daemon")

VOTES = ("accept", "reject", "pending")
NO_VOTE = (
    "this site holds no vote of its own on the run (it came after the vote, or its state_dir "
    "was reset since it voted): it does not join"
)
SETTLE_S = 2.0  # a spec heard this recently may still have its retained commit on the way
EARLY_SLACK_S = 1.0  # a commit this much before the deadline (clock skew) is still taken
MAX_EARLY = 10_000  # votes, commits and cancels kept for runs whose spec is not heard yet
LOST_AFTER_S = 10.0  # after connecting, the retained messages of the runs left open are in


class RunAgreement:
    """This site's part in the agreement on every run, over the daemon's ``ctx``: the
    ``slots`` start and end its workers, the ``series`` take data reports (and standing
    acceptance), the ``trust`` takes the swarm's CRLs. :attr:`sites_heard`: the sites whose
    messages came, those who could have voted."""

    def __init__(
        self,
        ctx: SiteContext,
        slots: WorkerSlots,
        series: SeriesCycles,
        trust: TrustUpdates,
    ):
        self.ctx = ctx
        self.slots = slots
        self.series = series
        self.trust = trust
        self._checking: set[str] = set()  # run ids whose spec is being validated
        self._early: dict[str, list[tuple[M.SiteMessage, bytes]]] = defaultdict(list)
        self.sites_heard: set[str] = {ctx.name}

    # ------------------------------------------------------------------ what comes in
    def on_message(self, topic: str, payload: bytes) -> None:
        """One message from the broker: decoded and checked, applied, or dropped."""
        try:
            msg = M.decode(self.ctx.swarm, topic, payload, self.ctx.verifier)
        except M.MessageRefused as exc:
            self.ctx.drop(topic, exc.reason, str(exc))
            return
        if msg is None:  # a retained message cleared
            return
        if len(self.sites_heard) < MAX_EARLY:
            self.sites_heard.add(msg.site)
        try:
            self._apply(msg, payload, topic)
        except (LedgerError, ValueError, KeyError, TypeError) as exc:
            self.ctx.drop(topic, "bad_body", str(exc))

    def _apply(self, msg: M.SiteMessage, payload: bytes, topic: str) -> None:
        if msg.kind == "spec":
            self._on_spec(msg, payload, topic)
            return
        if msg.kind == "data":  # on a series' id, not a run's
            self.series.on_data(msg)
            return
        if msg.kind == "trust":
            self.trust.on_trust(msg)
            return
        st = self.ctx.runs.get(msg.run_id)
        if st is None:  # retained messages come in any order: the spec may follow
            if sum(len(v) for v in self._early.values()) < MAX_EARLY:
                self._early[msg.run_id].append((msg, payload))
            return
        {
            "vote": self._on_vote,
            "commit": self._on_commit,
            "cancel": self._on_cancel,
            "status": self._on_status,
        }[msg.kind](st, msg, payload)

    def _on_spec(self, msg: M.SiteMessage, payload: bytes, topic: str) -> None:
        if msg.run_id in self.ctx.runs or msg.run_id in self._checking:
            return
        self._checking.add(msg.run_id)
        retained = self.ctx.link.retained
        self.ctx.spawn(None, self._check_spec(msg, payload, topic, retained))

    async def _check_spec(
        self, msg: M.SiteMessage, payload: bytes, topic: str, retained: bool
    ) -> None:
        """Validate a spec by its method's card (nothing imported), check its outside code
        in a child process where this site is asked and its policy allows plugins, then
        take it (``retained``: it came among the messages the broker held)."""
        try:
            spec = spec_from_dict(msg.body.get("spec"), f"spec of run {msg.run_id}")
            asked = spec.members == "any" or self.ctx.name in spec.members
            outside = await self.ctx.outside_checks.check(spec) if asked else None
            if asked:  # its binding as it is now (checked again if its files changed)
                await self.ctx.bindings.refresh(spec.data)
        except (ConfigError, ValueError, TypeError, AttributeError) as exc:  # not a spec
            self.ctx.drop(topic, "bad_spec", str(exc).splitlines()[0])
            return
        finally:
            self._checking.discard(msg.run_id)
        try:
            self._take_spec(msg, payload, topic, spec, outside, retained)
        except (LedgerError, ValueError, KeyError, TypeError) as exc:
            self.ctx.drop(topic, "bad_body", str(exc))

    def _take_spec(
        self,
        msg: M.SiteMessage,
        payload: bytes,
        topic: str,
        spec: RunSpec,
        outside: OutsideCode | None = None,
        retained: bool = False,
    ) -> None:
        if run_id(spec) != msg.run_id:
            self.ctx.drop(topic, "mismatch", "the run_id is not the spec's hash")
            return
        assert self.ctx.ledger is not None
        try:
            fresh = self.ctx.ledger.propose(
                msg.run_id, spec.name, msg.site, spec.model_dump(mode="json"), payload
            )
        except LedgerError as exc:
            self.ctx.drop(topic, "conflict", str(exc))
            return
        st = RunState(msg.run_id, spec, msg.site, msg.ts, outside=outside)
        self.ctx.runs[msg.run_id] = st
        for early, raw in self._early.pop(msg.run_id, []):
            try:  # one bad early message must not stop this spec's own handling
                self._apply(early, raw, "")
            except (LedgerError, ValueError, KeyError, TypeError) as exc:
                where = M.topic(self.ctx.swarm, early.kind, early.run_id, early.site)
                self.ctx.drop(where, "bad_body", str(exc))
        entry = self.ctx.ledger.run(st.run_id)
        assert entry is not None
        if entry.status in FINAL:
            return
        asked = spec.members == "any" or self.ctx.name in spec.members
        if not fresh and self.ctx.name in entry.votes:  # this ledger voted, before a restart
            st.decision = self.ctx.decide(st, "vote")
        elif asked and not retained:
            self._vote_if_open(st)
        elif asked:  # among the retained messages: its own old vote may come after it
            self.ctx.spawn(st, self._vote_when_settled(st))
        self.ctx.spawn(st, self._commit_turns(st))
        self.ctx.count_runs()

    def _vote_if_open(self, st: RunState) -> None:
        """Vote on ``st`` unless a vote of this site's is heard (one it cast before its
        state_dir was reset among them), the run ended here, or the deadline is past."""
        if self.ctx.name in st.votes or self.ctx.final(st):
            return
        if time.time() < st.deadline:
            self.vote(st)

    async def _vote_when_settled(self, st: RunState) -> None:
        """Vote on a spec heard among the retained messages once they are all in
        (:meth:`_settled`): the broker may send this site's own old vote after the spec."""
        while not self._settled(st):
            await asyncio.sleep(0.1)
        self._vote_if_open(st)

    def vote(self, st: RunState, operator: bool | None = None) -> None:
        """Decide on ``st`` and publish the vote (``operator``: a pending one decided)."""
        decision = self.series.standing(st, self.ctx.decide(st, "vote"))
        if self.ctx.draining and decision.vote != "reject":
            decision = Decision(
                "reject",
                (Reason("draining", "this site takes no new runs (p2pfl drain)"),),
                decision.policy,
                decision.dp_epsilon,
            )
        elif operator is not None and decision.vote == "pending":
            vote = "accept" if operator else "reject"
            reasons = () if operator else (Reason("operator_rejected", "rejected by p2pfl vote"),)
            decision = Decision(vote, reasons, decision.policy, decision.dp_epsilon)
        st.decision = decision
        if decision.vote == "reject":
            for reason in decision.reasons:
                self.ctx.metrics.rejected(reason.code)
        else:  # it may train this run soon: its worker starts warm
            self.slots.warm_up()
        log.info(
            "%s: run %s (%s, proposed by %s): %s%s",
            self.ctx.name,
            st.run_id,
            st.spec.name,
            st.proposer,
            decision.vote,
            "".join(f"; {r.code}: {r.detail}" for r in decision.reasons),
        )
        self.ctx.spawn(st, self.ctx.publish("vote", st.run_id, decision.as_record()))

    def _on_vote(self, st: RunState, msg: M.SiteMessage, payload: bytes) -> None:
        body = msg.body
        if body.get("vote") not in VOTES or not isinstance(body.get("reasons", []), list):
            raise ValueError("a vote is accept, reject or pending, with a list of reasons")
        if not isinstance(body.get("policy", ""), str):
            raise ValueError("a vote's policy is a digest")
        assert self.ctx.ledger is not None
        self.ctx.ledger.vote(st.run_id, msg.site, body, payload)
        st.votes[msg.site] = body
        for committer, (held, raw) in list(st.held.items()):  # commits waiting on votes
            if self._commit_ok(st, committer, held) is None:
                del st.held[committer]
                self._take_commit(st, committer, held, raw)

    async def end_lost_runs(self, reopened: list[RunEntry]) -> None:
        """Abort the runs the ledger held open when the daemon started (``reopened``:
        proposed, committed) that no retained message brought back, once every committer's
        turn is past: the broker lost their messages (it restarted without persistence while
        this daemon was down), no commit will come, and the run went on, or aborted, without
        this site."""
        left = {e.run_id: e for e in reopened}
        if not left:
            return
        await self.ctx.link.connected.wait()
        await asyncio.sleep(LOST_AFTER_S)
        ledger = self.ctx.ledger
        assert ledger is not None
        while left:
            for rid, entry in list(left.items()):
                if rid in self.ctx.runs:  # heard again: it goes on as any run
                    del left[rid]
                    continue
                if rid in self._checking:
                    continue
                accepted = [s for s, v in entry.votes.items() if v["vote"] == "accept"]
                vote_s = float(entry.spec["vote_deadline_s"])
                turns = len(committers(rid, entry.proposer, accepted)) + 2
                if time.time() > entry.proposed_at + vote_s + turns * grace_s(vote_s):
                    del left[rid]
                    why = (
                        "not heard again after this daemon restarted (the broker no longer "
                        "holds its messages) and every committer's turn is past"
                    )
                    ledger.set_status(rid, "aborted", why)
                    log.warning("%s: run %s aborted: %s", self.ctx.name, rid, why)
                    self.ctx.count_runs()
            await asyncio.sleep(1.0)

    # ------------------------------------------------------------------ commits
    async def _commit_turns(self, st: RunState) -> None:
        """Commit ``st`` when it is this site's turn and no commit came: the proposer at the
        deadline (at once when its quorum is out of reach), the k-th ranked accepted site k
        grace periods later; a non-committer stops once every committer's turn is long past."""
        grace = grace_s(st.spec.vote_deadline_s)
        quorum_at: float | None = None  # when a run open to any site reached its quorum
        while not st.commits and not self.ctx.final(st):
            accepted = st.accepted()
            if st.decision is not None and st.decision.vote == "accept":
                accepted.add(self.ctx.name)  # its own vote may not be back from the broker
            order = committers(st.run_id, st.proposer, accepted)
            now = time.time()
            settled = self._settled(st)
            before = self.ctx.name == st.proposer and now < st.deadline
            ready = before and st.decided()
            if ready and st.spec.members == "any" and not self._all_heard_voted(st):
                # a grace for the sites this daemon knows that have not voted yet
                quorum_at = quorum_at if quorum_at is not None else time.monotonic()
                waited = time.monotonic() - quorum_at
                ready = waited >= commit_grace_s(st.spec.vote_deadline_s)
            if self.ctx.name in order and settled:
                # the proposer commits once the votes decide the run, and aborts at once a
                # run that can no longer commit
                early = ready or (before and st.out_of_reach() is not None)
                if early or now >= st.deadline + order.index(self.ctx.name) * grace:
                    await self._commit(st)
                    return
            elif now > st.deadline + (len(order) + 2) * grace:
                return
            await asyncio.sleep(0.25)

    def _settled(self, st: RunState) -> bool:
        """Whether a retained commit of ``st`` would be in by now: :data:`SETTLE_S` after its
        spec was heard, or after the last message the broker sent this subscription as
        retained (a spec heard live, after them, has no retained commit still on the way)."""
        now = time.monotonic()
        return now - st.heard_at >= SETTLE_S or now - self.ctx.link.retained_at >= SETTLE_S

    def _all_heard_voted(self, st: RunState) -> bool:
        """Whether every site this daemon has heard from has voted on ``st`` (not pending)."""
        return all(
            st.votes.get(s, {}).get("vote") in ("accept", "reject") for s in self.sites_heard
        )

    async def _commit(self, st: RunState) -> None:
        counted = tally(
            st.vote_values(), st.spec.quorum.min_accept, st.named(), expected=self.sites_heard
        )
        body = {"members": list(counted.members), "aborted": counted.aborted}
        early = st.out_of_reach() if time.time() < st.deadline else None
        if early and counted.aborted:  # the proposer's, at once (_commit_turns)
            body["aborted"] = f"before the deadline, {early}"
        log.info(
            "%s: commits run %s: %s",
            self.ctx.name,
            st.run_id,
            f"aborted, {counted.aborted}" if counted.aborted else ", ".join(counted.members),
        )
        await self.ctx.publish("commit", st.run_id, body)

    def _commit_ok(self, st: RunState, committer: str, body: dict) -> str | None:
        """Why a commit cannot be taken yet (its votes may still be on their way): None
        when it can. The proposer's commit before the deadline (``body["early"]``, set on
        arrival) waits until the votes heard here decide the run."""
        if committer != st.proposer and committer not in st.accepted():
            return "the committer neither proposed the run nor accepted it"
        missing = [m for m in body["members"] if m not in st.accepted()]
        if missing:
            return f"no accept heard from {', '.join(missing)}"
        if body.get("early") and not st.decided():
            return "before the deadline, and the votes heard here do not decide the run yet"
        return None

    def _on_commit(self, st: RunState, msg: M.SiteMessage, payload: bytes) -> None:
        body = msg.body
        members = body.get("members")
        aborted = body.get("aborted")
        if not isinstance(members, list) or not all(isinstance(m, str) for m in members):
            raise ValueError("a commit's members is a list of site names")
        if aborted is not None and not isinstance(aborted, str):
            raise ValueError("a commit's aborted is the reason or none")
        if aborted is None and len(members) < st.spec.quorum.min_accept:
            raise ValueError(f"{len(members)} members, fewer than quorum.min_accept")
        # before the deadline only the proposer commits: an abort of a run out of reach
        # (it may withdraw it any time: cancel), or the members once the votes decide it
        if msg.ts < st.deadline - EARLY_SLACK_S:
            if msg.site != st.proposer:
                self.ctx.drop(f"commit of {st.run_id} by {msg.site}", "early_commit")
                return
            if aborted is None:
                body = {**body, "early": True}
        why = self._commit_ok(st, msg.site, body)
        if why is not None:
            st.held[msg.site] = (body, payload)
            log.info("%s: commit of %s by %s held: %s", self.ctx.name, st.run_id, msg.site, why)
            return
        self._take_commit(st, msg.site, body, payload)

    def _take_commit(self, st: RunState, committer: str, body: dict, payload: bytes) -> None:
        assert self.ctx.ledger is not None
        self.ctx.ledger.commit(st.run_id, committer, body["members"], payload)
        st.commits[committer] = body
        winner = winning_commit(
            st.run_id, st.proposer, {c: tuple(b["members"]) for c, b in st.commits.items()}
        )
        if winner == st.acted_on:
            return
        chosen = st.commits[winner]
        st.acted_on = winner
        if chosen["aborted"] is not None:
            self.slots.end(st, "aborted", f"aborted by {winner}'s commit: {chosen['aborted']}")
            return
        members = tuple(sorted(chosen["members"]))
        previous, st.members = st.members, members
        if self.ctx.name not in members:
            if previous is not None and st.worker is not None:  # a lesser commit ran here
                log.warning(
                    "%s: run %s: %s's commit stands, without this site: leaving",
                    self.ctx.name,
                    st.run_id,
                    winner,
                )
            self.slots.end(st, "aborted", f"not among the members {winner} committed")
            return
        if previous is not None:
            return  # already under way with this site
        if st.decision is None:
            self.slots.end(st, "aborted", NO_VOTE)
            return
        self.ctx.set_status(st, "committed", f"committed by {winner}: {', '.join(members)}")
        decision = self.ctx.decide(st, "commit", members)
        if decision.vote == "reject":
            for reason in decision.reasons:
                self.ctx.metrics.rejected(reason.code)
            why = "; ".join(f"{r.code}: {r.detail}" for r in decision.reasons)
            self.slots.end(st, "aborted", f"policy at commit: {why}")
            self.ctx.spawn(
                st, self.ctx.publish("cancel", st.run_id, {"scope": "leave", "why": why})
            )
            return
        st.decision = decision
        self.slots.start_waiting()

    # ------------------------------------------------------------------ cancel
    def _on_status(self, st: RunState, msg: M.SiteMessage, payload: bytes) -> None:
        """A site's status of the run (its own included): kept in the ledger for ``p2pfl
        runs``, nothing else (information, never a decision); a malformed body is a
        ``ValueError`` (dropped, counted)."""
        assert self.ctx.ledger is not None
        self.ctx.ledger.site_status(st.run_id, msg.site, read_status(msg.body), msg.ts, payload)

    def _on_cancel(self, st: RunState, msg: M.SiteMessage, payload: bytes) -> None:
        scope = msg.body.get("scope")
        if scope not in ("run", "leave"):
            raise ValueError("a cancel's scope is run or leave")
        if scope == "run":
            if msg.site != st.proposer:
                self.ctx.drop(f"cancel of {st.run_id} by {msg.site}", "not_proposer")
                return
            self.slots.end(st, "cancelled", f"cancelled by its proposer {msg.site}")
        elif msg.site != self.ctx.name:
            log.info(
                "%s: %s left run %s: %s", self.ctx.name, msg.site, st.run_id, msg.body.get("why")
            )
