"""The site daemon (``p2pfl daemon --site site.yaml``): long-lived, in the foreground, one
per site. It joins its federation's broker, admits runs by the site's own policy and trains
each admitted run in a worker process (docs/design.md, "Site policy").

Agreement without a server, on retained messages (:mod:`p2pfl.sites.consent.messages`) under
``p2pfl/<swarm>/sites/``:

1. **spec**: ``p2pfl submit`` asks the local daemon to publish a run spec; its ``run_id``
   is the hash of the canonical spec (:func:`~p2pfl.sites.consent.run_spec.run_id`).
2. **vote**: every daemon the spec names (or every daemon, for ``members: any``) checks its
   policy (:func:`~p2pfl.sites.policy.rules.decide`) and publishes ``accept``, ``reject`` or
   ``pending`` with the reasons and the digest of the policy it checked. ``p2pfl vote``
   decides a pending one.
3. **commit**: at the deadline (the spec's time + ``vote_deadline_s``) the proposer
   publishes the accepted sites (:func:`~p2pfl.sites.consent.agreement.tally`), or ``aborted`` with
   the reason. Without a commit, the accepted sites commit in turn, one grace period apart
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
and does not train that run again (:data:`NO_VOTE`). A commit turn comes no sooner than
:data:`SETTLE_S` after the spec was heard, so the retained commit of a finished run arrives
first.

A commit is taken from the proposer or from a site whose ``accept`` this daemon heard, and
only once every member it names has been heard accepting; one published before the deadline
(by the signer's clock) is refused, but the proposer's ``aborted`` of a run out of reach.
Every message that fails these checks, or :func:`~p2pfl.sites.consent.messages.decode`, is dropped,
logged and counted.

The ledger (:class:`~p2pfl.sites.consent.ledger.ConsentLedger`, ``state_dir/ledger.sqlite``) keeps
every spec, vote and commit as its signed bytes, and the run's status at this site.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import aiomqtt

from p2pfl.algorithms.cards.probe import OutsideCode
from p2pfl.check.load import ConfigError
from p2pfl.sites.consent import messages as M
from p2pfl.sites.consent.agreement import committers, grace_s, tally, winning_commit
from p2pfl.sites.consent.ledger import FINAL, NEXT, ConsentLedger, LedgerError
from p2pfl.sites.consent.run_spec import RunSpec, run_id, spec_from_dict
from p2pfl.sites.consent.run_state import RunState
from p2pfl.sites.daemon.admin_commands import AdminCommands
from p2pfl.sites.daemon.admin_socket import AdminServer
from p2pfl.sites.daemon.json_log import run_context
from p2pfl.sites.daemon.observe import ObservabilityServer, SiteMetrics, parse_listen
from p2pfl.sites.daemon.site_file import SiteFile
from p2pfl.sites.daemon.systemd import Notifier
from p2pfl.sites.policy.binding_watch import BindingWatch
from p2pfl.sites.policy.rules import Decision, Reason
from p2pfl.sites.policy.verdict import OutsideCodeChecks, judge
from p2pfl.sites.runs.processes import ServingProcess
from p2pfl.sites.runs.series import SeriesCycles
from p2pfl.sites.runs.slots import WorkerSlots
from p2pfl.sites.trust.crl_updates import TrustUpdates

log = logging.getLogger(__name__)

VOTES = ("accept", "reject", "pending")
NO_VOTE = (
    "this site holds no vote of its own on the run (it came after the vote, or its state_dir "
    "was reset since it voted): it does not join"
)
SETTLE_S = 2.0  # a spec heard this recently may still have its retained commit on the way
EARLY_SLACK_S = 1.0  # a commit this much before the deadline (clock skew) is still taken
MAX_EARLY = 10_000  # votes, commits and cancels kept for runs whose spec is not heard yet


class SiteDaemon(WorkerSlots, SeriesCycles, TrustUpdates, AdminCommands):
    """The daemon of ``site`` (a loaded site file). Run it with :meth:`run`: it returns 0
    once drained, and stops (its workers too) when cancelled."""

    def __init__(self, site: SiteFile, *, broker: str | None = None):
        self.site = site
        self.name = site.site
        self.swarm = site.swarm
        self.broker = broker or site.broker  # host:port, resolved by the CLI from mdns
        self.state_dir = Path(site.state_dir)
        self.identity: M.SiteIdentity | None = None
        self.verifier: M.SiteVerifier | None = None
        if site.certs is not None:
            self.identity = M.SiteIdentity.from_certs(site.certs, site.site)
            self.verifier = M.SiteVerifier.from_certs(site.certs)
        self.metrics = SiteMetrics(site.site)
        self.runs: dict[str, RunState] = {}
        self._checking: set[str] = set()  # run ids whose spec is being validated
        self.outside_checks = OutsideCodeChecks(site.policy, self.state_dir)
        self._early: dict[str, list[tuple[M.SiteMessage, bytes]]] = defaultdict(list)
        self._client: aiomqtt.Client | None = None
        self._connected = asyncio.Event()
        self._draining = False
        self._drained = asyncio.Event()
        self.dropped: Counter[str] = Counter()
        self.sites_heard: set[str] = {self.name}  # whose messages came: who could vote
        self.ledger: ConsentLedger | None = None
        self.notifier = Notifier()
        self._init_series()
        self._init_trust()
        self.bindings = BindingWatch(site)  # each binding checked before the first vote
        self.serving: ServingProcess | None = None
        if site.serving.listen is not None:
            if site.source is None:
                raise ValueError(f"site {site.site}: serving needs a site loaded from its file")
            self.serving = ServingProcess(site.source, self.state_dir / "serving.log")

    # ------------------------------------------------------------------ lifecycle
    async def run(self) -> int:
        """Serve until drained (0) or cancelled; workers still running are stopped."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.ledger = ConsentLedger(self.state_dir / "ledger.sqlite")
        await self.bindings.start()
        self._recover()
        if self.identity is None:
            log.warning(
                "%s: no certs in the site file: specs, votes and commits travel unsigned "
                "and unsigned ones are taken (a trial on one machine only)",
                self.name,
            )
        http = None
        if self.site.observability.listen is not None:
            host, port = parse_listen(self.site.observability.listen)
            http = ObservabilityServer(host, port, self.metrics, self.not_ready)
        admin = AdminServer(self.state_dir, self.handle)
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(admin)
            if http is not None:
                await stack.enter_async_context(http)
            mqtt = asyncio.create_task(self._mqtt_loop())
            pulse = asyncio.create_task(self._watchdog())
            tasks = [mqtt, pulse]
            tasks += [
                asyncio.create_task(self._series_ticks()),
                asyncio.create_task(self._watch_data()),
                asyncio.create_task(self.bindings.watch()),
            ]
            if self.serving is not None:
                tasks.append(asyncio.create_task(self.serving.run()))
            try:
                await self._connected.wait()
                self.notifier.ready(f"site {self.name}: connected to {self.broker}")
                log.info(
                    "%s: site daemon of swarm %s ready (broker %s, admin socket %s)",
                    self.name,
                    self.swarm,
                    self.broker,
                    admin.path,
                )
                await self._drained.wait()
                return 0
            finally:
                self.notifier.stopping()
                await self._stop_workers("the site daemon stopped")
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                for st in self.runs.values():
                    for t in st.tasks:
                        t.cancel()
                self.ledger.close()

    def _recover(self) -> None:
        """A run this site was training when its daemon stopped has lost its worker."""
        assert self.ledger is not None
        for entry in self.ledger.runs():
            if entry.status == "running":
                self.ledger.set_status(entry.run_id, "failed", "the site daemon stopped")
        self._count_runs()

    async def _watchdog(self) -> None:
        interval = self.notifier.watchdog_interval()
        while True:
            await asyncio.sleep(interval or 3600)
            if interval:
                self.notifier.watchdog()

    def not_ready(self) -> list[str]:
        """Why the daemon is not ready (``/readyz``): none when it is."""
        why = []
        if not self._connected.is_set():
            why.append(f"broker {self.broker} not connected")
        if self._draining:
            why.append("draining")
        if self.serving is not None and self.serving.problem:
            why.append(self.serving.problem)
        if self.identity is not None:
            problem = self.identity.problem()
            if problem:
                why.append(f"certificate: {problem}")
        why += self.bindings.not_ready()  # a missing file, a label not in it, ...
        return why

    # ------------------------------------------------------------------ the broker
    def _host_port(self) -> tuple[str, int]:
        host, _, port = self.broker.rpartition(":")
        return host, int(port)

    async def _mqtt_loop(self) -> None:
        host, port = self._host_port()
        tls = None
        if self.site.certs is not None:
            from p2pfl.security.signing import tls_context

            tls = tls_context(self.site.certs, self.name)
        backoff = 0.5
        while True:
            try:
                async with aiomqtt.Client(
                    host,
                    port,
                    identifier=f"p2pfl-site-{self.swarm}-{self.name}-{uuid.uuid4().hex[:6]}",
                    keepalive=30,
                    tls_context=tls,
                    max_queued_outgoing_messages=1000,
                ) as client:
                    await client.subscribe(M.subscription(self.swarm), qos=1)
                    self._client = client
                    self._connected.set()
                    backoff = 0.5
                    async for message in client.messages:
                        payload = message.payload
                        if not isinstance(payload, (bytes, bytearray)):
                            payload = b"" if payload is None else str(payload).encode()
                        self._on_message(str(message.topic), bytes(payload))
            except aiomqtt.MqttError as exc:
                if self._connected.is_set():
                    log.warning(
                        "%s: broker %s lost (%s); reconnecting", self.name, self.broker, exc
                    )
                else:
                    log.debug("%s: broker %s: %s", self.name, self.broker, exc)
            self._client = None
            self._connected.clear()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _publish(self, kind: str, run: str, body: dict[str, Any]) -> None:
        """Publish this site's signed, retained ``kind`` message on ``run``; retried until
        the broker takes it."""
        topic, payload = M.encode(self.swarm, kind, run, self.name, body, self.identity)
        while True:
            await self._connected.wait()
            client = self._client
            if client is None:
                await asyncio.sleep(0.1)
                continue
            try:
                await client.publish(topic, payload, qos=1, retain=True)
            except aiomqtt.MqttError as exc:
                log.warning("%s: %s of run %s not published yet: %s", self.name, kind, run, exc)
                await asyncio.sleep(0.5)
                continue
            break
        # this site's own message is applied as it comes back from the broker

    def _spawn(self, st: RunState | None, coro) -> asyncio.Task:
        with run_context(run_id=st.run_id if st else None, node=self.name):
            task = asyncio.create_task(coro)
        if st is not None:
            st.tasks.append(task)
            task.add_done_callback(lambda t: st.tasks.remove(t) if t in st.tasks else None)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("%s: a daemon task failed", self.name, exc_info=task.exception())

    def _drop(self, topic: str, reason: str, detail: str = "") -> None:
        self.dropped[reason] += 1
        self.metrics.dropped(reason)
        log.warning(
            "%s: dropped %s: %s%s", self.name, topic, reason, f" ({detail})" if detail else ""
        )

    # ------------------------------------------------------------------ what comes in
    def _on_message(self, topic: str, payload: bytes) -> None:
        try:
            msg = M.decode(self.swarm, topic, payload, self.verifier)
        except M.MessageRefused as exc:
            self._drop(topic, exc.reason, str(exc))
            return
        if msg is None:  # a retained message cleared
            return
        if len(self.sites_heard) < MAX_EARLY:
            self.sites_heard.add(msg.site)
        try:
            self._apply(msg, payload, topic)
        except (LedgerError, ValueError, KeyError, TypeError) as exc:
            self._drop(topic, "bad_body", str(exc))

    def _apply(self, msg: M.SiteMessage, payload: bytes, topic: str) -> None:
        if msg.kind == "spec":
            self._on_spec(msg, payload, topic)
            return
        if msg.kind == "data":  # on a series' id, not a run's
            self._on_data(msg)
            return
        if msg.kind == "trust":
            self._on_trust(msg)
            return
        st = self.runs.get(msg.run_id)
        if st is None:  # retained messages come in any order: the spec may follow
            if sum(len(v) for v in self._early.values()) < MAX_EARLY:
                self._early[msg.run_id].append((msg, payload))
            return
        {"vote": self._on_vote, "commit": self._on_commit, "cancel": self._on_cancel}[msg.kind](
            st, msg, payload
        )

    def _on_spec(self, msg: M.SiteMessage, payload: bytes, topic: str) -> None:
        if msg.run_id in self.runs or msg.run_id in self._checking:
            return
        self._checking.add(msg.run_id)
        self._spawn(None, self._check_spec(msg, payload, topic))

    async def _check_spec(self, msg: M.SiteMessage, payload: bytes, topic: str) -> None:
        """Validate a spec by its method's card (nothing imported), check its outside code
        in a child process where this site is asked and its policy allows plugins, then
        take it."""
        try:
            spec = spec_from_dict(msg.body.get("spec"), f"spec of run {msg.run_id}")
            asked = spec.members == "any" or self.name in spec.members
            outside = await self.outside_checks.check(spec) if asked else None
            if asked:  # its binding as it is now (checked again if its files changed)
                await self.bindings.refresh(spec.data)
        except (ConfigError, ValueError, TypeError, AttributeError) as exc:  # not a spec
            self._drop(topic, "bad_spec", str(exc).splitlines()[0])
            return
        finally:
            self._checking.discard(msg.run_id)
        try:
            self._take_spec(msg, payload, topic, spec, outside)
        except (LedgerError, ValueError, KeyError, TypeError) as exc:
            self._drop(topic, "bad_body", str(exc))

    def _take_spec(
        self,
        msg: M.SiteMessage,
        payload: bytes,
        topic: str,
        spec: RunSpec,
        outside: OutsideCode | None = None,
    ) -> None:
        if run_id(spec) != msg.run_id:
            self._drop(topic, "mismatch", "the run_id is not the spec's hash")
            return
        assert self.ledger is not None
        try:
            fresh = self.ledger.propose(
                msg.run_id, spec.name, msg.site, spec.model_dump(mode="json"), payload
            )
        except LedgerError as exc:
            self._drop(topic, "conflict", str(exc))
            return
        st = RunState(msg.run_id, spec, msg.site, msg.ts, outside=outside)
        self.runs[msg.run_id] = st
        for early, raw in self._early.pop(msg.run_id, []):
            self._apply(early, raw, "")
        entry = self.ledger.run(st.run_id)
        assert entry is not None
        if entry.status in FINAL:
            return
        asked = spec.members == "any" or self.name in spec.members
        if not fresh and self.name in entry.votes:  # this ledger voted, before a restart
            st.decision = self._decide(st, "vote")
        elif asked and self.name not in st.votes and time.time() < st.deadline:
            self._vote(st)
        self._spawn(st, self._commit_turns(st))
        self._count_runs()

    def _decide(self, st: RunState, stage: str, members: tuple[str, ...] | None = None):
        return judge(
            st.spec,
            st.proposer,
            self.site.policy,
            self.site.data,
            stage=stage,  # type: ignore[arg-type]
            members=members,
            outside=st.outside,
            hours_trained=st.worker.hours() if st.worker else 0.0,
            # a running worker holds its data already: its files are checked before it starts
            binding_problems={} if stage == "round" else self.bindings.problems(st.spec.data),
        )

    def _vote(self, st: RunState, operator: bool | None = None) -> None:
        """Decide on ``st`` and publish the vote (``operator``: a pending one decided)."""
        decision = self._standing(st, self._decide(st, "vote"))
        if self._draining and decision.vote != "reject":
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
                self.metrics.rejected(reason.code)
        log.info(
            "%s: run %s (%s, proposed by %s): %s%s",
            self.name,
            st.run_id,
            st.spec.name,
            st.proposer,
            decision.vote,
            "".join(f"; {r.code}: {r.detail}" for r in decision.reasons),
        )
        self._spawn(st, self._publish("vote", st.run_id, decision.as_record()))

    def _on_vote(self, st: RunState, msg: M.SiteMessage, payload: bytes) -> None:
        body = msg.body
        if body.get("vote") not in VOTES or not isinstance(body.get("reasons", []), list):
            raise ValueError("a vote is accept, reject or pending, with a list of reasons")
        if not isinstance(body.get("policy", ""), str):
            raise ValueError("a vote's policy is a digest")
        assert self.ledger is not None
        self.ledger.vote(st.run_id, msg.site, body, payload)
        st.votes[msg.site] = body
        for committer, (held, raw) in list(st.held.items()):  # commits waiting on votes
            if self._commit_ok(st, committer, held) is None:
                del st.held[committer]
                self._take_commit(st, committer, held, raw)

    # ------------------------------------------------------------------ commits
    async def _commit_turns(self, st: RunState) -> None:
        """Commit ``st`` when it is this site's turn and no commit came: the proposer at the
        deadline (at once when its quorum is out of reach), the k-th ranked accepted site k
        grace periods later; a non-committer stops once every committer's turn is long past."""
        grace = grace_s(st.spec.vote_deadline_s)
        while not st.commits and not self._final(st):
            accepted = st.accepted()
            if st.decision is not None and st.decision.vote == "accept":
                accepted.add(self.name)  # its own vote may not be back from the broker
            order = committers(st.run_id, st.proposer, accepted)
            now = time.time()
            settled = time.monotonic() - st.heard_at >= SETTLE_S
            if self.name in order and settled:
                # the proposer aborts at once a run that can no longer commit
                early = self.name == st.proposer and now < st.deadline and st.out_of_reach()
                if early or now >= st.deadline + order.index(self.name) * grace:
                    await self._commit(st)
                    return
            elif now > st.deadline + (len(order) + 2) * grace:
                return
            await asyncio.sleep(0.25)

    async def _commit(self, st: RunState) -> None:
        counted = tally(
            {s: v["vote"] for s, v in st.votes.items()},
            st.spec.quorum.min_accept,
            None if st.spec.members == "any" else st.spec.members,
            expected=self.sites_heard,
        )
        body = {"members": list(counted.members), "aborted": counted.aborted}
        early = st.out_of_reach() if time.time() < st.deadline else None
        if early and counted.aborted:  # the proposer's, at once (_commit_turns)
            body["aborted"] = f"before the deadline, {early}"
        log.info(
            "%s: commits run %s: %s",
            self.name,
            st.run_id,
            f"aborted, {counted.aborted}" if counted.aborted else ", ".join(counted.members),
        )
        await self._publish("commit", st.run_id, body)

    def _commit_ok(self, st: RunState, committer: str, body: dict) -> str | None:
        """Why a commit cannot be taken yet (its votes may still be on their way): None
        when it can."""
        if committer != st.proposer and committer not in st.accepted():
            return "the committer neither proposed the run nor accepted it"
        missing = [m for m in body["members"] if m not in st.accepted()]
        if missing:
            return f"no accept heard from {', '.join(missing)}"
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
        # the proposer aborts early a run out of reach; it may withdraw it any time (cancel)
        if msg.ts < st.deadline - EARLY_SLACK_S and not (aborted and msg.site == st.proposer):
            self._drop(f"commit of {st.run_id} by {msg.site}", "early_commit")
            return
        why = self._commit_ok(st, msg.site, body)
        if why is not None:
            st.held[msg.site] = (body, payload)
            log.info("%s: commit of %s by %s held: %s", self.name, st.run_id, msg.site, why)
            return
        self._take_commit(st, msg.site, body, payload)

    def _take_commit(self, st: RunState, committer: str, body: dict, payload: bytes) -> None:
        assert self.ledger is not None
        self.ledger.commit(st.run_id, committer, body["members"], payload)
        st.commits[committer] = body
        winner = winning_commit(
            st.run_id, st.proposer, {c: tuple(b["members"]) for c, b in st.commits.items()}
        )
        if winner == st.acted_on:
            return
        chosen = st.commits[winner]
        st.acted_on = winner
        if chosen["aborted"] is not None:
            self._end(st, "aborted", f"aborted by {winner}'s commit: {chosen['aborted']}")
            return
        members = tuple(sorted(chosen["members"]))
        previous, st.members = st.members, members
        if self.name not in members:
            if previous is not None and st.worker is not None:  # a lesser commit ran here
                log.warning(
                    "%s: run %s: %s's commit stands, without this site: leaving",
                    self.name,
                    st.run_id,
                    winner,
                )
            self._end(st, "aborted", f"not among the members {winner} committed")
            return
        if previous is not None:
            return  # already under way with this site
        if st.decision is None:
            self._end(st, "aborted", NO_VOTE)
            return
        self._status(st, "committed", f"committed by {winner}: {', '.join(members)}")
        decision = self._decide(st, "commit", members)
        if decision.vote == "reject":
            for reason in decision.reasons:
                self.metrics.rejected(reason.code)
            why = "; ".join(f"{r.code}: {r.detail}" for r in decision.reasons)
            self._end(st, "aborted", f"policy at commit: {why}")
            self._spawn(st, self._publish("cancel", st.run_id, {"scope": "leave", "why": why}))
            return
        st.decision = decision
        self._start_waiting()

    # ------------------------------------------------------------------ cancel
    def _on_cancel(self, st: RunState, msg: M.SiteMessage, payload: bytes) -> None:
        scope = msg.body.get("scope")
        if scope not in ("run", "leave"):
            raise ValueError("a cancel's scope is run or leave")
        if scope == "run":
            if msg.site != st.proposer:
                self._drop(f"cancel of {st.run_id} by {msg.site}", "not_proposer")
                return
            self._end(st, "cancelled", f"cancelled by its proposer {msg.site}")
        elif msg.site != self.name:
            log.info("%s: %s left run %s: %s", self.name, msg.site, st.run_id, msg.body.get("why"))

    # ------------------------------------------------------------------ status
    def _status_of(self, st: RunState) -> str:
        assert self.ledger is not None
        entry = self.ledger.run(st.run_id)
        return entry.status if entry is not None else "proposed"

    def _final(self, st: RunState) -> bool:
        return self._status_of(st) in FINAL

    def _status(self, st: RunState, status: str, why: str = "") -> None:
        assert self.ledger is not None
        self.ledger.set_status(st.run_id, status, why)
        log.info("%s: run %s %s%s", self.name, st.run_id, status, f": {why}" if why else "")
        self._count_runs()

    def _end(self, st: RunState, status: str, why: str) -> None:
        """Move ``st`` to a final ``status`` (once), stopping its worker."""
        current = self._status_of(st)
        if current in FINAL:
            return
        if status not in NEXT[current]:  # e.g. a running run left out: it is cancelled here
            status = "cancelled"
        self._status(st, status, why)
        if st.worker is not None and st.worker.running:
            self._spawn(None, st.worker.stop())
        self._start_waiting()

    def _count_runs(self) -> None:
        if self.ledger is None:
            return
        counts: Counter[str] = Counter()
        for entry in self.ledger.runs():
            counts[self.shown_status(entry)[0]] += 1
        self.metrics.set_runs(counts)


def install_signal_handlers(task: asyncio.Task) -> None:
    """SIGTERM and SIGINT stop the daemon (its workers too): systemd's stop, Ctrl-C."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
