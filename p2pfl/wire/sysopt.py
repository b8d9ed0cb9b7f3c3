"""Process-level tuning for moving large weight transfers through Python.

A weight transfer allocates many ~1 MiB buffers (MQTT packets, chunks) and one large
reassembly buffer per pull. glibc serves allocations above its mmap threshold with fresh
``mmap`` pages and returns them on ``free``, so every chunk pays page faults again; measured
here, that halves the throughput of a ResNet18 pull. :func:`tune_malloc` raises the mmap and
trim thresholds so freed memory is reused. It is a no-op off glibc, and when the
``P2PFL_NO_MALLOC_TUNING`` environment variable is set.

A process that packs hundreds of nodes holds a few sockets per node (its MQTT connection,
its direct-lane listener, the pulls in flight), and the broker it starts holds one per node:
:func:`raise_fd_limit` lifts the soft open-file limit (often 1,024) to the hard one, which
children inherit.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource

M_TRIM_THRESHOLD = -1  # from glibc's malloc.h
M_MMAP_THRESHOLD = -3

_done = False


def tune_malloc(mmap_threshold: int = 256 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Keep large freed blocks in the heap for reuse; returns True when applied."""
    global _done
    if _done:
        return True
    if os.environ.get("P2PFL_NO_MALLOC_TUNING"):
        return False
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(M_TRIM_THRESHOLD, trim_threshold)
    )
    _done = ok
    return ok


def raise_fd_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit (at most 1,048,576);
    returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 1 << 20 if hard == resource.RLIM_INFINITY else min(hard, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft
    return target
