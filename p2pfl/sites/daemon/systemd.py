"""The site daemon as a systemd service.

- :func:`unit_text`: the unit ``p2pfl daemon --print-systemd-unit`` writes (``Type=notify``,
  a watchdog, ``Restart=on-failure``, ``KillMode=mixed``, a dedicated ``User=``, the site's
  ``state_dir`` as its ``StateDirectory=``);
- :class:`Notifier`: ``sd_notify`` over the datagram socket systemd names in
  ``$NOTIFY_SOCKET`` (READY, STATUS, WATCHDOG, STOPPING), a no-op where systemd did not
  start the daemon. Plain ``socket``: no libsystemd binding to install.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import socket
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

WATCHDOG_SEC = 30
"""``WatchdogSec=`` of the unit: systemd restarts a daemon whose loop stops pinging this long."""

_PLAIN = re.compile(r"[A-Za-z0-9_@+=:,./-]+")


def _control(text: str) -> bool:
    return any(ord(c) < 0x20 or ord(c) == 0x7F for c in text)


def _quote(arg: str, *, program: bool = False) -> str:
    """``arg`` as one word of a systemd command line: ``%`` doubled (specifiers are expanded
    everywhere, quoted or not), ``$`` doubled in an argument (systemd expands ``$VAR`` in
    arguments, never in the program's path), and double-quoted with ``\\`` and ``"`` escaped
    when it holds anything but plain characters (a space, a quote, a ``;`` word, ...).
    Raises ``ValueError`` for a control character, which no unit line can hold as is."""
    if _control(arg):
        raise ValueError(f"a systemd command line cannot hold {arg!r}")
    plain = bool(_PLAIN.fullmatch(arg))
    arg = arg.replace("%", "%%")
    if not program:
        arg = arg.replace("$", "$$")
    if plain:
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _command(executable: str | Sequence[str]) -> list[str]:
    """The words of ``executable``: a sequence as given; a string that names a file as one
    word (its path may hold spaces); any other string split as shell words."""
    if not isinstance(executable, str):
        words = list(executable)
    elif os.path.isfile(executable):
        words = [executable]
    else:
        words = shlex.split(executable)
    if not words or not os.path.isabs(words[0]):
        raise ValueError(f"the executable must be an absolute path, got {executable!r}")
    return words


DEFAULT_USER = "p2pfl"
"""``User=`` of the unit unless ``--user`` names another: a system user of its own, which the
operator makes (``useradd --system p2pfl``)."""

STATE_ROOT = Path("/var/lib")
"""Where systemd makes a unit's ``StateDirectory=``."""

_STATE_DIRECTORY = re.compile(r"[A-Za-z0-9_.@+-]+(/[A-Za-z0-9_.@+-]+)*")


def state_directory(state_dir: str | Path, user: str) -> str:
    """The unit's line for the site's ``state_dir``: ``StateDirectory=<path under /var/lib>``
    (systemd makes it, owned by ``user``, before the daemon starts), or a comment saying why
    there is none and that ``state_dir`` must then be writable by ``user``."""
    path = Path(os.path.normpath(Path(state_dir).absolute()))
    if _control(str(path)):
        raise ValueError(f"a systemd unit cannot hold the state_dir {str(path)!r}")
    try:
        relative = path.relative_to(STATE_ROOT).as_posix()
    except ValueError:
        why = f"state_dir {path} is not under {STATE_ROOT}, where systemd makes state directories"
    else:
        if relative == ".":
            why = f"state_dir {path} is {STATE_ROOT} itself"
        elif not _STATE_DIRECTORY.fullmatch(relative):
            why = f"state_dir {path} holds characters StateDirectory= does not take as they are"
        else:
            return f"StateDirectory={relative}"
    return (
        f"# no StateDirectory=: {why}; make it and let User={user} write it "
        "(ProtectSystem=full keeps /usr, /boot and /etc read-only)."
    )


def unit_text(
    site_file: Path,
    *,
    executable: str | Sequence[str],
    state_dir: str | Path,
    user: str = DEFAULT_USER,
) -> str:
    """A systemd service unit that runs ``<executable> daemon --site <site_file>``.

    ``executable``: the ``p2pfl`` command, an absolute path (``/opt/p2pfl/bin/p2pfl``), a
    string of shell words (``/usr/bin/python3 -m p2pfl``) or a sequence of words; a string
    that names an existing file is taken whole, spaces and all. ``site_file`` is made
    absolute (systemd starts the daemon in ``/``). ``state_dir``: the site file's, made the
    unit's ``StateDirectory=`` when it is under ``/var/lib`` (:func:`state_directory`).
    ``user``: the ``User=`` it runs as. Raises ``ValueError`` for a relative executable, a
    user name with whitespace, or a control character in a path.

    ``KillMode=mixed``: systemd's stop sends SIGTERM to the daemon alone, which stops its
    children itself, and SIGKILL to whatever is left after the stop timeout.
    ``ProtectSystem=full`` (``/usr``, ``/boot``, ``/etc`` read-only) rather than ``strict``:
    a site's data bindings and certificates may live anywhere, and ``strict`` would need
    each of them named in ``ReadWritePaths=``.
    """
    words = _command(executable)
    if not user or any(c.isspace() or ord(c) < 0x20 for c in user):
        raise ValueError(f"User= takes a user name or id, got {user!r}")
    command = [_quote(words[0], program=True), *(_quote(w) for w in words[1:])]
    site = _quote(str(Path(site_file).absolute()))
    lines = [
        "[Unit]",
        "Description=p2pfl site daemon (peer-to-peer federated learning)",
        "After=network-online.target",
        "Wants=network-online.target",
        "",
        "[Service]",
        "Type=notify",
        "NotifyAccess=main",
        f"ExecStart={' '.join(command)} daemon --site {site}",
        "Restart=on-failure",
        "RestartSec=5",
        f"WatchdogSec={WATCHDOG_SEC}",
        "KillMode=mixed",
        f"User={user.replace('%', '%%')}",
        state_directory(state_dir, user),
        "NoNewPrivileges=yes",
        "PrivateTmp=yes",
        "ProtectSystem=full",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ]
    return "\n".join(lines)


class Notifier:
    """``sd_notify`` to the socket systemd names in ``$NOTIFY_SOCKET`` (read when made; none:
    every method is a no-op). A name starting with ``@`` is in the abstract namespace.

    A send never raises and never blocks (a datagram systemd cannot take now is lost, and
    logged at debug level): the daemon must not stop or stall for its supervisor's sake.
    """

    def __init__(self) -> None:
        self.address = os.environ.get("NOTIFY_SOCKET") or None

    @property
    def enabled(self) -> bool:
        """Whether systemd asked for notifications (``$NOTIFY_SOCKET`` is set)."""
        return self.address is not None

    def _send(self, text: str) -> None:
        if self.address is None:
            return
        address = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.setblocking(False)
                sock.sendto(text.encode(), address)
        except OSError as exc:
            log.debug("sd_notify %r to %s: %s", text, self.address, exc)

    def ready(self, status: str = "") -> None:
        """``READY=1``: the daemon is up (``Type=notify`` ends its start), with a status line."""
        self._send("READY=1" + (f"\nSTATUS={_one_line(status)}" if status else ""))

    def status(self, text: str) -> None:
        """``STATUS=``: a line ``systemctl status`` shows."""
        self._send(f"STATUS={_one_line(text)}")

    def watchdog(self) -> None:
        """``WATCHDOG=1``: the daemon's loop still runs (every :meth:`watchdog_interval`)."""
        self._send("WATCHDOG=1")

    def stopping(self) -> None:
        """``STOPPING=1``: the daemon is shutting down."""
        self._send("STOPPING=1")

    @staticmethod
    def watchdog_interval() -> float | None:
        """How often to call :meth:`watchdog`, in seconds: half of ``$WATCHDOG_USEC`` when
        it is a positive integer and ``$WATCHDOG_PID`` is absent or this process's id (the
        variables may be inherited by a child systemd did not ask); else None."""
        usec = os.environ.get("WATCHDOG_USEC", "")
        pid = os.environ.get("WATCHDOG_PID")
        if (
            not (usec.isascii() and usec.isdigit())
            or int(usec) == 0
            or (pid and pid != str(os.getpid()))
        ):
            return None
        return int(usec) / 2e6


def _one_line(text: str) -> str:
    """``text`` with its line breaks as spaces: a newline would start another field."""
    return " ".join(text.splitlines())
