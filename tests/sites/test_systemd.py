"""The unit ``p2pfl daemon --print-systemd-unit`` writes verifies with systemd-analyze, and
sd_notify reaches a real datagram socket."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys

import pytest

from p2pfl.sites.systemd import Notifier, unit_text


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_the_unit_verifies(tmp_path):
    site = tmp_path / "my site" / "site.yaml"
    site.parent.mkdir()
    site.write_text("site: s1\n")
    unit = tmp_path / "p2pfl-site.service"
    unit.write_text(unit_text(site, executable=f"{sys.executable} -m p2pfl", user="root"))
    text = unit.read_text()
    assert "Type=notify" in text and "WatchdogSec=" in text and "StateDirectory=p2pfl" in text
    assert f'--site "{site}"' in text
    done = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    complaints = [line for line in done.stderr.splitlines() if unit.name in line]
    assert complaints == [], done.stderr
    assert done.returncode == 0, done.stderr


def test_the_cli_prints_the_unit(tmp_path):
    site = tmp_path / "site.yaml"
    site.write_text("site: s1\nswarm: fed\nstate_dir: state\n")
    done = subprocess.run(
        [sys.executable, "-m", "p2pfl", "daemon", "--site", str(site), "--print-systemd-unit"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("[Unit]") and str(site) in done.stdout


def test_notify_sends_datagrams(tmp_path, monkeypatch):
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        n = Notifier()
        n.ready("up")
        n.watchdog()
        n.status("two runs")
        n.stopping()
        got = [sock.recv(1024).decode() for _ in range(4)]
    assert got == ["READY=1\nSTATUS=up", "WATCHDOG=1", "STATUS=two runs", "STOPPING=1"]


def test_without_systemd_it_is_a_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    Notifier().ready()  # nothing to reach, nothing raised
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert Notifier.watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", "1")
    assert Notifier.watchdog_interval() is None
