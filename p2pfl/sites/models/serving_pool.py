"""The processes that answer a site's served model (``p2pfl serve --site``): one
:class:`~p2pfl.sites.models.serving.ModelServer`, or ``serving.workers`` of them forked
around one listening socket (docs/design.md, "A site's own models").

A request's CPU work (HTTP parsing, JSON, the inputs' normalisation) holds a Python
process's GIL; onnxruntime releases it but is the small part of an answer. So a pool of
processes, not threads, uses the cores: the parent binds ``serving.listen`` once, imports
torch and onnxruntime once (the workers share those pages), forks the workers and then
only supervises. Each worker loads the served model itself (its own watcher, its own
onnxruntime session) and accepts on the shared, non-blocking socket: the worker that wins
a connection answers it; the others go back to waiting. A worker that dies is forked again
(after :data:`RESPAWN_S` when it lived less than that); SIGTERM or Ctrl-C stops every
worker and then the parent. A worker ends with its parent however the parent dies
(``PR_SET_PDEATHSIG``: :func:`~p2pfl.lifeline.die_with_parent`). Workers load a newly served
model each on its own watch: for a moment two workers may answer with different models,
each request wholly with one of them (the answer names it)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time

from p2pfl.cpu_set import format_cpus, usable_cpus
from p2pfl.lifeline import die_with_parent, ended_children
from p2pfl.sites.models.serving import ModelServer
from p2pfl.sites.models.store import ModelStore

log = logging.getLogger(__name__)

RESPAWN_S = 1.0
"""A worker that died sooner than this after its start is forked again after this long."""
STOP_S = 10.0
"""How long the parent waits for its workers after SIGTERM before it SIGKILLs them."""
_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGCHLD}


def usable_cores() -> int:
    """The cores this process may run on (``serving.cpus`` once pinned to them):
    ``serving.workers: auto``."""
    return max(1, len(usable_cpus()))


def serve(
    store: ModelStore,
    listen: tuple[str, int],
    max_request_bytes: int,
    missing: str = "refuse",
    runtime: str = "onnx",
    workers: int = 1,
) -> None:
    """Serve until the process is told to stop (SIGTERM or Ctrl-C): in this process when
    ``workers`` is 1, else in ``workers`` forked processes."""
    server = ModelServer(
        store, *listen, max_request_bytes=max_request_bytes, missing=missing, runtime=runtime
    )
    host, port = server.address
    log.info(
        "%s: serving on http://%s:%d (/v2/models/%s/infer, POST /v1/predict, GET /v1/model), "
        "%d worker%s on CPUs %s, %s",
        store.site,
        host,
        port,
        store.site,
        workers,
        "" if workers == 1 else "s",
        format_cpus(usable_cpus()),
        runtime,
    )
    if workers <= 1:
        _serve_here(server)
        return
    # what every worker imports, imported once before the fork
    import aiohttp.web  # noqa: F401
    import onnxruntime  # noqa: F401
    import pandas  # noqa: F401

    import p2pfl.export.predict  # noqa: F401  (torch)

    server.sock.setblocking(False)  # a worker that loses an accept race waits again
    _Pool(server, workers).run()


def _serve_here(server: ModelServer) -> None:
    """One server in this process until SIGTERM or Ctrl-C."""
    server.start()

    def on_signal(*_: object) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()


class _Pool:
    """The parent of the workers: forks them, forks a dead one again, stops them all. It
    is single-threaded and takes its signals synchronously (``sigwaitinfo``), so nothing
    holds a lock across a fork."""

    def __init__(self, server: ModelServer, workers: int):
        self.server = server
        self.size = workers
        self.started: dict[int, float] = {}  # worker pid -> when it was forked
        self._preexec = die_with_parent()

    def run(self) -> None:
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
        try:
            for _ in range(self.size):
                self._fork(old_mask)
            while True:
                sig = signal.sigwaitinfo(_SIGNALS).si_signo
                if sig != signal.SIGCHLD:
                    break
                respawn = self._reap()
                if respawn:
                    time.sleep(RESPAWN_S)  # a worker that fails at once: not a busy loop
                for _ in range(respawn):
                    self._fork(old_mask)
        finally:
            self._stop()
            self.server.sock.close()
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

    def _fork(self, old_mask: set[signal.Signals]) -> None:
        pid = os.fork()
        if pid:
            self.started[pid] = time.monotonic()
            return
        code = 1
        try:  # the worker: default signals, its parent's death its own
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            if self._preexec is not None:
                self._preexec()
            _serve_here(self.server)
            code = 0
        except BaseException:
            log.exception("%s: serving worker %d failed", self.server.store.site, os.getpid())
        finally:
            logging.shutdown()
            os._exit(code)

    def _reap(self) -> int:
        """Collect the workers that ended; how many to fork again."""
        respawn = 0
        for pid, status in ended_children():
            started = self.started.pop(pid, None)
            if started is None:
                continue
            log.error(
                "%s: serving worker %d ended (%s) after %.1f s; forking another",
                self.server.store.site,
                pid,
                _status(status),
                time.monotonic() - started,
            )
            respawn += 1
        return respawn

    def _stop(self) -> None:
        """SIGTERM to every worker; SIGKILL to those still there after :data:`STOP_S`."""
        for pid in self.started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_S
        while self.started and time.monotonic() < deadline:
            for pid, _ in ended_children():
                self.started.pop(pid, None)
            if self.started:
                time.sleep(0.05)
        for pid in self.started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        self.started.clear()


def _status(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit {os.waitstatus_to_exitcode(status)}"
