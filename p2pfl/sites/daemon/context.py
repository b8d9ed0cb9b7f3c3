"""What the parts of a site daemon share, in one object (as ``NodeServices`` serves a node):
the site's own file and identity, its metrics, the runs it follows and its consent ledger,
the link to the broker (:meth:`SiteContext.publish`), its tasks (:meth:`SiteContext.spawn`),
a run's status at this site, and the site's decision on a run (:meth:`SiteContext.decide`).

Each part of the daemon (:mod:`~p2pfl.sites.consent.run_agreement`,
:mod:`~p2pfl.sites.runs.slots`, :mod:`~p2pfl.sites.runs.series`,
:mod:`~p2pfl.sites.trust.crl_updates`, :mod:`~p2pfl.sites.daemon.admin_commands`) receives
this context, and the other parts it calls, in its constructor: its imports show what it
depends on.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections import Counter
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from p2pfl.sites.consent import messages as M
from p2pfl.sites.consent.ledger import FINAL, ConsentLedger, RunEntry
from p2pfl.sites.consent.run_state import RunState
from p2pfl.sites.consent.site_status import status_body
from p2pfl.sites.daemon.broker_link import BrokerLink
from p2pfl.sites.daemon.json_log import run_context
from p2pfl.sites.daemon.observe import ServedModel, SiteMetrics
from p2pfl.sites.daemon.site_file import SiteFile
from p2pfl.sites.models.store import ModelStore, ModelStoreError
from p2pfl.sites.policy.binding_watch import BindingWatch
from p2pfl.sites.policy.rules import Decision, Stage
from p2pfl.sites.policy.verdict import OutsideCodeChecks, judge
from p2pfl.sites.runs.processes import SERVING_METRICS

log = logging.getLogger("p2pfl.sites.daemon")


class SiteContext:
    """One site daemon's shared state and services. ``broker``: host:port (resolved from
    mDNS by the command line); ``ledger`` is opened by the daemon when it runs."""

    def __init__(self, site: SiteFile, broker: str):
        self.site = site
        self.name = site.site
        self.swarm = site.swarm
        self.broker = broker
        self.state_dir = Path(site.state_dir)
        self.identity: M.SiteIdentity | None = None
        self.verifier: M.SiteVerifier | None = None
        if site.certs is not None:
            self.identity = M.SiteIdentity.from_certs(site.certs, site.site)
            self.verifier = M.SiteVerifier.from_certs(site.certs)
        # what the serving processes answered (counted in files of their own, emptied
        # now: the daemon holds its state_dir), and the model the site serves
        self.serving_metrics: Path | None = None
        if site.serving.listen is not None:
            self.serving_metrics = self.state_dir / SERVING_METRICS
            shutil.rmtree(self.serving_metrics, ignore_errors=True)
            self.serving_metrics.mkdir(parents=True)
        self.metrics = SiteMetrics(
            site.site, serving_dir=self.serving_metrics, served=self._served_model
        )
        self.runs: dict[str, RunState] = {}
        self.ledger: ConsentLedger | None = None
        self.link = BrokerLink(self.swarm, self.name, broker, site.certs, self.identity)
        self.bindings = BindingWatch(site)  # each binding checked before the first vote
        self.outside_checks = OutsideCodeChecks(site.policy, self.state_dir)
        self.draining = False
        self.dropped: Counter[str] = Counter()  # peer messages dropped, by reason

    def _served_model(self) -> ServedModel | None:
        """The model the site serves now (its model store: read, no torch), for
        ``/metrics``; None when none is, or the store cannot be read."""
        try:
            entry = ModelStore(self.state_dir, self.name).served()
        except (OSError, ModelStoreError):
            return None
        if entry is None:
            return None
        return ServedModel(entry.id, entry.run_id, entry.metric, entry.accuracy)

    # ------------------------------------------------------------------ services
    async def publish(self, kind: str, run: str, body: dict[str, Any]) -> None:
        """Publish this site's signed, retained ``kind`` message on ``run`` (retried until
        the broker takes it)."""
        await self.link.publish(kind, run, body)

    def spawn(self, st: RunState | None, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """Run ``coro`` as a task of run ``st`` (cancelled when the daemon stops; None: of
        the daemon), its log lines naming the run; a failure is logged."""
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

    def drop(self, topic: str, reason: str, detail: str = "") -> None:
        """A peer's message dropped: counted, logged, metered."""
        self.dropped[reason] += 1
        self.metrics.dropped(reason)
        log.warning(
            "%s: dropped %s: %s%s", self.name, topic, reason, f" ({detail})" if detail else ""
        )

    def decide(
        self, st: RunState, stage: Stage, members: tuple[str, ...] | None = None
    ) -> Decision:
        """The site's decision on ``st`` at ``stage`` (:func:`~p2pfl.sites.policy.verdict.judge`):
        its policy, its bindings as of their latest check (not at a round: a running worker
        holds its data already), what a child learned of the run's outside code."""
        return judge(
            st.spec,
            st.proposer,
            self.site.policy,
            self.site.data,
            stage=stage,
            members=members,
            outside=st.outside,
            hours_trained=st.worker.hours() if st.worker else 0.0,
            binding_problems={} if stage == "round" else self.bindings.problems(st.spec.data),
        )

    # ------------------------------------------------------------------ a run's status
    def status_of(self, st: RunState) -> str:
        """``st``'s status at this site (the ledger's)."""
        assert self.ledger is not None
        entry = self.ledger.run(st.run_id)
        return entry.status if entry is not None else "proposed"

    def final(self, st: RunState) -> bool:
        """Whether ``st`` has ended at this site."""
        return self.status_of(st) in FINAL

    def set_status(self, st: RunState, status: str, why: str = "") -> None:
        """Move ``st`` to ``status`` in the ledger (the ledger refuses a step back), and tell
        the federation (:meth:`tell_status`)."""
        assert self.ledger is not None
        self.ledger.set_status(st.run_id, status, why)
        log.info("%s: run %s %s%s", self.name, st.run_id, status, f": {why}" if why else "")
        self.count_runs()
        self.tell_status(st)

    def tell_status(self, st: RunState) -> None:
        """Publish this site's status of ``st`` (its signed, retained ``status`` message:
        :mod:`~p2pfl.sites.consent.site_status`): the status as ``p2pfl runs`` shows it,
        why, the last round its node finished and that round's metrics."""
        assert self.ledger is not None
        entry = self.ledger.run(st.run_id)
        if entry is None:
            return
        status, why = self.shown_status(entry)
        last_round = st.worker.last_round if st.worker is not None else 0
        body = status_body(status, why, last_round, st.metrics)
        self.spawn(st, self.publish("status", st.run_id, body))

    def shown_status(self, entry: RunEntry) -> tuple[str, str]:
        """A ledger entry's status at this site as ``p2pfl runs`` and the metrics show it,
        and why: ``pending`` (with its reason) for a committed run that waits for a slot."""
        st = self.runs.get(entry.run_id)
        if st is not None and entry.status == "committed" and st.waiting:
            return "pending", st.waiting
        return entry.status, entry.why

    def count_runs(self) -> None:
        """The runs metric, by shown status."""
        if self.ledger is None:
            return
        counts: Counter[str] = Counter()
        for entry in self.ledger.runs():
            counts[self.shown_status(entry)[0]] += 1
        self.metrics.set_runs(counts)
