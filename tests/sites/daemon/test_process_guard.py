"""One daemon per ``state_dir`` and no child outliving it, piece by piece (the lock, the
record of children, the parent-death signal, the listen check): real processes, no daemon.
The daemon-level drills are in test_daemon_lifetime.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from cli_run import ROOT

from p2pfl.sites.daemon.observe import ListenError, check_listen
from p2pfl.sites.daemon.process_guard import ChildRecord, command_line, start_time
from p2pfl.sites.daemon.state_lock import StateDirError, StateDirInUse, StateLock

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _gone(pid: int, timeout: float = 30.0) -> bool:
    """Whether ``pid`` is gone (or a zombie) within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if command_line(pid) is None:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def sleepers():
    """A factory of sleeping processes in sessions of their own (no signal of ours reaches
    them but one sent to their pid); every one is killed and reaped after."""
    made: list[subprocess.Popen] = []

    def make(*extra: str) -> subprocess.Popen:
        proc = subprocess.Popen([*SLEEPER, *extra], start_new_session=True)
        made.append(proc)
        deadline = time.monotonic() + 30  # exec'd: its command line is the one given
        while command_line(proc.pid) != proc.args and time.monotonic() < deadline:
            time.sleep(0.02)
        return proc

    yield make
    for proc in made:
        proc.kill()
        proc.wait(10)


def test_a_second_lock_on_a_state_dir_names_the_holder_and_touches_nothing(tmp_path):
    state = tmp_path / "state"
    with StateLock(state) as first:
        assert first.path.read_text() == f"{os.getpid()}\n"
        with pytest.raises(StateDirInUse) as refused:
            StateLock(state).acquire()
        message = str(refused.value)
        assert f"state_dir {state} " in message and f"pid {os.getpid()}" in message
        assert "\n" not in message
        assert first.path.read_text() == f"{os.getpid()}\n"  # the holder's pid stays
    with StateLock(state):  # released: the next daemon takes it
        pass
    assert sorted(p.name for p in state.iterdir()) == ["daemon.lock"]


def test_a_state_dir_that_cannot_be_made_is_an_error_naming_it(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(StateDirError, match=f"state_dir {tmp_path / 'file' / 'state'}: "):
        StateLock(tmp_path / "file" / "state").acquire()


def test_the_lock_of_a_killed_holder_is_free(tmp_path):
    state = tmp_path / "state"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from p2pfl.sites.daemon.state_lock import StateLock; "
            "StateLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(120)",
            str(state),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StateDirInUse, match=f"pid {holder.pid}"):
            StateLock(state).acquire()
    finally:
        holder.kill()
        holder.wait(10)
    with StateLock(state):
        pass


def test_leftovers_recorded_as_they_are_are_ended_and_no_other(tmp_path, sleepers):
    """Of four recorded pids, only the one alive with its recorded command line and start
    time is ended: a changed command line or start time is another process on a reused pid."""
    leftover, renamed, restarted = sleepers("leftover"), sleepers("renamed"), sleepers("again")
    record = ChildRecord(tmp_path)
    record.add(leftover.pid, leftover.args)
    record.add(renamed.pid, [*SLEEPER, "something else"])
    record.add(restarted.pid, restarted.args)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(30)
    record.add(dead.pid, dead.args)
    body = json.loads(record.path.read_text())
    body["children"][2]["started"] -= 1  # as if an earlier process had held that pid
    record.path.write_text(json.dumps(body))

    ended = ChildRecord(tmp_path).end_leftovers(grace=10)
    assert ended == [leftover.pid]
    assert leftover.wait(10) == -signal.SIGTERM
    assert renamed.poll() is None and restarted.poll() is None
    assert json.loads(record.path.read_text())["children"] == []


def test_a_leftover_that_ignores_sigterm_is_killed(tmp_path):
    stubborn = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert stubborn.stdout.readline().strip() == "ready"
        record = ChildRecord(tmp_path)
        record.add(stubborn.pid, stubborn.args)
        assert ChildRecord(tmp_path).end_leftovers(grace=0.5) == [stubborn.pid]
        assert stubborn.wait(10) == -signal.SIGKILL
    finally:
        stubborn.kill()
        stubborn.wait(10)


@pytest.mark.parametrize("text", ["{not json", '{"children": [{"pid": "1"}, 5]}', "[]"])
def test_an_unreadable_record_ends_nothing(tmp_path, text):
    (tmp_path / "children.json").write_text(text)
    assert ChildRecord(tmp_path).end_leftovers(grace=1) == []
    assert json.loads((tmp_path / "children.json").read_text())["children"] == []


def test_the_record_follows_its_children(tmp_path, sleepers):
    record = ChildRecord(tmp_path)
    a, b = sleepers("a"), sleepers("b")
    record.add(a.pid, a.args)
    record.add(b.pid, b.args)
    record.remove(a.pid)
    body = json.loads(record.path.read_text())
    assert body["daemon"] == os.getpid()
    assert body["children"] == [{"pid": b.pid, "cmdline": b.args, "started": start_time(b.pid)}]
    record.add(a.pid, a.args)
    a.kill()
    a.wait(10)
    record.close()  # at the daemon's exit: only the children still alive stay
    assert [c["pid"] for c in json.loads(record.path.read_text())["children"]] == [b.pid]


def test_a_child_dies_with_its_parent_even_by_sigkill(tmp_path):
    """The parent spawns a child as spawn_p2pfl does (its process group, the parent-death
    signal) and is killed: the kernel sends the child SIGTERM."""
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time\n"
            "from p2pfl.lifeline import die_with_parent\n"
            f"child = subprocess.Popen({SLEEPER!r}, preexec_fn=die_with_parent())\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(120)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        child = int(parent.stdout.readline())
        assert command_line(child) == SLEEPER
        assert os.getpgid(child) == os.getpgid(parent.pid)
        parent.kill()
        parent.wait(10)
        assert _gone(child), f"child {child} outlived its parent"
    finally:
        parent.kill()
        parent.wait(10)


def test_a_taken_listen_address_is_an_error_naming_the_field():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ListenError) as refused:
            check_listen("site.yaml: serving.listen", f"127.0.0.1:{port}")
    assert str(refused.value).startswith(f"site.yaml: serving.listen 127.0.0.1:{port}: ")
    assert isinstance(refused.value, OSError)
    check_listen("serving.listen", "127.0.0.1:0")
    check_listen("serving.listen", f"127.0.0.1:{port}")  # free again
