"""The unit ``p2pfl daemon --print-systemd-unit`` writes verifies with systemd-analyze (paths
with spaces, ``%`` and ``$`` included; a ``state_dir`` in or out of ``/var/lib``), and
sd_notify reaches a real datagram socket."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from daemon_helpers import p2pfl_cli

from p2pfl.sites.daemon.systemd import Notifier, state_directory, unit_text

needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="no systemd-analyze"
)


def _verify(unit: Path) -> None:
    """``systemd-analyze verify`` passes and says nothing about ``unit`` (it may warn about
    the host's own units: those lines are left out)."""
    done = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    complaints = [line for line in done.stderr.splitlines() if unit.name in line]
    assert complaints == [], done.stderr
    assert done.returncode == 0, done.stderr


def _site(folder: Path) -> Path:
    folder.mkdir(parents=True)
    site = folder / "site.yaml"
    site.write_text("site: s1\nswarm: fed\nstate_dir: /var/lib/p2pfl\n")
    return site


@needs_systemd_analyze
def test_the_unit_verifies(tmp_path):
    site = _site(tmp_path / "my site")
    unit = tmp_path / "p2pfl-site.service"
    unit.write_text(
        unit_text(
            site,
            executable=[sys.executable, "-m", "p2pfl"],
            state_dir="/var/lib/p2pfl",
            user="root",
        )
    )
    text = unit.read_text()
    for line in (
        "Type=notify",
        "NotifyAccess=main",
        "WatchdogSec=30",
        "Restart=on-failure",
        "RestartSec=5",
        "KillMode=mixed",
        "StateDirectory=p2pfl",
        "User=root",
        "After=network-online.target",
        "Wants=network-online.target",
        "WantedBy=multi-user.target",
        "NoNewPrivileges=yes",
        "ProtectSystem=full",
        f'ExecStart={sys.executable} -m p2pfl daemon --site "{site}"',
    ):
        assert line in text.splitlines(), line
    _verify(unit)


@needs_systemd_analyze
def test_a_program_path_with_spaces_percent_and_dollar_verifies(tmp_path):
    # systemd-analyze checks the program exists: a path quoted or escaped wrong is not found
    bin_dir = tmp_path / "my bin %i $HOME"
    bin_dir.mkdir()
    program = bin_dir / "p2pfl"
    program.write_text("#!/bin/sh\nexit 0\n")
    program.chmod(0o755)
    site = _site(tmp_path / "sites 100%" / "$USER")
    unit = tmp_path / "p2pfl-site.service"
    # a file's name: one word, spaces and all; a state_dir outside /var/lib: a comment
    text = unit_text(site, executable=str(program), state_dir=tmp_path / "state 100%")
    unit.write_text(text)
    assert 'ExecStart="' + str(bin_dir).replace("%", "%%") + '/p2pfl" daemon' in text
    assert "sites 100%%/$$USER/site.yaml" in text  # an argument: % and $ both doubled
    assert "User=p2pfl" in text.splitlines()  # a user of its own by default
    assert "StateDirectory=" not in text.replace("# no StateDirectory=", "")
    _verify(unit)


@pytest.mark.parametrize(
    ("state_dir", "line"),
    [
        ("/var/lib/p2pfl", "StateDirectory=p2pfl"),
        ("/var/lib/p2pfl/site-a/", "StateDirectory=p2pfl/site-a"),
        ("/var/lib/x/../p2pfl", "StateDirectory=p2pfl"),
        ("/var/lib", "# no StateDirectory=: state_dir /var/lib is /var/lib itself;"),
        ("/var/lib/my site", "# no StateDirectory=: state_dir /var/lib/my site holds"),
        ("/var/lib/a:b", "# no StateDirectory=: state_dir /var/lib/a:b holds"),
        ("/srv/p2pfl", "# no StateDirectory=: state_dir /srv/p2pfl is not under /var/lib,"),
        ("/var/library", "# no StateDirectory=: state_dir /var/library is not under"),
    ],
)
def test_the_state_directory_is_the_site_files_state_dir(state_dir, line):
    got = state_directory(state_dir, "svc")
    assert got.startswith(line), got
    if got.startswith("#"):
        assert "User=svc" in got and got.endswith(".")


def test_an_executable_string_is_split_into_words(tmp_path):
    text = unit_text(
        tmp_path / "site.yaml", executable=f"{sys.executable} -m p2pfl", state_dir="/var/lib/p"
    )
    assert f"ExecStart={sys.executable} -m p2pfl daemon --site {tmp_path}/site.yaml" in text


def test_a_relative_site_file_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = unit_text(Path("site.yaml"), executable=sys.executable, state_dir="/var/lib/p")
    assert f"--site {tmp_path}/site.yaml\n" in text


@pytest.mark.parametrize(
    ("site", "executable", "user"),
    [
        ("site.yaml", "p2pfl", "p2pfl"),  # systemd's search path is not the caller's PATH
        ("site.yaml", "bin/p2pfl", "p2pfl"),
        ("site.yaml", [], "p2pfl"),
        ("site.yaml", "/usr/bin/p2pfl", "two words"),
        ("site.yaml", "/usr/bin/p2pfl", ""),
        ("site.yaml", ["/usr/bin/p2pfl\nExecStartPre=/bin/false"], "p2pfl"),
        ("site\n.yaml", "/usr/bin/p2pfl", "p2pfl"),
    ],
)
def test_bad_input_is_refused(tmp_path, site, executable, user):
    with pytest.raises(ValueError):
        unit_text(tmp_path / site, executable=executable, state_dir="/var/lib/p2pfl", user=user)


def test_a_state_dir_with_a_line_break_is_refused(tmp_path):
    with pytest.raises(ValueError):
        unit_text(tmp_path / "site.yaml", executable="/usr/bin/p2pfl", state_dir="/srv/a\nb")


def test_the_cli_prints_the_unit(tmp_path):
    site = tmp_path / "site.yaml"
    site.write_text("site: s1\nswarm: fed\nstate_dir: state\n")
    done = p2pfl_cli(
        "daemon", "--site", str(site), "--print-systemd-unit", "--user", "svc", timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("[Unit]") and str(site) in done.stdout
    lines = done.stdout.splitlines()
    assert "User=svc" in lines and "KillMode=mixed" in lines
    assert f"# no StateDirectory=: state_dir {tmp_path / 'state'} is not under" in done.stdout


@pytest.fixture
def notify_socket(tmp_path, monkeypatch):
    """A datagram socket standing in for systemd's, named in ``$NOTIFY_SOCKET``."""
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(10)
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        yield sock


def test_notify_sends_datagrams(notify_socket):
    n = Notifier()
    assert n.enabled
    n.ready("up")
    n.ready()
    n.watchdog()
    n.status("two runs\nFAKE=1")  # a line break cannot add a field
    n.stopping()
    got = [notify_socket.recv(1024).decode() for _ in range(5)]
    assert got == [
        "READY=1\nSTATUS=up",
        "READY=1",
        "WATCHDOG=1",
        "STATUS=two runs FAKE=1",
        "STOPPING=1",
    ]


def test_notify_reaches_an_abstract_socket(monkeypatch):
    name = f"p2pfl-test-{os.getpid()}-{threading.get_ident()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(10)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        Notifier().watchdog()
        assert sock.recv(1024) == b"WATCHDOG=1"


def test_a_full_socket_never_blocks_the_sender(notify_socket):
    n = Notifier()
    sender = threading.Thread(target=lambda: [n.watchdog() for _ in range(5000)], daemon=True)
    sender.start()  # nobody reads: the socket's queue fills after a few hundred datagrams
    sender.join(timeout=30)
    assert not sender.is_alive()
    assert notify_socket.recv(1024) == b"WATCHDOG=1"


def test_a_failed_send_is_logged_not_raised(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens.sock"))
    with caplog.at_level(logging.DEBUG, logger="p2pfl.sites.daemon.systemd"):
        Notifier().ready("up")
    assert any("READY=1" in r.getMessage() for r in caplog.records)


def test_without_systemd_it_is_a_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    n = Notifier()
    assert not n.enabled
    n.ready("up")  # nothing to reach, nothing raised
    n.status("x")
    n.watchdog()
    n.stopping()


@pytest.mark.parametrize(
    ("usec", "pid", "interval"),
    [
        (None, None, None),
        ("30000000", None, 15.0),
        ("30000000", "own", 15.0),
        ("30000000", "1", None),
        ("0", None, None),
        ("", None, None),
        ("thirty", None, None),
        ("-5", None, None),
    ],
)
def test_watchdog_interval(monkeypatch, usec, pid, interval):
    for name, value in (("WATCHDOG_USEC", usec), ("WATCHDOG_PID", pid)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, str(os.getpid()) if value == "own" else value)
    assert Notifier.watchdog_interval() == interval
