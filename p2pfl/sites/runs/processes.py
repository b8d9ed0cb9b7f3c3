"""The site daemon's own helper processes (docs/design.md, "A site's own models"): each is
``python -m p2pfl ...`` with the site file, so the daemon imports no torch and a crash in
one never takes the daemon down; none outlives the daemon (:mod:`p2pfl.sites.daemon.process_guard`).

- :func:`spawn_p2pfl`: start one, its output appended to a log file (a run's worker too);
- :class:`ServingProcess`: ``p2pfl serve --site``, started again after a back-off whenever
  it exits, until the daemon stops;
- :func:`offer_model`: ``p2pfl models offer RUN_ID --site`` run to its end, when a run this
  site trained has finished: the model is kept and judged at the promotion gate.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from p2pfl.cpu_set import pin
from p2pfl.lifeline import die_with_parent
from p2pfl.sites.daemon.process_guard import track

log = logging.getLogger("p2pfl.sites.daemon")

METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""``prometheus_client``'s multiprocess folder, set in ``p2pfl serve``'s environment: where
its processes count their answers (:mod:`~p2pfl.sites.models.serving_meter`)."""
SERVING_METRICS = "serving-metrics"
"""That folder, in ``state_dir``: emptied when the daemon starts."""

RESTART_S = (1.0, 60.0)
"""The serving process's first and longest wait before it is started again."""

STEADY_S = 60.0
"""A serving process that ran this long starts again after the first wait, not a longer one."""


async def spawn_p2pfl(
    args: list[str],
    log_path: Path,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    nice: int = 0,
    cpus: list[int] | None = None,
) -> asyncio.subprocess.Process:
    """``python -m p2pfl ARGS`` (:func:`spawn_child`)."""
    cmdline = [sys.executable, "-m", "p2pfl", *args]
    return await spawn_child(cmdline, log_path, cwd, env=env, nice=nice, cpus=cpus)


async def spawn_child(
    cmdline: list[str],
    log_path: Path,
    cwd: Path | None = None,
    *,
    pipe_stdout: bool = False,
    env: dict[str, str] | None = None,
    nice: int = 0,
    cpus: list[int] | None = None,
) -> asyncio.subprocess.Process:
    """``cmdline``, its stdout and stderr appended to ``log_path`` (``pipe_stdout``: its
    stdout a pipe the caller reads, its stderr to the log), with the daemon's environment
    and ``env``, ``nice`` steps below the daemon's priority, on ``cpus`` (None: the
    daemon's). It stays in the daemon's process group and gets SIGTERM when the daemon
    dies, however it dies (:func:`~p2pfl.lifeline.die_with_parent`); the daemon's record
    of its children lists it until it exits
    (:func:`~p2pfl.sites.daemon.process_guard.track`)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    out = open(log_path, "ab")  # noqa: SIM115 - the child holds it
    try:
        proc = await asyncio.create_subprocess_exec(
            *cmdline,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE if pipe_stdout else out,
            stderr=out if pipe_stdout else asyncio.subprocess.STDOUT,
            cwd=str(cwd) if cwd is not None else None,
            preexec_fn=child_setup(nice, cpus),
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
    finally:
        out.close()
    track(proc, cmdline)
    return proc


def child_setup(nice: int = 0, cpus: list[int] | None = None) -> Callable[[], None] | None:
    """The ``preexec_fn`` of the daemon's children: they die with it
    (:func:`~p2pfl.lifeline.die_with_parent`), run ``nice`` steps below its priority and
    on ``cpus`` (None: the daemon's; :func:`~p2pfl.cpu_set.pin`)."""
    lifeline = die_with_parent()
    if not nice and cpus is None:
        return lifeline

    def preexec() -> None:
        if lifeline is not None:
            lifeline()
        os.nice(nice)
        pin(cpus)

    return preexec


async def stop_process(proc: asyncio.subprocess.Process, grace: float = 10.0) -> int:
    """SIGTERM, then SIGKILL after ``grace`` s; the exit status."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), grace)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    return proc.returncode  # type: ignore[return-value]


class ServingProcess:
    """``p2pfl serve --site SITE_FILE`` kept running: :meth:`run` until cancelled (the
    process is stopped then). :attr:`problem` says why it is not running, for ``/readyz``."""

    def __init__(self, site_file: Path, log_path: Path, metrics_dir: Path | None = None):
        """``metrics_dir``: the folder it counts its answers into
        (:mod:`~p2pfl.sites.models.serving_meter`), which the daemon's ``/metrics`` reads."""
        self.site_file = site_file
        self.log_path = log_path
        self.env = {} if metrics_dir is None else {METRICS_ENV: str(metrics_dir)}
        self.proc: asyncio.subprocess.Process | None = None
        self.problem = "serving: not started yet"

    async def run(self) -> None:
        wait = RESTART_S[0]
        try:
            while True:
                started = time.monotonic()
                self.proc = await spawn_p2pfl(
                    ["serve", "--site", str(self.site_file)], self.log_path, env=self.env
                )
                self.problem = ""
                log.info("serving: started (pid %d, log %s)", self.proc.pid, self.log_path)
                code = await self.proc.wait()
                if time.monotonic() - started >= STEADY_S:
                    wait = RESTART_S[0]
                self.problem = f"serving: exited with {code} (see {self.log_path})"
                log.error("%s; starting it again in %.0f s", self.problem, wait)
                await asyncio.sleep(wait)
                wait = min(wait * 2, RESTART_S[1])
        finally:
            if self.proc is not None:
                await asyncio.shield(stop_process(self.proc))


async def offer_model(site_file: Path, run_id: str, log_path: Path) -> tuple[int, str]:
    """Run ``p2pfl models offer RUN_ID --site SITE_FILE`` to its end: (exit status, the last
    line it printed: what the gate decided, or why the model was not kept)."""
    start = log_path.stat().st_size if log_path.is_file() else 0
    proc = await spawn_p2pfl(["models", "offer", run_id, "--site", str(site_file)], log_path)
    try:
        code = await proc.wait()
    finally:
        await asyncio.shield(stop_process(proc))
    with open(log_path, "rb") as f:
        f.seek(start)
        lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    return code, lines[-1].strip() if lines else ""
