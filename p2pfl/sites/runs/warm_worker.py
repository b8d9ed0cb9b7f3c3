"""A warm worker: a fork server that has imported torch and the node's code once, so a
committed run's worker starts in a fraction of a second instead of importing them again
(docs/design.md, "The site daemon"). The daemon itself never imports torch: the server is
a child process of its own (``python -m p2pfl.warm_server SOCKET``, :mod:`p2pfl.warm_server`);
this module is the daemon's side and the protocol.

Protocol, on a Unix socket in the site's ``state_dir`` (mode 0600: only the daemon's user):
one connection per worker; the daemon sends one JSON line ``{"argv": [...], "cwd": DIR,
"log": FILE, "nice": N, "cpus": [...]}`` (the arguments of ``p2pfl``; ``nice`` and
``cpus`` optional); the server forks, the child runs ``p2pfl ARGV`` in ``DIR`` with its
output appended to ``FILE``, ``N`` steps below the server's priority, on those CPUs, and
the server answers ``{"pid": PID}``, then ``{"exit": CODE}`` when the child ends (``-SIG``
when a signal ended it). A forked worker stays in the daemon's process group and gets
SIGTERM when the server dies, as the server does when the daemon dies
(:func:`~p2pfl.lifeline.die_with_parent`).

- :class:`WarmWorkers`: the daemon's side: start the server, and :meth:`WarmWorkers.spawn`
  a worker through it, a :class:`WarmProcess` that answers as an
  ``asyncio.subprocess.Process`` does (``pid``, ``returncode``, ``wait``, ``send_signal``,
  ``kill``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from pathlib import Path

from p2pfl.sites.daemon.process_guard import track
from p2pfl.sites.runs.processes import spawn_child, stop_process

log = logging.getLogger("p2pfl.sites.daemon")

READY = "warm worker ready"
MAX_REQUEST_BYTES = 64 << 10
START_TIMEOUT_S = 120.0  # the server's imports on a loaded machine
HANDLED = (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT)  # the server's own handlers


# ----------------------------------------------------------------------------- the daemon's
class WarmProcess:
    """A worker forked by the warm server, as the daemon sees it: what
    :class:`asyncio.subprocess.Process` gives of a child (``pid``, ``returncode``,
    :meth:`wait`, :meth:`send_signal`, :meth:`terminate`, :meth:`kill`). Its exit status
    comes from the server; should the server die first, the worker was sent SIGTERM and
    reads as ended by it."""

    def __init__(self, pid: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.pid = pid
        self.returncode: int | None = None
        self._writer = writer
        self._ended = asyncio.get_running_loop().create_task(self._await_exit(reader))

    async def _await_exit(self, reader: asyncio.StreamReader) -> None:
        code = -signal.SIGTERM
        with contextlib.suppress(Exception):
            answer = json.loads(await reader.read(4096))
            if isinstance(answer, dict) and isinstance(answer.get("exit"), int):
                code = answer["exit"]
        self.returncode = code
        self._writer.close()

    async def wait(self) -> int:
        await asyncio.shield(self._ended)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmWorkers:
    """The daemon's warm worker server (:func:`p2pfl.warm_server.serve`) in ``state_dir``: :meth:`start` it
    (it is ready once its imports are done), :meth:`spawn` workers through it, :meth:`stop`
    it. :attr:`ready` is False until it answered, and again once it died: a worker is
    then started cold by the caller."""

    def __init__(self, state_dir: Path):
        self.socket_path = Path(state_dir) / "warm-worker.sock"
        self.log_path = Path(state_dir) / "warm-worker.log"
        self.cmdline = [sys.executable, "-m", "p2pfl.warm_server", str(self.socket_path)]
        self.proc: asyncio.subprocess.Process | None = None
        self._ready: asyncio.Task | None = None
        self._starting = False

    @property
    def ready(self) -> bool:
        return (
            self._ready is not None
            and self._ready.done()
            and not self._ready.cancelled()
            and self._ready.exception() is None
            and self.proc is not None
            and self.proc.returncode is None
        )

    @property
    def started(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self) -> None:
        """Start the server (nothing when it runs or is starting); :attr:`ready` once its
        imports are done."""
        if self.started or self._starting:
            return
        self._starting = True
        try:
            self.proc = await spawn_child(self.cmdline, self.log_path, pipe_stdout=True)
        finally:
            self._starting = False
        self._ready = asyncio.get_running_loop().create_task(self._until_ready(self.proc))

    async def _until_ready(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_S)
        except asyncio.TimeoutError:
            line = b""
        if line.decode().strip() != READY:
            log.warning("warm worker: not ready (see %s): workers start cold", self.log_path)
            raise RuntimeError("warm worker not ready")
        log.info("warm worker ready (pid %d)", proc.pid)

    async def until_ready(self) -> bool:
        """Wait for a starting server's imports; whether it is ready (False: not started,
        or it failed)."""
        if self._ready is None:
            return False
        with contextlib.suppress(Exception):
            await asyncio.shield(self._ready)
        return self.ready

    async def spawn(
        self,
        argv: list[str],
        log_path: Path,
        cwd: Path,
        nice: int = 0,
        cpus: list[int] | None = None,
    ) -> WarmProcess:
        """``p2pfl ARGV`` forked by the server in ``cwd``, its output appended to
        ``log_path``, ``nice`` steps below the server's priority, on ``cpus`` (None: the
        server's); an ``OSError`` or ``ValueError`` when the server does not answer."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        reader, writer = await asyncio.open_unix_connection(str(self.socket_path))
        request = {"argv": argv, "cwd": str(cwd), "log": str(log_path), "nice": nice, "cpus": cpus}
        writer.write(json.dumps(request).encode() + b"\n")
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 10)
        answer = json.loads(line) if line else {}
        if not isinstance(answer, dict) or not isinstance(answer.get("pid"), int):
            writer.close()
            raise ValueError(f"warm worker: no pid in its answer {line[:200]!r}")
        proc = WarmProcess(answer["pid"], reader, writer)
        track(proc, self.cmdline)  # type: ignore[arg-type] - the same pid, wait and kill
        return proc

    async def stop(self) -> None:
        """Stop the server; workers it forked get SIGTERM (their parent died)."""
        if self._ready is not None:
            self._ready.cancel()
            self._ready = None
        if self.proc is not None:
            await stop_process(self.proc, 5.0)  # type: ignore[arg-type]
            self.proc = None
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
