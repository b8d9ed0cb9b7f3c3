"""A site's consent ledger: every run proposed to it, every vote, every commit, as they came
(signed bytes kept with the fields read from them), and each run's status at this site, in
one SQLite file in ``state_dir`` (docs/design.md, "Site policy").

Statuses: ``proposed`` → ``committed`` → ``running`` → ``finished`` | ``failed``, and
``aborted`` (too few accepting sites, or this site left out) or ``cancelled`` (its proposer
cancelled it, or this site left it) from any status not yet final. A status never goes
back: :class:`LedgerError` says so.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from p2pfl.errors import P2PFLError

LEDGER_FILE = "ledger.sqlite"
"""The ledger's file in a site's ``state_dir``."""

STATUSES = ("proposed", "committed", "running", "finished", "failed", "aborted", "cancelled")
FINAL = frozenset({"finished", "failed", "aborted", "cancelled"})
NEXT = {
    "proposed": {"committed", "aborted", "cancelled"},
    "committed": {"running", "aborted", "cancelled", "failed"},
    "running": {"finished", "failed", "cancelled"},
}

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, name TEXT NOT NULL, proposer TEXT NOT NULL, spec TEXT NOT NULL,
    proposed_at REAL NOT NULL, status TEXT NOT NULL, why TEXT NOT NULL DEFAULT '',
    updated_at REAL NOT NULL, signed BLOB
);
CREATE TABLE IF NOT EXISTS votes (
    run_id TEXT NOT NULL, site TEXT NOT NULL, vote TEXT NOT NULL, reasons TEXT NOT NULL,
    policy TEXT NOT NULL, at REAL NOT NULL, signed BLOB, PRIMARY KEY (run_id, site)
);
CREATE TABLE IF NOT EXISTS commits (
    run_id TEXT NOT NULL, committer TEXT NOT NULL, members TEXT NOT NULL, at REAL NOT NULL,
    signed BLOB, PRIMARY KEY (run_id, committer)
);
CREATE TABLE IF NOT EXISTS site_status (
    run_id TEXT NOT NULL, site TEXT NOT NULL, status TEXT NOT NULL, why TEXT NOT NULL,
    round INTEGER NOT NULL, metrics TEXT NOT NULL, at REAL NOT NULL, signed BLOB,
    PRIMARY KEY (run_id, site)
);
"""


class LedgerError(P2PFLError):
    """A ledger operation that contradicts what the ledger holds."""


@dataclass(frozen=True)
class RunEntry:
    """One run as this site's ledger holds it."""

    run_id: str
    name: str
    proposer: str
    spec: dict[str, Any]
    proposed_at: float
    status: str
    why: str
    votes: dict[str, dict[str, Any]] = field(default_factory=dict)
    commits: dict[str, list[str]] = field(default_factory=dict)
    # each site's status of the run as it last told it (its own included): status, why,
    # round, metrics, at (the teller's clock)
    sites: dict[str, dict[str, Any]] = field(default_factory=dict)


class ConsentLedger:
    """The ledger at ``path`` (created with its folder when missing; ``read_only``: an
    existing one opened for reading only, ``p2pfl runs`` while its daemon is down, where a
    write is an error of SQLite's). Use it as a context manager, or call :meth:`close`."""

    def __init__(self, path: str | Path, clock: Any = time.time, *, read_only: bool = False):
        if read_only:
            self._db = sqlite3.connect(f"file:{Path(path).resolve()}?mode=ro", uri=True)
        else:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(str(path))
            self._db.executescript(SCHEMA)
        self._clock = clock

    def __enter__(self) -> ConsentLedger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._db.close()

    # ------------------------------------------------------------------ what came
    def propose(
        self, run_id: str, name: str, proposer: str, spec: dict[str, Any], signed: bytes = b""
    ) -> bool:
        """Keep a proposal; False when the run is known already (the retained spec heard
        again). A different spec under a known run_id is a :class:`LedgerError`."""
        text = json.dumps(spec, sort_keys=True, separators=(",", ":"))
        row = self._db.execute("SELECT spec FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        if row is not None:
            if row[0] != text:
                raise LedgerError(f"run {run_id}: another spec under the same id")
            return False
        now = self._clock()
        with self._db:
            self._db.execute(
                "INSERT INTO runs VALUES (?, ?, ?, ?, ?, 'proposed', '', ?, ?)",
                (run_id, name, proposer, text, now, now, signed),
            )
        return True

    def vote(self, run_id: str, site: str, record: dict[str, Any], signed: bytes = b"") -> None:
        """Keep ``site``'s latest vote on a known run (``record``: ``vote``, ``reasons``,
        ``policy``, as :meth:`~p2pfl.sites.policy.rules.Decision.as_record` gives them)."""
        self._known(run_id)
        with self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO votes VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    run_id,
                    site,
                    record["vote"],
                    json.dumps(record.get("reasons", [])),
                    record.get("policy", ""),
                    self._clock(),
                    signed,
                ),
            )

    def commit(self, run_id: str, committer: str, members: list[str], signed: bytes = b"") -> None:
        """Keep ``committer``'s commit of a known run (the first of each committer)."""
        self._known(run_id)
        with self._db:
            self._db.execute(
                "INSERT OR IGNORE INTO commits VALUES (?, ?, ?, ?, ?)",
                (run_id, committer, json.dumps(sorted(members)), self._clock(), signed),
            )

    def site_status(
        self, run_id: str, site: str, record: dict[str, Any], at: float, signed: bytes = b""
    ) -> bool:
        """Keep ``site``'s status of a known run (``record``: as
        :func:`~p2pfl.sites.consent.site_status.read_status` gives it), told at ``at`` by
        its clock; an older one than the status kept is ignored (False)."""
        self._known(run_id)
        row = self._db.execute(
            "SELECT at FROM site_status WHERE run_id = ? AND site = ?", (run_id, site)
        ).fetchone()
        if row is not None and row[0] > at:
            return False
        with self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO site_status VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    run_id,
                    site,
                    record["status"],
                    record["why"],
                    record["round"],
                    json.dumps(record["metrics"], sort_keys=True),
                    at,
                    signed,
                ),
            )
        return True

    def set_status(self, run_id: str, status: str, why: str = "") -> None:
        """Move a run to ``status`` at this site (with ``why``); a move the lifecycle does
        not allow is a :class:`LedgerError`."""
        if status not in STATUSES:
            raise LedgerError(f"unknown status {status!r}")
        current = self._known(run_id)
        if current == status:
            return
        if status not in NEXT.get(current, set()):
            raise LedgerError(f"run {run_id}: {current} cannot become {status}")
        with self._db:
            self._db.execute(
                "UPDATE runs SET status = ?, why = ?, updated_at = ? WHERE run_id = ?",
                (status, why, self._clock(), run_id),
            )

    # ------------------------------------------------------------------ what it holds
    def run(self, run_id: str) -> RunEntry | None:
        """The run ``run_id`` with its votes and commits (None: unknown here)."""
        row = self._db.execute(
            "SELECT run_id, name, proposer, spec, proposed_at, status, why FROM runs "
            "WHERE run_id = ?",
            (run_id,),
        ).fetchone()
        if row is None:
            return None
        votes = {
            site: {"vote": vote, "reasons": json.loads(reasons), "policy": policy}
            for site, vote, reasons, policy in self._db.execute(
                "SELECT site, vote, reasons, policy FROM votes WHERE run_id = ? ORDER BY site",
                (run_id,),
            )
        }
        commits = {
            committer: json.loads(members)
            for committer, members in self._db.execute(
                "SELECT committer, members FROM commits WHERE run_id = ? ORDER BY committer",
                (run_id,),
            )
        }
        rid, name, proposer, spec, at, status, why = row
        return RunEntry(
            rid,
            name,
            proposer,
            json.loads(spec),
            at,
            status,
            why,
            votes,
            commits,
            self._site_statuses(run_id),
        )

    def _site_statuses(self, run_id: str) -> dict[str, dict[str, Any]]:
        try:
            rows = self._db.execute(
                "SELECT site, status, why, round, metrics, at FROM site_status "
                "WHERE run_id = ? ORDER BY site",
                (run_id,),
            ).fetchall()
        except sqlite3.OperationalError:  # a ledger older than the table, opened read-only
            return {}
        return {
            site: {
                "status": status,
                "why": why,
                "round": round_no,
                "metrics": json.loads(metrics),
                "at": at,
            }
            for site, status, why, round_no, metrics, at in rows
        }

    def runs(self) -> list[RunEntry]:
        """Every run this site holds, oldest proposal first."""
        ids = [
            r for (r,) in self._db.execute("SELECT run_id FROM runs ORDER BY proposed_at, run_id")
        ]
        return [entry for r in ids if (entry := self.run(r)) is not None]

    def _known(self, run_id: str) -> str:
        row = self._db.execute("SELECT status FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        if row is None:
            raise LedgerError(f"run {run_id} is not known here")
        return str(row[0])
