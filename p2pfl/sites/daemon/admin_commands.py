"""A site daemon's answers to its operator (:mod:`p2pfl.sites.daemon.admin_socket`): ``status``, ``runs``,
``submit``, ``vote``, ``cancel``, ``logs`` and ``drain``.

:class:`AdminCommands` is a part of the site daemon: it receives the daemon's
:class:`~p2pfl.sites.daemon.context.SiteContext` and the parts it asks.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path
from typing import Any

from p2pfl.sites.consent.agreement import winning_commit
from p2pfl.sites.consent.ledger import FINAL, LEDGER_FILE, ConsentLedger, RunEntry
from p2pfl.sites.consent.run_agreement import RunAgreement
from p2pfl.sites.consent.run_spec import retry_spec, run_id, spec_from_dict
from p2pfl.sites.consent.run_state import RunState
from p2pfl.sites.daemon.context import SiteContext
from p2pfl.sites.runs.slots import WorkerSlots
from p2pfl.sites.runs.worker import RunWorker
from p2pfl.sites.trust.crl_updates import TrustUpdates

LOG_ANSWER_BYTES = 8 << 20  # the end of a worker log an answer carries


class AdminCommands:
    """The answers to the operator's requests, over the daemon's ``ctx``: the run agreement
    (a pending vote decided), the slots (leave, drain), the trust (its CRL number), and
    ``not_ready``, why the daemon is not ready."""

    def __init__(
        self,
        ctx: SiteContext,
        agreement: RunAgreement,
        slots: WorkerSlots,
        trust: TrustUpdates,
        not_ready: Callable[[], list[str]],
    ):
        self.ctx = ctx
        self.agreement = agreement
        self.slots = slots
        self.trust = trust
        self.not_ready = not_ready

    async def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        """Answer one admin request (:mod:`p2pfl.sites.daemon.admin_socket`)."""
        cmd = req["cmd"]
        if cmd == "status":
            return {
                "site": self.ctx.name,
                "swarm": self.ctx.swarm,
                "broker": self.ctx.broker,
                "connected": self.ctx.link.connected.is_set(),
                "draining": self.ctx.draining,
                "signed": self.ctx.identity is not None,
                "not_ready": self.not_ready(),
                "dropped": dict(self.ctx.dropped),
                "crl_number": self.trust.number,
            }
        if cmd == "runs":
            return {"runs": self.describe_runs()}
        if cmd == "submit":
            return await self._submit(req.get("spec"), str(req.get("source", "<run spec>")))
        st = self.ctx.runs.get(str(req.get("run_id", "")))
        if cmd == "drain":
            self.ctx.spawn(None, self.slots.drain())
            return {"draining": True}
        if st is None:
            raise ValueError(f"no run {req.get('run_id')!r} at site {self.ctx.name} (p2pfl runs)")
        if cmd == "vote":
            if not isinstance(req.get("accept"), bool):
                raise ValueError("vote: accept is true or false")
            if st.decision is None or st.decision.vote != "pending":
                mine = st.decision.vote if st.decision else "none"
                raise ValueError(f"run {st.run_id}: this site's vote is {mine}, not pending")
            if self.ctx.final(st) or st.commits:
                raise ValueError(f"run {st.run_id} is {self.ctx.status_of(st)}: too late to vote")
            self.agreement.vote(st, operator=req["accept"])
            return {"vote": st.decision.vote}
        if cmd == "cancel":
            if self.ctx.final(st):
                raise ValueError(f"run {st.run_id} is {self.ctx.status_of(st)} already")
            if st.proposer == self.ctx.name:
                self.slots.end(st, "cancelled", "cancelled by this site, its proposer")
                await self.ctx.publish("cancel", st.run_id, {"scope": "run"})
                return {"cancelled": "run"}
            self.slots.leave(st, "left by this site's operator (p2pfl cancel)")
            return {"cancelled": "left"}
        if cmd == "logs":
            return {"text": self._logs(st, req.get("node"), req.get("tail"))}
        if cmd == "retry":
            return await self._retry(st)
        raise ValueError(f"unknown command {cmd!r}")

    async def _submit(self, body: Any, source: str) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise ValueError("submit: spec is a mapping")
        if self.ctx.draining:
            raise ValueError(f"site {self.ctx.name} is draining: it proposes no new runs")
        spec = spec_from_dict(body, source)  # by the method's card: nothing is imported
        rid = run_id(spec)
        if rid in self.ctx.runs:
            raise ValueError(
                f"run {rid} was proposed already ({self.ctx.status_of(self.ctx.runs[rid])})"
            )
        await self.ctx.publish("spec", rid, {"spec": spec.model_dump(mode="json")})
        return {"run_id": rid, "name": spec.name, "vote_deadline_s": spec.vote_deadline_s}

    async def _retry(self, st: RunState) -> dict[str, Any]:
        """Propose ``st``'s spec again as its next attempt (:func:`retry_spec`): for a run
        that failed, was aborted or was cancelled here; its id is the attempt's, so two
        sites retrying the same run propose one run."""
        status = self.ctx.status_of(st)
        if status not in FINAL - {"finished"}:
            raise ValueError(
                f"run {st.run_id} is {status}: only a failed, aborted or cancelled run is "
                "retried (a finished one is submitted again with a changed spec)"
            )
        if st.spec.series is not None:
            raise ValueError(f"run {st.run_id} is a series' cycle: its series proposes cycles")
        if self.ctx.draining:
            raise ValueError(f"site {self.ctx.name} is draining: it proposes no new runs")
        spec = retry_spec(st.spec, st.run_id)
        rid = run_id(spec)
        if rid in self.ctx.runs:
            raise ValueError(
                f"run {st.run_id} was retried already: run {rid} "
                f"({self.ctx.status_of(self.ctx.runs[rid])})"
            )
        await self.ctx.publish("spec", rid, {"spec": spec.model_dump(mode="json")})
        assert spec.retry is not None
        return {
            "run_id": rid,
            "name": spec.name,
            "vote_deadline_s": spec.vote_deadline_s,
            "attempt": spec.retry.attempt,
        }

    def describe_runs(self) -> list[dict[str, Any]]:
        """Every run this site holds (``p2pfl runs``, :func:`run_row`), with the status it
        shows (``pending`` for a committed run that waits for a slot) and the last round
        its worker finished."""
        assert self.ctx.ledger is not None
        out = []
        for entry in self.ctx.ledger.runs():
            st = self.ctx.runs.get(entry.run_id)
            status, why = self.ctx.shown_status(entry)
            if st and st.worker:
                last = st.worker.last_round
            else:  # trained before this daemon started, or not here: its records say
                last = recorded_round(self.ctx.state_dir, entry.run_id, self.ctx.name)
            out.append(run_row(entry, self.ctx.state_dir, status, why, last))
        return out

    def _logs(self, st: RunState, node: Any, tail: Any) -> str:
        if node not in (None, self.ctx.name):
            raise ValueError(
                f"site {self.ctx.name} holds its own node's log only; ask {node}'s daemon "
                f"(p2pfl logs {st.run_id} --site <{node}'s site file>)"
            )
        path = self.ctx.state_dir / "runs" / st.run_id / "worker.log"
        if not path.is_file():
            if not path.parent.exists() and self.ctx.final(st):
                raise ValueError(
                    f"run {st.run_id}: its files were removed, as an older finished run's "
                    f"(limits.keep_runs {self.ctx.site.limits.keep_runs}); the ledger keeps "
                    "its agreement"
                )
            raise ValueError(f"run {st.run_id} has no worker log at this site")
        text = path.read_text(errors="replace")
        if isinstance(tail, int) and tail > 0:
            text = "\n".join(text.splitlines()[-tail:]) + "\n"
        return text[-LOG_ANSWER_BYTES:]


def run_row(
    entry: RunEntry, state_dir: Path, status: str, why: str, last_round: int
) -> dict[str, Any]:
    """One run as ``p2pfl runs`` shows it, from this site's ledger entry: its id, name,
    proposer, ``status`` at this site and ``why``, the votes heard with their reasons, each
    site's status of the run as it last told it (``sites``), the members of the commit that
    stands, ``last_round`` its node finished of the rounds it
    trains, its series cycle, the run it retries, and its folder."""
    winner = None
    if entry.commits:
        winner = winning_commit(
            entry.run_id, entry.proposer, {c: tuple(m) for c, m in entry.commits.items()}
        )
    spec = entry.spec
    series = spec.get("series") or {}
    retry = spec.get("retry") or {}
    rounds = spec.get("rounds")
    if series.get("cycle", 1) > 1 and series.get("rounds") is not None:
        rounds = series["rounds"]  # a later cycle trains the series' rounds
    return {
        "run_id": entry.run_id,
        "name": entry.name,
        "proposer": entry.proposer,
        "status": status,
        "why": why,
        "votes": entry.votes,
        "sites": entry.sites,
        "members": entry.commits.get(winner, []) if winner else [],
        "round": last_round,
        "rounds": rounds,
        "cycle": series.get("cycle") if series else None,
        "retry_of": retry.get("of"),
        "attempt": retry.get("attempt", 1),
        "proposed_at": dt.datetime.fromtimestamp(entry.proposed_at, dt.timezone.utc).isoformat(
            timespec="seconds"
        ),
        "run_dir": str(state_dir / "runs" / entry.run_id),
    }


def ledger_rows(state_dir: Path, site: str) -> list[dict[str, Any]]:
    """``p2pfl runs`` while the daemon is down: every run of the ledger in ``state_dir``,
    opened read-only, each at its ledger status, and the last round this site's node
    recorded (its records file)."""
    path = state_dir / LEDGER_FILE
    if not path.is_file():
        return []
    rows = []
    with ConsentLedger(path, read_only=True) as ledger:
        for entry in ledger.runs():
            last = recorded_round(state_dir, entry.run_id, site)
            rows.append(run_row(entry, state_dir, entry.status, entry.why, last))
    return rows


def recorded_round(state_dir: Path, run_id: str, site: str) -> int:
    """The last round ``site``'s node recorded in run ``run_id`` (0: none, or its files
    were pruned), read by :meth:`RunWorker.new_records`, the sites' one reader of them."""
    records = RunWorker(state_dir / "runs" / run_id, run_id, site)
    records.new_records()
    return records.last_round
