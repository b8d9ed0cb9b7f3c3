"""The site daemon as a systemd service: the unit ``p2pfl daemon --print-systemd-unit``
writes (``Type=notify``), and ``sd_notify`` over ``$NOTIFY_SOCKET`` (READY, STATUS,
WATCHDOG, STOPPING), a no-op where systemd did not start the daemon."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

log = logging.getLogger(__name__)


def _quote(arg: str) -> str:
    """One argument of a systemd command line (quoted when it holds spaces or quotes)."""
    if arg and not any(c in arg for c in " \t\"'\\;$%"):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%") + '"'


def unit_text(site_file: Path, *, executable: str, user: str | None = None) -> str:
    """A unit that runs ``<executable> daemon --site <site_file>``; ``executable`` may be
    a command with arguments (``/usr/bin/python3 -m p2pfl``)."""
    command = " ".join(_quote(a) for a in executable.split(" "))
    lines = [
        "[Unit]",
        "Description=p2pfl site daemon (peer-to-peer federated learning)",
        "Documentation=https://github.com/p2pfl",
        "After=network-online.target",
        "Wants=network-online.target",
        "",
        "[Service]",
        "Type=notify",
        "NotifyAccess=main",
        f"ExecStart={command} daemon --site {_quote(str(site_file))}",
        "Restart=on-failure",
        "RestartSec=5",
        "WatchdogSec=30",
        "TimeoutStopSec=60",
        "StateDirectory=p2pfl",
        "NoNewPrivileges=yes",
        "PrivateTmp=yes",
        "ProtectSystem=full",
    ]
    if user:
        lines.append(f"User={user}")
    lines += ["", "[Install]", "WantedBy=multi-user.target", ""]
    return "\n".join(lines)


class Notifier:
    """``sd_notify`` to the socket systemd named in ``$NOTIFY_SOCKET`` (none: a no-op)."""

    def __init__(self) -> None:
        self.address = os.environ.get("NOTIFY_SOCKET") or None

    def _send(self, text: str) -> None:
        if self.address is None:
            return
        address = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.sendto(text.encode(), address)
        except OSError as exc:
            log.debug("sd_notify %r: %s", text, exc)

    def ready(self, status: str = "") -> None:
        self._send("READY=1" + (f"\nSTATUS={status}" if status else ""))

    def status(self, text: str) -> None:
        self._send(f"STATUS={text}")

    def watchdog(self) -> None:
        self._send("WATCHDOG=1")

    def stopping(self) -> None:
        self._send("STOPPING=1")

    @staticmethod
    def watchdog_interval() -> float | None:
        """Half of ``$WATCHDOG_USEC`` in seconds, when systemd asks this process for pings."""
        usec = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        if not usec or not usec.isdigit() or (pid and pid != str(os.getpid())):
            return None
        return int(usec) / 2e6
