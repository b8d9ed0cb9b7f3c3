"""Children that die with their parent: a ``preexec_fn`` that asks Linux to send a child
SIGTERM when the process that spawned it dies, however it dies (SIGKILL included), so a
site daemon's workers, serving process and broker never outlive it."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable, Iterator

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _load_prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, resolved once in the parent (a forked child calls it, nothing more)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


_PRCTL = _load_prctl()


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for a child of this process: SIGTERM to the child when this process
    dies (``PR_SET_PDEATHSIG``); None where Linux's ``prctl`` is missing. Call it in the
    thread that spawns and outlives the child (the event loop's): the signal follows the
    death of the forking thread. A child whose parent died before the ``prctl`` took effect
    ends itself at once."""
    if _PRCTL is None:
        return None
    prctl, parent = _PRCTL, os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died between fork and prctl
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def ended_children() -> Iterator[tuple[int, int]]:
    """``(pid, wait status)`` of each child of this process that has ended, collected
    without waiting for any still running (``waitpid(-1, WNOHANG)`` until none is left)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, status
