"""One site daemon per ``state_dir``: ``state_dir/daemon.lock``, held with ``flock`` for the
daemon's whole life and holding its pid (docs/design.md, "The site daemon").

The lock is taken before the daemon binds or creates anything (its admin socket, its ports,
its ledger, an embedded broker), so a second daemon on the same ``state_dir`` leaves the
first one's files alone and exits with :class:`StateDirInUse`. The kernel drops the lock
when its holder dies, however it dies: a killed daemon never leaves a stale lock behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from p2pfl.errors import P2PFLError

LOCK_NAME = "daemon.lock"


class StateDirError(P2PFLError):
    """The ``state_dir``'s lock cannot be taken: the folder or its lock file cannot be made
    or opened (its path and the system's words)."""


class StateDirInUse(StateDirError):
    """Another process (a site daemon) holds the ``state_dir``'s lock."""


class StateLock:
    """The lock of ``state_dir``: :meth:`acquire` (or ``with``) takes it or raises
    :class:`StateDirInUse` naming the ``state_dir`` and the pid that holds it; :meth:`release`
    (or leaving ``with``) drops it. The file stays: removing it would let a daemon lock a
    fresh file while another still holds the old one."""

    def __init__(self, state_dir: str | Path):
        self.state_dir = Path(state_dir)
        self.path = self.state_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> StateLock:
        """Take the lock (:class:`StateDirError` when the folder cannot be made or the lock
        file opened), writing this process's pid into it."""
        if self._fd is not None:
            raise RuntimeError(f"{self.path}: already held by this process")
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            # not inherited by the daemon's children (Python's default): a child outliving
            # the daemon must not keep its state_dir locked
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StateDirError(f"state_dir {self.state_dir}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            raise StateDirInUse(
                f"state_dir {self.state_dir} is in use by another site daemon "
                f"(pid {holder if holder is not None else 'unknown'}, lock {self.path})"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the only descriptor drops the flock

    def __enter__(self) -> StateLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_pid(fd: int) -> int | None:
    """The pid the holder wrote (None when it has not written it yet)."""
    with contextlib.suppress(OSError, ValueError):
        return int(os.pread(fd, 64, 0).decode().strip())
    return None
