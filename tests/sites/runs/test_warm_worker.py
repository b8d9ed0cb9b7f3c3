"""A run's worker forked by the warm worker (``limits.warm_worker``), which has imported
torch once: the server alone (a worker's exit status, its log, SIGTERM) and through real
daemons (the run trains and finishes; the server ends with its daemon)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
from daemon_helpers import Site, spec, wait

from p2pfl.sites.runs.processes import spawn_child
from p2pfl.sites.runs.warm_worker import WarmWorkers

ROOT = Path(__file__).resolve().parents[3]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _niceness(pid: int) -> int:
    """A process's nice value (``/proc/PID/stat``, field 19)."""
    fields = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[16])


def test_a_daemon_child_runs_its_niceness_below_the_daemon():
    async def main() -> None:
        proc = await spawn_child(
            [sys.executable, "-c", "import time; time.sleep(30)"], Path(os.devnull), nice=5
        )
        try:
            assert _niceness(proc.pid) == os.nice(0) + 5
        finally:
            proc.kill()
            await proc.wait()

    asyncio.run(main())


def test_a_daemon_child_runs_on_its_cpus():
    """``limits.worker_cpus`` on a worker started cold: the child and what it starts."""
    cpu = min(os.sched_getaffinity(0))

    async def main() -> None:
        proc = await spawn_child(
            [sys.executable, "-c", "import time; time.sleep(30)"], Path(os.devnull), cpus=[cpu]
        )
        try:
            assert os.sched_getaffinity(proc.pid) == {cpu}
        finally:
            proc.kill()
            await proc.wait()

    asyncio.run(main())


def test_the_warm_worker_forks_p2pfl_and_reports_how_each_ended(tmp_path):
    async def main() -> None:
        warm = WarmWorkers(tmp_path)
        await warm.start()
        assert await warm.until_ready()
        assert oct(warm.socket_path.stat().st_mode & 0o777) == "0o600"
        log = tmp_path / "w.log"
        ok = await warm.spawn(["validate", "topologies/ring-8.yaml"], log, ROOT)
        bad = await warm.spawn(["validate", "no-such.yaml"], log, ROOT)
        assert (await ok.wait(), await bad.wait()) == (0, 2)
        assert "no-such.yaml" in log.read_text()
        server = warm.proc.pid
        cpu = max(os.sched_getaffinity(0))
        long = await warm.spawn(
            ["swarm", "topologies/ring-8.yaml", "--out", str(tmp_path)],
            log,
            ROOT,
            nice=7,
            cpus=[cpu],
        )
        # limits.worker_nice and limits.worker_cpus: the worker trains 7 steps below the
        # server's priority on one CPU (set by the child after the fork, which the
        # server's answer may precede)
        want = (_niceness(server) + 7, {cpu})
        for _ in range(200):
            if (_niceness(long.pid), os.sched_getaffinity(long.pid)) == want:
                break
            await asyncio.sleep(0.05)
        assert (_niceness(long.pid), os.sched_getaffinity(long.pid)) == want
        assert os.sched_getaffinity(server) == os.sched_getaffinity(0)
        long.send_signal(signal.SIGTERM)
        assert await long.wait() != 0
        await warm.stop()
        assert not _alive(server) and not warm.socket_path.exists()

    asyncio.run(main())


@pytest.mark.integration
@pytest.mark.one_broker
def test_a_committed_run_starts_from_the_warm_worker(tmp_path, broker):
    """s1 keeps a warm worker from its start (``true``), s2 starts one at its vote
    (``auto``); both runs' workers are forked by it and train to the end, s2's on the one
    CPU of its ``limits.worker_cpus``. A SIGKILLed daemon's warm worker and the worker it
    forked end with it."""
    cpu = max(os.sched_getaffinity(0))
    s1 = Site(tmp_path, "s1", broker.address, limits={"warm_worker": True}).start()
    s2 = Site(tmp_path, "s2", broker.address, limits={"worker_cpus": str(cpu)}).start()
    try:
        wait(lambda: "warm worker ready" in s1.log(), 120, "s1's warm worker")
        rid = s1.ask("submit", spec=spec(members=["s1", "s2"], rounds=2))["run_id"]
        for site in (s1, s2):
            assert site.wait_status(rid, {"finished"}, 180)["round"] == 2
            assert "forked by the warm worker" in site.log()
            assert len(site.records(rid)) == 2

        long = s1.ask("submit", spec=spec("long", members=["s1", "s2"], rounds=400))["run_id"]
        s2.wait_status(long, {"running"}, 120)
        worker = s2.worker_pid(long)
        server = int(s2.log().split("warm worker ready (pid ")[1].split(")")[0])
        assert os.sched_getaffinity(worker) == {cpu}
        s2.kill()
        wait(lambda: not _alive(worker) and not _alive(server), 30, "s2's workers to end")
    finally:
        s2.stop()
        s1.stop()
