"""One site daemon per ``state_dir``, and none of its processes outliving it: real ``p2pfl
daemon`` processes on a real broker (docs/design.md, "The site daemon"). Each test waits on
what the daemon answers or writes, never on fixed sleeps."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
from daemon_helpers import Site, http_json, p2pfl_cli, wait

from p2pfl.launch.broker import free_port
from p2pfl.sites.daemon.admin_socket import socket_path
from p2pfl.sites.daemon.process_guard import ChildRecord, command_line

pytestmark = pytest.mark.one_broker  # what it drills is the daemon's own, not the broker's


@pytest.fixture
def sites(tmp_path, broker):
    """A factory of site daemons on ``broker`` (started unless ``start=False``)."""
    made: list[Site] = []

    def make(name: str, start: bool = True, **extra) -> Site:
        site = Site(tmp_path, name, broker.address, **extra)
        made.append(site)
        return site.start() if start else site

    yield make
    for site in made:
        site.stop()


def _serving_pid(site: Site, port: int, other_than: int | None = None) -> int:
    """The pid of ``site``'s serving process once it answers on ``port`` (503: no model yet),
    as the daemon's record of its children lists it."""

    def serving() -> int | None:
        try:
            children = json.loads((site.state_dir / "children.json").read_text())["children"]
        except (OSError, ValueError, KeyError):
            return None
        pids = [c["pid"] for c in children if "serve" in c["cmdline"] and c["pid"] != other_than]
        return pids[0] if pids else None

    wait(
        lambda: (
            serving() is not None
            and http_json("GET", f"http://127.0.0.1:{port}/v1/model")[0] == 503
        ),
        90,
        f"{site.name}'s serving process to answer",
        lambda: site.log()[-2000:],
    )
    pid = serving()
    assert pid is not None
    return pid


def test_a_second_daemon_on_the_state_dir_exits_2_and_the_first_still_answers(sites):
    s1 = sites("s1")
    second = p2pfl_cli("daemon", "--site", str(s1.path), timeout=120)
    assert second.returncode == 2, second.stdout + second.stderr
    said = second.stderr.strip()
    assert f"state_dir {s1.state_dir} " in said and f"pid {s1.proc.pid}" in said, said
    assert len(said.splitlines()) == 1 and "Traceback" not in said, said
    assert socket_path(s1.state_dir).exists()  # the first one's socket is left alone
    runs = p2pfl_cli("runs", "--site", str(s1.path), "--json")
    assert runs.returncode == 0 and json.loads(runs.stdout) == [], runs.stderr
    assert s1.proc.poll() is None


def test_a_taken_serving_port_stops_the_daemon_at_its_start(sites):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        s1 = sites("s1", start=False, serving={"listen": f"127.0.0.1:{port}"})
        done = p2pfl_cli("daemon", "--site", str(s1.path), timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    said = done.stderr.strip()
    assert f"{s1.path}: serving.listen 127.0.0.1:{port}: " in said, said
    assert len(said.splitlines()) == 1 and "Traceback" not in said, said
    assert not socket_path(s1.state_dir).exists()  # it stopped before making anything


def test_a_killed_daemons_serving_dies_with_it_and_the_next_daemon_ends_leftovers(sites):
    """SIGKILL a daemon that serves: its serving process gets the parent-death signal. A
    process recorded as the daemon's child and still running as recorded (here one in a
    session of its own, which no death signal reaches) is ended by the next daemon at its
    start; a recorded pid whose command line differs is left alone. The next daemon's
    serving then takes the port."""
    port = free_port()
    s1 = sites("s1", serving={"listen": f"127.0.0.1:{port}"})
    serving = _serving_pid(s1, port)
    s1.kill()
    wait(lambda: command_line(serving) is None, 30, f"serving process {serving} to die")

    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    leftover = subprocess.Popen([*sleeper, "leftover"], start_new_session=True)
    stranger = subprocess.Popen([*sleeper, "stranger"], start_new_session=True)
    try:
        for proc in (leftover, stranger):
            wait(lambda p=proc: command_line(p.pid) == p.args, 30, f"{proc.args[-1]} to start")
        record = ChildRecord(s1.state_dir)  # as the killed daemon would have left it
        record.add(leftover.pid, leftover.args)
        record.add(stranger.pid, [*sleeper, "what the daemon started"])
        s1.start()
        assert leftover.wait(30) < 0  # ended before the daemon answered
        assert stranger.poll() is None
        assert f"process {leftover.pid} left by a previous daemon" in s1.log()
        _serving_pid(s1, port, other_than=serving)
    finally:
        for proc in (leftover, stranger):
            proc.kill()
            proc.wait(10)
    s1.stop()
    children = json.loads((s1.state_dir / "children.json").read_text())["children"]
    assert children == []  # stopped: its serving process with it
