"""No process of a site daemon outlives it (docs/design.md, "The site daemon").

Its helper processes (run workers, ``p2pfl serve``, ``p2pfl models offer``) run in the
daemon's process group with a parent-death signal (:func:`~p2pfl.lifeline.die_with_parent`): when the
daemon dies, even by SIGKILL, the kernel sends each of them SIGTERM. What that cannot cover
(a child that ignores the signal, a child of an older daemon) the next daemon ends at its
start: :class:`ChildRecord` keeps the pid, command line and start time of each live child in
``state_dir/children.json``, and :meth:`ChildRecord.end_leftovers` ends those still alive
whose command line and start time are still the recorded ones, so a pid the kernel reused
for another process is never signalled.

:func:`install` makes a record the one :func:`track` writes to (one daemon a process).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from p2pfl.files import write_bytes_atomic

log = logging.getLogger("p2pfl.sites.daemon")

RECORD_NAME = "children.json"


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, ``/proc/PID/stat`` field 22); None when
    no such process is readable. With the pid, it names one process for good."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # after the command name, which may hold ")"
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def command_line(pid: int) -> list[str] | None:
    """``pid``'s arguments (``/proc/PID/cmdline``); None when it is gone or a zombie."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    if not raw:  # a zombie, or a kernel thread
        return None
    return raw.rstrip(b"\0").decode(errors="surrogateescape").split("\0")


def _same(entry: dict[str, Any]) -> bool:
    """Whether the process ``entry`` records is still alive and still that process."""
    pid = entry["pid"]
    return command_line(pid) == entry["cmdline"] and (
        entry.get("started") is None or start_time(pid) == entry["started"]
    )


class ChildRecord:
    """``state_dir/children.json``: the daemon's live children, rewritten whole
    (:func:`~p2pfl.files.write_bytes_atomic`) at each change. Only the lock holder
    (:class:`~p2pfl.sites.daemon.state_lock.StateLock`) writes it."""

    def __init__(self, state_dir: str | Path):
        self.path = Path(state_dir) / RECORD_NAME
        self._entries: dict[int, dict[str, Any]] = {}

    def read(self) -> list[dict[str, Any]]:
        """The recorded entries (``pid``, ``cmdline``, ``started``); none when the file is
        missing, and none (logged) when it does not parse: a torn or foreign file must not
        stop the daemon."""
        try:
            data = json.loads(self.path.read_bytes())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            log.warning("%s: unreadable (%s); no leftover process ended", self.path, exc)
            return []
        entries = data.get("children") if isinstance(data, dict) else None
        good = [
            e
            for e in entries or []
            if isinstance(e, dict)
            and isinstance(e.get("pid"), int)
            and e["pid"] > 1
            and isinstance(e.get("cmdline"), list)
            and all(isinstance(a, str) for a in e["cmdline"])
            and isinstance(e.get("started"), (int, type(None)))
        ]
        if len(good) != len(entries or []):
            log.warning("%s: entries that are not a pid and a command line ignored", self.path)
        return good

    def _write(self) -> None:
        """Rewrite the file; a failure is logged, not raised: the record backs up the death
        signal, and a child already started must not look as if it had not."""
        body = {"daemon": os.getpid(), "children": list(self._entries.values())}
        try:
            write_bytes_atomic(self.path, json.dumps(body, indent=1).encode())
        except OSError as exc:
            log.error("%s: not written (%s)", self.path, exc)

    def add(self, pid: int, cmdline: Sequence[str]) -> None:
        """Record child ``pid``, started with ``cmdline`` (its ``exec`` arguments)."""
        self._entries[pid] = {"pid": pid, "cmdline": list(cmdline), "started": start_time(pid)}
        self._write()

    def remove(self, pid: int) -> None:
        """Forget child ``pid`` (it exited and was reaped)."""
        if self._entries.pop(pid, None) is not None:
            self._write()

    def close(self) -> None:
        """At the daemon's exit: keep only the children still alive (a child that would not
        stop is ended by the next daemon)."""
        self._entries = {pid: e for pid, e in self._entries.items() if _same(e)}
        self._write()

    def end_leftovers(self, grace: float = 10.0) -> list[int]:
        """End the recorded processes still alive as recorded (SIGTERM, SIGKILL after
        ``grace`` s) and wait until they are gone (a port they held is free again); then
        start an empty record. The pids ended."""
        alive = [e for e in self.read() if _same(e)]
        for entry in alive:
            log.warning(
                "%s: process %d left by a previous daemon (%s): ending it",
                self.path,
                entry["pid"],
                " ".join(entry["cmdline"][2:5]),
            )
            _signal(entry["pid"], signal.SIGTERM)
        left = _wait_gone(alive, grace)
        for entry in left:
            log.warning(
                "%s: process %d did not stop in %.0f s: killed", self.path, entry["pid"], grace
            )
            _signal(entry["pid"], signal.SIGKILL)
        left = _wait_gone(left, grace)
        for entry in left:  # a process in uninterruptible sleep: nothing more to do
            log.error("%s: process %d is still alive after SIGKILL", self.path, entry["pid"])
        self._entries = {}
        self._write()
        return [e["pid"] for e in alive]


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError as exc:
        log.error("process %d: cannot signal it (%s)", pid, exc)


def _wait_gone(entries: list[dict[str, Any]], timeout: float) -> list[dict[str, Any]]:
    """Those of ``entries`` still alive after up to ``timeout`` s (a zombie is gone)."""
    deadline = time.monotonic() + timeout
    while True:
        entries = [e for e in entries if _same(e)]
        if not entries or time.monotonic() >= deadline:
            return entries
        time.sleep(0.05)


_record: ChildRecord | None = None
_watchers: set[asyncio.Task] = set()


def install(record: ChildRecord | None) -> None:
    """Make ``record`` the one :func:`track` writes to (None: record nothing)."""
    global _record
    _record = record


def track(proc: asyncio.subprocess.Process, cmdline: Sequence[str]) -> None:
    """Record the child ``proc`` (started with ``cmdline``) until it exits; nothing when no
    record is installed."""
    record = _record
    if record is None:
        return
    record.add(proc.pid, cmdline)

    async def forget() -> None:
        with contextlib.suppress(Exception):
            await proc.wait()
        record.remove(proc.pid)

    task = asyncio.get_running_loop().create_task(forget())
    _watchers.add(task)
    task.add_done_callback(_watchers.discard)
