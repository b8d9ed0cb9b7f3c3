"""A series of runs at a site daemon (docs/design.md, "Series"): the federation trains
again when the sites' data grows, or on a schedule, and each cycle is a run of its own.

- **Data versions.** A binding with ``watch: true`` is looked at every :data:`WATCH_S`; when
  its file or folder changed, the daemon publishes, for every series it trains on that
  binding, a signed, retained ``data`` message on the series' id: the binding, its
  ``data_version`` (content hash), ``rows``, and ``trained`` (the rows its last cycle of
  the series trained on here). A member's new rows are ``rows - trained``.
- **Cycles.** Cycle k+1 of a series is :func:`~p2pfl.sites.consent.run_spec.cycle_spec` of cycle
  k: its ``run_id`` comes from the series and k+1 alone, so every site names it alike, and
  it goes through the same vote and commit as any run. It is due once cycle k has ended at
  this site and either ``every_s`` has passed since cycle k's vote deadline, or at least
  ``quorum.min_accept`` of the series' members report ``on_new_data.min_new`` new rows.
  The last committed cycle's members propose it in an order rotated by the cycle, one
  commit grace period apart, each only while no spec of it has been heard; a site whose
  latest proposal an asked site refused as ``proposer_not_allowed`` steps to the back of
  the order (:func:`refused_proposers`). A cycle that did not commit is proposed again no
  sooner than its vote deadline, but at once when its proposer was refused in it for the
  first time and another member may propose.
- **Standing acceptance.** A site that accepted an earlier cycle under the policy digest it
  holds now accepts the next without asking its operator again (a ``pending`` vote, as
  ``approve: manual`` gives, becomes ``accept``); a changed policy votes again.
- **Warm start.** With ``warm_start: last_promoted`` a cycle after the first begins, at each
  member, from its last promoted model of the series (its personal part too:
  :meth:`~p2pfl.sites.models.store.ModelStore.warm_start`); ``run.json`` names it.

:class:`SeriesCycles` is a part of the site daemon: it receives the daemon's
:class:`~p2pfl.sites.daemon.context.SiteContext`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from p2pfl.sites.consent import messages as M
from p2pfl.sites.consent.agreement import grace_s
from p2pfl.sites.consent.run_spec import cycle_spec, run_id, series_id
from p2pfl.sites.consent.run_state import RunState
from p2pfl.sites.daemon.context import SiteContext
from p2pfl.sites.models.store import ModelStore
from p2pfl.sites.policy.binding_watch import LogLimit
from p2pfl.sites.policy.rules import Decision
from p2pfl.sites.runs.data_version import DataVersion, DataVersionError, data_version

log = logging.getLogger("p2pfl.sites.daemon")

WATCH_S = 2.0
"""How often a watched binding's file or folder is looked at."""

TICK_S = 1.0
"""How often the daemon checks whether a series' next cycle is due."""

_VERSION = re.compile(r"[0-9a-f]{16}")

PROPOSER_REFUSED = "proposer_not_allowed"
"""The reason code of a vote that refuses the run's proposer (:mod:`p2pfl.sites.policy.rules`)."""


class SeriesCycles:
    """The series this site takes part in, over the daemon's ``ctx``."""

    def __init__(self, ctx: SiteContext):
        self.ctx = ctx
        self.data_reports: dict[tuple[str, str], dict[str, Any]] = {}  # (series, site) → body
        self._versions: dict[str, DataVersion] = {}  # watched binding → its latest version
        self._trained: dict[str, int] = {}  # series → the rows its last cycle here trained on
        self._due_since: dict[str, float] = {}  # series → when its data first made it due
        self._retry_since: dict[str, float] = {}  # a cycle's run id → when it was to be retried
        self._proposed: set[str] = set()  # cycle run ids this site published
        self._watch_log = LogLimit()  # a watched binding's read errors, once a minute at most

    # ------------------------------------------------------------------ the cycles
    def _cycles(self) -> dict[str, dict[int, RunState]]:
        """Every series this daemon knows: its id → cycle number → run."""
        found: dict[str, dict[int, RunState]] = {}
        for st in self.ctx.runs.values():
            sid = series_id(st.spec)
            if sid is not None:
                found.setdefault(sid, {})[st.spec.series.cycle] = st  # type: ignore[union-attr]
        return found

    def standing(self, st: RunState, decision: Decision) -> Decision:
        """``decision`` on ``st``, a pending one turned to accept when ``st`` is a later
        cycle of a series this site accepted under the policy digest it holds now."""
        series = st.spec.series
        if decision.vote != "pending" or series is None or series.cycle == 1:
            return decision
        earlier = self._cycles().get(series_id(st.spec) or "", {})
        for k, prev in earlier.items():
            mine = prev.votes.get(self.ctx.name) or {}
            if k < series.cycle and mine.get("vote") == "accept":
                if mine.get("policy") == decision.policy:
                    return Decision("accept", (), decision.policy, decision.dp_epsilon)
        return decision

    async def ticks(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            if self.ctx.draining or not self.ctx.link.connected.is_set():
                continue
            for sid, cycles in self._cycles().items():
                try:
                    self._next_cycle(sid, cycles)
                except Exception:  # one series' trouble must not stop the others' cycles
                    log.exception(
                        "%s: series %s: its next cycle could not be checked", self.ctx.name, sid
                    )

    def _next_cycle(self, sid: str, cycles: dict[int, RunState]) -> None:
        """Propose the series' next cycle when it is due and it is this site's turn."""
        k = max(cycles)
        last = cycles[k]
        committed = [cycles[j] for j in sorted(cycles, reverse=True) if cycles[j].members]
        if not committed or self.ctx.name not in committed[0].members:  # type: ignore[operator]
            return
        if not all(self.ctx.final(st) for st in cycles.values()):
            return
        series = last.spec.series
        assert series is not None
        members = sorted(committed[0].members or ())
        refused = refused_proposers(cycles)
        now = time.time()
        due: float | None = None
        why = "the schedule"
        if _retry(cycles, k, members, refused):
            # the cycle was due and nothing trained: proposed again at once, by another site
            due = self._retry_since.setdefault(last.run_id, now)
            why = f"cycle {k}'s proposer {last.proposer} was refused"
        else:
            if series.every_s is not None:
                due = last.deadline + series.every_s
            if series.on_new_data is not None:
                grown = [m for m in members if self.new_rows(sid, m) >= series.on_new_data.min_new]
                if len(grown) >= last.spec.quorum.min_accept:
                    since = self._due_since.setdefault(sid, now)
                    if due is None or since < due:
                        due, why = since, f"new rows at {', '.join(grown)}"
                else:
                    self._due_since.pop(sid, None)
            if due is not None and last.members is None:
                # a cycle that did not commit (it may abort before its deadline) is proposed
                # again no sooner than its deadline: a refusal does not loop faster
                due = max(due, last.deadline)
        if due is None or now < due:
            return
        order = proposer_order(members, k + 1, refused)
        if now < due + order.index(self.ctx.name) * grace_s(last.spec.vote_deadline_s):
            return
        nxt = cycle_spec(last.spec, k + 1)
        rid = run_id(nxt)
        if rid in self.ctx.runs or rid in self._proposed:
            return
        self._proposed.add(rid)
        self._due_since.pop(sid, None)
        if refused:
            why += f" ({', '.join(sorted(refused))}: refused as proposer, last in turn)"
        log.info(
            "%s: series %s: proposes cycle %d (run %s): %s", self.ctx.name, sid, k + 1, rid, why
        )
        self.ctx.spawn(None, self.ctx.publish("spec", rid, {"spec": nxt.model_dump(mode="json")}))

    def new_rows(self, sid: str, site: str) -> int:
        report = self.data_reports.get((sid, site))
        if report is None:
            return 0
        return int(report["rows"]) - int(report.get("trained") or 0)

    async def cycle_inputs(self, st: RunState) -> tuple[str | None, dict[str, Any]]:
        """For a cycle starting here: the model file it warm-starts from (None: fresh) and
        what ``run.json`` records of it (series, cycle, data version, rows, warm start). The
        rows it trains on become the series' ``trained`` in this site's data reports."""
        spec = st.spec
        sid = series_id(spec)
        if spec.series is None or sid is None:
            return None, {}
        facts: dict[str, Any] = {"series": sid, "cycle": spec.series.cycle, "warm_start": None}
        binding = self.ctx.site.data[spec.data]
        if binding.root is not None and "{id}" not in binding.root:
            try:
                version = await asyncio.to_thread(data_version, binding.root)
            except DataVersionError as exc:
                log.warning("%s: run %s: no data version: %s", self.ctx.name, st.run_id, exc)
            else:
                facts.update(version.as_dict())
                self._trained[sid] = version.rows
                self._versions[spec.data] = version
                self._report(sid, spec.data)
        init = None
        if spec.series.cycle > 1 and spec.series.warm_start == "last_promoted":
            path = ModelStore(self.ctx.state_dir, self.ctx.name).warm_start(sid)
            if path is not None and path.is_file():
                init = str(path)
                facts["warm_start"] = path.parent.parent.name  # the entry's id
        return init, facts

    # ------------------------------------------------------------------ data versions
    def on_data(self, msg: M.SiteMessage) -> None:
        """A member's data report on a series: kept, the latest per (series, site)."""
        body = msg.body
        if not isinstance(body.get("binding"), str) or not _VERSION.fullmatch(
            str(body.get("data_version", ""))
        ):
            raise ValueError("a data report names its binding and a 16-hex data_version")
        rows, trained = body.get("rows"), body.get("trained")
        if not isinstance(rows, int) or rows < 0:
            raise ValueError("a data report's rows is a count")
        if trained is not None and (not isinstance(trained, int) or trained < 0):
            raise ValueError("a data report's trained is a count or none")
        self.data_reports[(msg.run_id, msg.site)] = body
        if msg.site == self.ctx.name and trained is not None:
            self._trained.setdefault(msg.run_id, trained)  # what it said before a restart

    def _report(self, sid: str, binding: str) -> None:
        version = self._versions.get(binding)
        if version is None:
            return
        body = {"binding": binding, **version.as_dict(), "trained": self._trained.get(sid)}
        self.ctx.spawn(None, self.ctx.publish("data", sid, body))

    async def watch_data(self) -> None:
        """Report every series this site trains on a watched binding whenever it changes."""
        seen: dict[str, tuple[int, ...]] = {}
        while True:
            # read each time: the site file's bindings may change under the daemon
            watched = {
                n: b.root for n, b in self.ctx.site.data.items() if b.watch and b.root is not None
            }
            for name, root in watched.items():
                try:
                    await self._look_at(name, root, seen)
                except Exception:  # the watch goes on for the other bindings and later
                    log.exception("%s: data binding %s: not looked at", self.ctx.name, name)
            await asyncio.sleep(WATCH_S)

    async def _look_at(self, name: str, root: str, seen: dict[str, tuple[int, ...]]) -> None:
        """Report binding ``name`` when its file or folder changed since ``seen``."""
        mark = await asyncio.to_thread(_stat_mark, Path(root))
        if mark == seen.get(name):
            return
        try:
            version = await asyncio.to_thread(data_version, root)
        except DataVersionError as exc:
            # looked at again every WATCH_S, said once a minute at most; a missing file is
            # the binding check's to say (/readyz, the vote)
            exists = await asyncio.to_thread(Path(root).exists)
            if exists and self._watch_log.allows(name, str(exc)):
                log.warning("%s: data binding %s: %s", self.ctx.name, name, exc)
            return
        seen[name] = mark
        if version == self._versions.get(name):
            return
        self._versions[name] = version
        log.info(
            "%s: data binding %s: version %s, %d rows",
            self.ctx.name,
            name,
            version.version,
            version.rows,
        )
        for sid, cycles in self._cycles().items():
            if any(
                st.spec.data == name and self.ctx.name in (st.members or ())
                for st in cycles.values()
            ):
                self._report(sid, name)


def refuses_proposer(st: RunState, site: str) -> bool:
    """Whether ``site``, asked by ``st``'s spec, voted on ``st`` refusing its proposer."""
    if st.spec.members != "any" and site not in st.spec.members:
        return False  # a vote nobody asked for moves no one
    reasons = (st.votes.get(site) or {}).get("reasons") or []
    return any(isinstance(r, dict) and r.get("code") == PROPOSER_REFUSED for r in reasons)


def _refused(st: RunState) -> bool:
    return any(refuses_proposer(st, site) for site in st.votes)


def refused_proposers(cycles: dict[int, RunState]) -> dict[str, int]:
    """The sites refused as proposers of a series (``cycles``: cycle → run), each with the
    cycle of its latest proposal: one that a site the spec asks voted on as
    ``proposer_not_allowed``. A site whose latest proposal no one refused is not among
    them: a policy may have changed since."""
    latest = {cycles[k].proposer: k for k in sorted(cycles)}
    return {site: k for site, k in latest.items() if _refused(cycles[k])}


def proposer_order(members: list[str], cycle: int, refused: dict[str, int]) -> list[str]:
    """Who proposes ``cycle``, in turn: the sorted ``members`` rotated by the cycle, those
    ``refused`` as proposers moved to the back (they still propose when the others are
    down). Every member computes the same order from the same retained votes."""
    turn = cycle % len(members)
    order = members[turn:] + members[:turn]
    return [m for m in order if m not in refused] + [m for m in order if m in refused]


def _retry(
    cycles: dict[int, RunState], k: int, members: list[str], refused: dict[str, int]
) -> bool:
    """Whether cycle ``k`` (the last), which did not commit, is proposed again at once: its
    proposer was refused as proposer in it for the first time (its proposal before, if any,
    was not refused), and one of ``members`` (who propose) is not refused. A retry needs a
    proposer newly refused: where every member is refused, cycles wait for the deadlines."""
    last = cycles[k]
    if last.members is not None or refused.get(last.proposer) != k:
        return False
    before = [j for j in cycles if j < k and cycles[j].proposer == last.proposer]
    if before and _refused(cycles[max(before)]):
        return False
    return any(m not in refused for m in members)


def _stat_mark(root: Path) -> tuple[int, ...]:
    """A cheap mark of a file's or folder's state: it changes when a file is written,
    added or removed (then the content hash is taken again)."""
    try:
        if root.is_file():
            st = root.stat()
            return (st.st_ino, st.st_mtime_ns, st.st_size)
        count = size = latest = 0
        for dirpath, _, files in os.walk(root):
            for f in files:
                st = os.stat(os.path.join(dirpath, f))
                count, size, latest = count + 1, size + st.st_size, max(latest, st.st_mtime_ns)
        return (count, size, latest)
    except OSError:
        return ()
