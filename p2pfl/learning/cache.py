"""The on-disk cache of derived dataset files (gunzipped IDX files, decoded image arrays).

Contract: the cache directory is the ``cache_dir`` argument, else ``$P2PFL_CACHE``, else
``~/.cache/p2pfl`` (:func:`default_cache_dir`). Every write into it is atomic (a temporary
file renamed over the target: :func:`~p2pfl.files.write_bytes_atomic`,
:func:`atomic_save_npy`), and work
that many node processes started together would repeat is done under an exclusive
inter-process lock (:func:`file_lock`), so it is done once.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from p2pfl.files import write_atomic

try:  # POSIX only; elsewhere concurrent cache writers simply race (still atomic renames)
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]


def default_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir``, else ``$P2PFL_CACHE``, else ``~/.cache/p2pfl``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("P2PFL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "p2pfl"


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive inter-process lock on ``path`` (created if needed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        if fcntl is not None:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def atomic_save_npy(path: Path, arr: np.ndarray) -> None:
    """``np.save`` of ``arr`` to ``path``, whole or not at all."""
    write_atomic(path, lambda fh: np.save(fh, arr))


__all__ = ["atomic_save_npy", "default_cache_dir", "file_lock"]
