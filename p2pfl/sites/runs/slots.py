"""A site daemon's runs at this site: slots for workers (``limits.max_concurrent_runs``),
each worker's life, the rounds it records (metered, and checked against the policy at stage
``round``), leaving a run, and draining (docs/design.md, "The site daemon").

:class:`WorkerSlots` is a part of the site daemon: it receives the daemon's
:class:`~p2pfl.sites.daemon.context.SiteContext` and the series (a cycle's warm start).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from p2pfl.sites.consent.ledger import FINAL, NEXT
from p2pfl.sites.consent.run_state import RunState
from p2pfl.sites.consent.site_status import round_metrics
from p2pfl.sites.daemon.context import SiteContext
from p2pfl.sites.models.store import PROMOTED, REFUSED, ModelStore, ModelStoreError
from p2pfl.sites.policy.rules import policy_digest
from p2pfl.sites.runs.processes import offer_model
from p2pfl.sites.runs.retention import prune_runs
from p2pfl.sites.runs.series import SeriesCycles
from p2pfl.sites.runs.topology import worker_topology
from p2pfl.sites.runs.warm_worker import WarmWorkers
from p2pfl.sites.runs.worker import RunWorker

log = logging.getLogger("p2pfl.sites.daemon")

RECORD_POLL_S = 1.0  # how often a running worker's new records are read
WARM_IDLE_S = 600.0  # limits.warm_worker: auto stops the warm worker after this long idle


class WorkerSlots:
    """This site's workers, over the daemon's ``ctx``; ``series`` gives a cycle's inputs
    (its warm start). :attr:`drained` is set once :meth:`drain` is done."""

    def __init__(self, ctx: SiteContext, series: SeriesCycles):
        self.ctx = ctx
        self.series = series
        self.drained = asyncio.Event()
        self._offering: set[str] = set()  # runs whose model a child is keeping and judging
        self.warm = WarmWorkers(ctx.state_dir)
        self._warm_used = time.monotonic()  # the last time a run wanted the warm worker
        self._warm_idle: asyncio.Task | None = None

    def warm_up(self) -> None:
        """Have the warm worker start importing torch (``limits.warm_worker``: ``true``, or
        ``auto`` once this site votes for a run, so it is ready by the commit); under
        ``auto`` it stops after :data:`WARM_IDLE_S` without a run."""
        mode = self.ctx.site.limits.warm_worker
        if mode is False or self.ctx.draining:
            return
        self._warm_used = time.monotonic()
        if not self.warm.started:
            self.ctx.spawn(None, self.warm.start())
        if mode == "auto" and (self._warm_idle is None or self._warm_idle.done()):
            self._warm_idle = self.ctx.spawn(None, self._stop_warm_when_idle())

    async def _stop_warm_when_idle(self) -> None:
        while True:
            await asyncio.sleep(min(WARM_IDLE_S, 30.0))
            if self.active():
                self._warm_used = time.monotonic()
            elif time.monotonic() - self._warm_used >= WARM_IDLE_S:
                log.info("%s: warm worker stopped (no run for %.0f s)", self.ctx.name, WARM_IDLE_S)
                await self.warm.stop()
                return

    def active(self) -> list[RunState]:
        """The runs holding a slot: a worker started or starting, not ended."""
        return [
            st for st in self.ctx.runs.values() if st.worker is not None and not self.ctx.final(st)
        ]

    def start_waiting(self) -> None:
        """Start committed runs in commit order while slots are free; the others wait as
        ``pending`` with the reason."""
        limit = self.ctx.site.limits.max_concurrent_runs
        waiting = [
            st
            for st in self.ctx.runs.values()
            if st.worker is None and self.ctx.status_of(st) == "committed" and not self.ctx.draining
        ]
        for st in sorted(waiting, key=lambda s: s.deadline):
            active = self.active()
            if len(active) < limit:
                st.waiting = ""
                st.worker = RunWorker(
                    self.ctx.state_dir / "runs" / st.run_id, st.run_id, self.ctx.name
                )
                self.ctx.spawn(st, self._run_worker(st))
            else:
                names = ", ".join(a.run_id for a in active)
                st.waiting = f"limits.max_concurrent_runs {limit} reached (running: {names})"
        self.ctx.count_runs()

    async def _run_worker(self, st: RunState) -> None:
        assert st.worker is not None and st.members is not None and st.decision is not None
        worker = st.worker
        binding = self.ctx.site.data.get(st.spec.data)
        if binding is None:  # the site file changed under the daemon since the commit
            self.end(st, "failed", f"data binding {st.spec.data!r} left the site file")
            return
        init, cycle_facts = await self.series.cycle_inputs(st)
        topology = worker_topology(
            st.spec,
            run_id=st.run_id,
            site=self.ctx.name,
            members=list(st.members),
            binding=binding,
            broker=self.ctx.broker,
            certs=self.ctx.site.certs,
            epsilon=st.decision.dp_epsilon,
            init=init,
        )
        facts = {
            "run_id": st.run_id,
            "policy": policy_digest(self.ctx.site.policy),
            "members": list(st.members),
            "committer": st.acted_on,
            "proposer": st.proposer,
            "dp_epsilon": st.decision.dp_epsilon,
            **cycle_facts,
        }
        try:
            limits = self.ctx.site.limits
            await worker.start(topology, facts, self.warm, limits.worker_nice, limits.worker_cpus)
        except OSError as exc:
            self.end(st, "failed", f"the worker did not start: {exc}")
            return
        self.ctx.set_status(st, "running", f"worker pid {worker.proc.pid if worker.proc else '?'}")
        watch = self.ctx.spawn(st, self._watch_records(st))
        code = await worker.wait()
        watch.cancel()
        self._read_records(st)
        if self.ctx.status_of(st) == "running":
            if code == 0:
                self.end(st, "finished", f"{worker.last_round} rounds")
                if self.ctx.site.promote.offer and self.ctx.site.source is not None:
                    self.ctx.spawn(st, self._offer(st))
            elif st.leaving is not None:  # stopped on purpose: the rounds it finished count
                self.leave(st, f"{st.leaving} after round {worker.last_round}")
            else:
                self.end(st, "failed", f"the worker exited with {code} (see {worker.log_path})")
        self.start_waiting()
        self.prune()

    def prune(self) -> None:
        """Keep the files of the newest ``limits.keep_runs`` finished runs
        (:func:`~p2pfl.sites.runs.retention.prune_runs`); never a run under way or whose
        model is being offered."""
        busy = {st.run_id for st in self.ctx.runs.values() if not self.ctx.final(st)}
        busy |= self._offering
        keep = self.ctx.site.limits.keep_runs
        removed = prune_runs(self.ctx.state_dir / "runs", keep, busy)
        if removed:
            log.info(
                "%s: the files of %d older run(s) removed (limits.keep_runs %d): %s",
                self.ctx.name,
                len(removed),
                keep,
                ", ".join(removed),
            )

    async def _offer(self, st: RunState) -> None:
        """Keep the model of ``st`` (finished here) and judge it at the promotion gate, in
        a process of its own (``p2pfl models offer``: torch stays out of the daemon)."""
        assert self.ctx.site.source is not None
        log_path = self.ctx.state_dir / "runs" / st.run_id / "offer.log"
        self._offering.add(st.run_id)
        try:
            code, said = await offer_model(self.ctx.site.source, st.run_id, log_path)
        finally:
            self._offering.discard(st.run_id)
            self.prune()
        self.ctx.metrics.judged(self._gate_decision(st.run_id) if code == 0 else "failed")
        if code == 0:
            log.info("%s: run %s: model %s", self.ctx.name, st.run_id, said)
        else:
            log.error(
                "%s: run %s: its model was not kept (%s; see %s)",
                self.ctx.name,
                st.run_id,
                said,
                log_path,
            )

    def _gate_decision(self, run_id: str) -> str:
        """What the gate decided of run ``run_id``'s model, as the model store holds it:
        ``promoted``, ``refused`` (or ``failed``: no judged entry of it)."""
        try:
            entries = ModelStore(self.ctx.state_dir, self.ctx.name).entries()
        except (OSError, ModelStoreError):
            return "failed"
        judged = [e for e in entries if e.run_id == run_id and e.status in (PROMOTED, REFUSED)]
        return max(judged, key=lambda e: e.added).status if judged else "failed"

    async def _watch_records(self, st: RunState) -> None:
        while True:
            await asyncio.sleep(RECORD_POLL_S)
            self._read_records(st)

    def _read_records(self, st: RunState) -> None:
        """Meter each round the worker finished, and check the policy (stage ``round``)."""
        worker = st.worker
        if worker is None:
            return
        records = worker.new_records()
        for rec in records:
            if isinstance(rec.get("round_s"), (int, float)):
                self.ctx.metrics.observe_round(float(rec["round_s"]))
            sent, direct = rec.get("bytes_sent"), rec.get("direct_bytes_sent")
            if isinstance(sent, int) and isinstance(direct, int):
                self.ctx.metrics.add_bytes("direct", direct)
                self.ctx.metrics.add_bytes("mqtt", max(0, sent - direct))
            if isinstance(rec.get("peers"), list):
                self.ctx.metrics.set_peers_online(len(rec["peers"]))
            eps = rec.get("epsilon")
            if isinstance(eps, (int, float)) and math.isfinite(eps):
                self.ctx.metrics.set_epsilon(float(eps))
            measured = round_metrics(rec)
            if measured:
                st.metrics = measured
                self.ctx.metrics.set_run_metrics(st.run_id, measured)
        if not records or self.ctx.status_of(st) != "running":
            return
        self.ctx.tell_status(st)  # the round it reached, and what it measured
        if worker.running:
            decision = self.ctx.decide(st, "round", st.members)
            if decision.vote == "reject":
                for reason in decision.reasons:
                    self.ctx.metrics.rejected(reason.code)
                why = "; ".join(f"{r.code}: {r.detail}" for r in decision.reasons)
                self.leave(st, f"policy at round {worker.last_round}: {why}")

    def end(self, st: RunState, status: str, why: str) -> None:
        """Move ``st`` to a final ``status`` (once), stopping its worker; a slot may be free."""
        current = self.ctx.status_of(st)
        if current in FINAL:
            return
        if status not in NEXT[current]:  # e.g. a running run left out: it is cancelled here
            status = "cancelled"
        self.ctx.set_status(st, status, why)
        if st.worker is not None and st.worker.running:
            self.ctx.spawn(None, st.worker.stop())
        self.start_waiting()

    def leave(self, st: RunState, why: str, status: str = "cancelled") -> None:
        """Stop this site's part of ``st`` and say so to the others."""
        self.end(st, status, why)
        self.ctx.spawn(st, self.ctx.publish("cancel", st.run_id, {"scope": "leave", "why": why}))

    async def stop_workers(self, why: str) -> None:
        stopping = []
        for st in self.ctx.runs.values():
            if st.worker is not None and st.worker.running:
                stopping.append(st.worker.stop())
                self.end(st, "failed", why)
        await asyncio.gather(*stopping, return_exceptions=True)
        if self._warm_idle is not None:
            self._warm_idle.cancel()
        await self.warm.stop()

    async def drain(self) -> None:
        """No new runs; each running worker finishes its current round and leaves; then the
        daemon stops."""
        if self.ctx.draining:
            return
        self.ctx.draining = True
        log.warning(
            "%s: draining: no new runs; running ones leave after their round", self.ctx.name
        )
        for st in self.ctx.runs.values():
            if st.worker is None and self.ctx.status_of(st) == "committed":
                self.end(st, "cancelled", "the site drained before it started")

        async def leave_after_round(st: RunState) -> None:
            worker = st.worker
            assert worker is not None
            self._read_records(st)
            done = worker.last_round
            while worker.running and worker.last_round <= done:
                await asyncio.sleep(0.2)
                self._read_records(st)
            if worker.running:
                st.leaving = "drained"
                log.info(
                    "%s: run %s: drained after round %d: stopping its worker",
                    self.ctx.name,
                    st.run_id,
                    worker.last_round,
                )
                await worker.stop()
            while not self.ctx.final(st):  # its end is told by _run_worker
                await asyncio.sleep(0.05)

        await asyncio.gather(*(leave_after_round(st) for st in self.active()))
        self.drained.set()
