"""A site daemon's runs at this site: slots for workers (``limits.max_concurrent_runs``),
each worker's life, the rounds it records (metered, and checked against the policy at stage
``round``), leaving a run, and draining (docs/design.md, "The site daemon").

:class:`WorkerSlots` is a part of :class:`~p2pfl.sites.daemon.site_daemon.SiteDaemon`, kept apart so each
module holds one job; it reads the daemon's ``runs``, ``site``, ``metrics`` and status
methods.
"""

from __future__ import annotations

import asyncio
import logging
import math

from p2pfl.sites.policy.rules import policy_digest
from p2pfl.sites.consent.run_state import RunState
from p2pfl.sites.runs.processes import offer_model
from p2pfl.sites.runs.worker import RunWorker
from p2pfl.sites.runs.topology import worker_topology

log = logging.getLogger("p2pfl.sites.daemon")

RECORD_POLL_S = 1.0  # how often a running worker's new records are read


class WorkerSlots:
    """The daemon's workers (a mixin of :class:`~p2pfl.sites.daemon.site_daemon.SiteDaemon`)."""

    def _active(self) -> list[RunState]:
        """The runs holding a slot: a worker started or starting, not ended."""
        return [st for st in self.runs.values() if st.worker is not None and not self._final(st)]

    def _start_waiting(self) -> None:
        """Start committed runs in commit order while slots are free; the others wait as
        ``pending`` with the reason."""
        limit = self.site.limits.max_concurrent_runs
        waiting = [
            st
            for st in self.runs.values()
            if st.worker is None and self._status_of(st) == "committed" and not self._draining
        ]
        for st in sorted(waiting, key=lambda s: s.deadline):
            active = self._active()
            if len(active) < limit:
                st.waiting = ""
                st.worker = RunWorker(self.state_dir / "runs" / st.run_id, st.run_id, self.name)
                self._spawn(st, self._run_worker(st))
            else:
                names = ", ".join(a.run_id for a in active)
                st.waiting = f"limits.max_concurrent_runs {limit} reached (running: {names})"
        self._count_runs()

    async def _run_worker(self, st: RunState) -> None:
        assert st.worker is not None and st.members is not None and st.decision is not None
        worker = st.worker
        binding = self.site.data.get(st.spec.data)
        if binding is None:  # the site file changed under the daemon since the commit
            self._end(st, "failed", f"data binding {st.spec.data!r} left the site file")
            return
        init, cycle_facts = await self._cycle_inputs(st)
        topology = worker_topology(
            st.spec,
            run_id=st.run_id,
            site=self.name,
            members=list(st.members),
            binding=binding,
            broker=self.broker,
            certs=self.site.certs,
            epsilon=st.decision.dp_epsilon,
            init=init,
        )
        facts = {
            "run_id": st.run_id,
            "policy": policy_digest(self.site.policy),
            "members": list(st.members),
            "committer": st.acted_on,
            "proposer": st.proposer,
            "dp_epsilon": st.decision.dp_epsilon,
            **cycle_facts,
        }
        try:
            await worker.start(topology, facts)
        except OSError as exc:
            self._end(st, "failed", f"the worker did not start: {exc}")
            return
        self._status(st, "running", f"worker pid {worker.proc.pid if worker.proc else '?'}")
        watch = self._spawn(st, self._watch_records(st))
        code = await worker.wait()
        watch.cancel()
        self._read_records(st)
        if self._status_of(st) == "running":
            if code == 0:
                self._end(st, "finished", f"{worker.last_round} rounds")
                if self.site.promote.offer and self.site.source is not None:
                    self._spawn(st, self._offer(st))
            elif st.leaving is not None:  # stopped on purpose: the rounds it finished count
                self._leave(st, f"{st.leaving} after round {worker.last_round}")
            else:
                self._end(st, "failed", f"the worker exited with {code} (see {worker.log_path})")
        self._start_waiting()

    async def _offer(self, st: RunState) -> None:
        """Keep the model of ``st`` (finished here) and judge it at the promotion gate, in
        a process of its own (``p2pfl models offer``: torch stays out of the daemon)."""
        assert self.site.source is not None
        log_path = self.state_dir / "runs" / st.run_id / "offer.log"
        code, said = await offer_model(self.site.source, st.run_id, log_path)
        if code == 0:
            log.info("%s: run %s: model %s", self.name, st.run_id, said)
        else:
            log.error(
                "%s: run %s: its model was not kept (%s; see %s)",
                self.name,
                st.run_id,
                said,
                log_path,
            )

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
                self.metrics.observe_round(float(rec["round_s"]))
            sent, direct = rec.get("bytes_sent"), rec.get("direct_bytes_sent")
            if isinstance(sent, int) and isinstance(direct, int):
                self.metrics.add_bytes("direct", direct)
                self.metrics.add_bytes("mqtt", max(0, sent - direct))
            if isinstance(rec.get("peers"), list):
                self.metrics.set_peers_online(len(rec["peers"]))
            eps = rec.get("epsilon")
            if isinstance(eps, (int, float)) and math.isfinite(eps):
                self.metrics.set_epsilon(float(eps))
        if records and worker.running and self._status_of(st) == "running":
            decision = self._decide(st, "round", st.members)
            if decision.vote == "reject":
                for reason in decision.reasons:
                    self.metrics.rejected(reason.code)
                why = "; ".join(f"{r.code}: {r.detail}" for r in decision.reasons)
                self._leave(st, f"policy at round {worker.last_round}: {why}")

    def _leave(self, st: RunState, why: str, status: str = "cancelled") -> None:
        """Stop this site's part of ``st`` and say so to the others."""
        self._end(st, status, why)
        self._spawn(st, self._publish("cancel", st.run_id, {"scope": "leave", "why": why}))

    async def _stop_workers(self, why: str) -> None:
        stopping = []
        for st in self.runs.values():
            if st.worker is not None and st.worker.running:
                stopping.append(st.worker.stop())
                self._end(st, "failed", why)
        await asyncio.gather(*stopping, return_exceptions=True)

    async def _drain(self) -> None:
        """No new runs; each running worker finishes its current round and leaves; then the
        daemon stops."""
        if self._draining:
            return
        self._draining = True
        log.warning("%s: draining: no new runs; running ones leave after their round", self.name)
        for st in self.runs.values():
            if st.worker is None and self._status_of(st) == "committed":
                self._end(st, "cancelled", "the site drained before it started")

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
                await worker.stop()
            while not self._final(st):  # its end is told by _run_worker
                await asyncio.sleep(0.05)

        await asyncio.gather(*(leave_after_round(st) for st in self._active()))
        self._drained.set()
