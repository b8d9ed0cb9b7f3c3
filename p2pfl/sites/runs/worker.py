"""One committed run at one site: a worker process (``python -m p2pfl node``) in the run's
own directory (``state_dir/runs/<run_id>``), so a run that crashes never takes the site
daemon down.

The directory holds ``topology.yaml`` (what the worker runs,
:func:`~p2pfl.sites.runs.topology.worker_topology`), ``run.json`` (the ``run_id``, the
policy digest it runs under, the members and the committer), ``worker.log`` and what a node
writes (``nodes/<site>.jsonl``, its checkpoint and model).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import yaml

from p2pfl.sites.runs.processes import spawn_p2pfl, stop_process
from p2pfl.sites.runs.warm_worker import WarmProcess, WarmWorkers

log = logging.getLogger(__name__)


class RunWorker:
    """The worker of run ``run_id`` for node ``site`` in ``run_dir``. Explicit lifecycle:
    :meth:`start`, then :meth:`wait` or :meth:`stop`; :meth:`new_records` reads the rounds
    its node finished since the last call."""

    def __init__(self, run_dir: Path, run_id: str, site: str):
        self.run_dir = run_dir
        self.run_id = run_id
        self.site = site
        self.proc: asyncio.subprocess.Process | WarmProcess | None = None
        self.started_at: float | None = None
        self.last_round = 0
        self._offset = 0  # bytes of the record log already read

    @property
    def records_path(self) -> Path:
        return self.run_dir / "nodes" / f"{self.site}.jsonl"

    @property
    def log_path(self) -> Path:
        return self.run_dir / "worker.log"

    async def start(
        self,
        topology: dict[str, Any],
        facts: dict[str, Any],
        warm: WarmWorkers | None = None,
        nice: int = 0,
        cpus: list[int] | None = None,
    ) -> None:
        """Write the run's files and start its worker, ``nice`` steps below the daemon's
        priority (``limits.worker_nice``), on ``cpus`` (``limits.worker_cpus``; None: any):
        forked by ``warm`` where it runs (torch imported already; a server still importing
        is waited for), else a process of its own."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        topo = self.run_dir / "topology.yaml"
        topo.write_text(yaml.safe_dump(topology, sort_keys=False))
        (self.run_dir / "run.json").write_text(json.dumps(facts, indent=1, sort_keys=True))
        argv = ["node", str(topo), "--id", self.site, "--out", str(self.run_dir), "--no-rich"]
        how = "started"
        if warm is not None and await warm.until_ready():
            try:
                self.proc = await warm.spawn(argv, self.log_path, self.run_dir, nice, cpus)
                how = "forked by the warm worker"
            except (OSError, ValueError, asyncio.TimeoutError) as exc:
                log.warning("run %s: the warm worker did not answer (%s)", self.run_id, exc)
        if self.proc is None:
            self.proc = await spawn_p2pfl(
                argv, self.log_path, cwd=self.run_dir, nice=nice, cpus=cpus
            )
        self.started_at = time.monotonic()
        log.info("run %s: worker %s (pid %d)", self.run_id, how, self.proc.pid)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def wait(self) -> int:
        """The worker's exit status once it ends."""
        assert self.proc is not None
        return await self.proc.wait()

    async def stop(self, grace: float = 10.0) -> int | None:
        """Ask the worker to stop (SIGTERM), kill it after ``grace`` s; its exit status."""
        if self.proc is None:
            return None
        return await stop_process(self.proc, grace)

    def new_records(self) -> list[dict[str, Any]]:
        """The whole records appended since the last call (a torn last line waits)."""
        try:
            with open(self.records_path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n") + 1
        self._offset += end
        records = []
        for line in chunk[:end].splitlines():
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if isinstance(rec, dict):
                    records.append(rec)
        for rec in records:
            if isinstance(rec.get("round"), int):
                self.last_round = max(self.last_round, rec["round"])
        return records

    def hours(self) -> float:
        """Hours since the worker started."""
        return 0.0 if self.started_at is None else (time.monotonic() - self.started_at) / 3600
