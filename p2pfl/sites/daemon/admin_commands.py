"""A site daemon's answers to its operator (:mod:`p2pfl.sites.daemon.admin_socket`): ``status``, ``runs``,
``submit``, ``vote``, ``cancel``, ``logs`` and ``drain``.

:class:`AdminCommands` is a part of :class:`~p2pfl.sites.daemon.site_daemon.SiteDaemon`, kept apart so
each module holds one job.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from p2pfl.sites.consent.agreement import winning_commit
from p2pfl.sites.consent.ledger import RunEntry
from p2pfl.sites.consent.run_spec import cycle_rounds, run_id, spec_from_dict
from p2pfl.sites.consent.run_state import RunState

LOG_ANSWER_BYTES = 8 << 20  # the end of a worker log an answer carries


class AdminCommands:
    """The daemon's admin requests (a mixin of :class:`~p2pfl.sites.daemon.site_daemon.SiteDaemon`)."""

    async def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        """Answer one admin request (:mod:`p2pfl.sites.daemon.admin_socket`)."""
        cmd = req["cmd"]
        if cmd == "status":
            return {
                "site": self.name,
                "swarm": self.swarm,
                "broker": self.broker,
                "connected": self._connected.is_set(),
                "draining": self._draining,
                "signed": self.identity is not None,
                "not_ready": self.not_ready(),
                "dropped": dict(self.dropped),
                "crl_number": self.trust_number,
            }
        if cmd == "runs":
            return {"runs": self.describe_runs()}
        if cmd == "submit":
            return await self._submit(req.get("spec"), str(req.get("source", "<run spec>")))
        st = self.runs.get(str(req.get("run_id", "")))
        if cmd == "drain":
            self._spawn(None, self._drain())
            return {"draining": True}
        if st is None:
            raise ValueError(f"no run {req.get('run_id')!r} at site {self.name} (p2pfl runs)")
        if cmd == "vote":
            if not isinstance(req.get("accept"), bool):
                raise ValueError("vote: accept is true or false")
            if st.decision is None or st.decision.vote != "pending":
                mine = st.decision.vote if st.decision else "none"
                raise ValueError(f"run {st.run_id}: this site's vote is {mine}, not pending")
            if self._final(st) or st.commits:
                raise ValueError(f"run {st.run_id} is {self._status_of(st)}: too late to vote")
            self._vote(st, operator=req["accept"])
            return {"vote": st.decision.vote}
        if cmd == "cancel":
            if self._final(st):
                raise ValueError(f"run {st.run_id} is {self._status_of(st)} already")
            if st.proposer == self.name:
                self._end(st, "cancelled", "cancelled by this site, its proposer")
                await self._publish("cancel", st.run_id, {"scope": "run"})
                return {"cancelled": "run"}
            self._leave(st, "left by this site's operator (p2pfl cancel)")
            return {"cancelled": "left"}
        if cmd == "logs":
            return {"text": self._logs(st, req.get("node"), req.get("tail"))}
        raise ValueError(f"unknown command {cmd!r}")

    async def _submit(self, body: Any, source: str) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise ValueError("submit: spec is a mapping")
        if self._draining:
            raise ValueError(f"site {self.name} is draining: it proposes no new runs")
        spec = spec_from_dict(body, source)  # by the method's card: nothing is imported
        rid = run_id(spec)
        if rid in self.runs:
            raise ValueError(f"run {rid} was proposed already ({self._status_of(self.runs[rid])})")
        await self._publish("spec", rid, {"spec": spec.model_dump(mode="json")})
        return {"run_id": rid, "name": spec.name, "vote_deadline_s": spec.vote_deadline_s}

    def shown_status(self, entry: RunEntry) -> tuple[str, str]:
        """A ledger entry's status at this site as ``p2pfl runs`` and the metrics show it,
        and why: ``pending`` (with its reason) for a committed run that waits for a slot."""
        st = self.runs.get(entry.run_id)
        if st is not None and entry.status == "committed" and st.waiting:
            return "pending", st.waiting
        return entry.status, entry.why

    def describe_runs(self) -> list[dict[str, Any]]:
        """Every run this site holds (``p2pfl runs``): its id, name, proposer, status at
        this site (``pending`` for a committed run that waits for a slot) and why, the votes
        heard with their reasons, the members, and the last round its node finished."""
        assert self.ledger is not None
        out = []
        for entry in self.ledger.runs():
            st = self.runs.get(entry.run_id)
            status, why = self.shown_status(entry)
            winner = None
            if entry.commits:
                winner = winning_commit(
                    entry.run_id,
                    entry.proposer,
                    {c: tuple(m) for c, m in entry.commits.items()},
                )
            out.append(
                {
                    "run_id": entry.run_id,
                    "name": entry.name,
                    "proposer": entry.proposer,
                    "status": status,
                    "why": why,
                    "votes": entry.votes,
                    "members": entry.commits.get(winner, []) if winner else [],
                    "round": st.worker.last_round if st and st.worker else 0,
                    "rounds": cycle_rounds(st.spec) if st else entry.spec.get("rounds"),
                    "cycle": st.spec.series.cycle if st and st.spec.series else None,
                    "proposed_at": dt.datetime.fromtimestamp(
                        entry.proposed_at, dt.timezone.utc
                    ).isoformat(timespec="seconds"),
                    "run_dir": str(self.state_dir / "runs" / entry.run_id),
                }
            )
        return out

    def _logs(self, st: RunState, node: Any, tail: Any) -> str:
        if node not in (None, self.name):
            raise ValueError(
                f"site {self.name} holds its own node's log only; ask {node}'s daemon "
                f"(p2pfl logs {st.run_id} --site <{node}'s site file>)"
            )
        path = self.state_dir / "runs" / st.run_id / "worker.log"
        if not path.is_file():
            raise ValueError(f"run {st.run_id} has no worker log at this site")
        text = path.read_text(errors="replace")
        if isinstance(tail, int) and tail > 0:
            text = "\n".join(text.splitlines()[-tail:]) + "\n"
        return text[-LOG_ANSWER_BYTES:]
