"""The on-disk cache of derived dataset files (gunzipped IDX files, decoded image arrays).

Contract: the cache directory is the ``cache_dir`` argument, else ``$P2PFL_CACHE``, else
``~/.cache/p2pfl`` (:func:`default_cache_dir`). Every write into it is atomic (a temporary
file renamed over the target: :func:`atomic_write_bytes`, :func:`atomic_save_npy`), and work
that many node processes started together would repeat is done under an exclusive
inter-process lock (:func:`file_lock`), so it is done once.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np

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


def _tmp_beside(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp{os.getpid()}.{threading.get_ident()}")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all (a temporary file renamed over it)."""
    tmp = _tmp_beside(path)
    tmp.write_bytes(data)
    os.replace(tmp, path)


def atomic_save_npy(path: Path, arr: np.ndarray) -> None:
    """``np.save`` of ``arr`` to ``path``, whole or not at all."""
    tmp = _tmp_beside(path)
    with open(tmp, "wb") as fh:
        np.save(fh, arr)
    os.replace(tmp, path)


__all__ = ["atomic_save_npy", "atomic_write_bytes", "default_cache_dir", "file_lock"]
