"""Files written whole or not at all: the one atomic write every writer of p2pfl uses
(records' side files, checkpoints, trained models and their exports, the dataset cache, a
site's model store, CRLs and the broker's ACL)."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A uniquely named temporary path beside ``path`` (its folder created) for a writer
    that takes a path (a library's ``save(path)``); renamed over ``path`` when the block
    ends, removed when it raises: readers never see a torn file, and a failed write leaves
    the old file in place and no temporary file behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def write_atomic(path: Path, write: Callable[[BinaryIO], object], *, fsync: bool = False) -> None:
    """``write(f)`` into a temporary file beside ``path``, then rename it over ``path``
    (:func:`atomic_path`): readers (and other processes writing the same file at once)
    never see a torn file. ``fsync``: the data is on disk before the rename (a checkpoint
    survives a crash)."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        write(f)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def write_bytes_atomic(path: Path, data: bytes, *, fsync: bool = False) -> None:
    """:func:`write_atomic` of ``data``."""
    write_atomic(path, lambda f: f.write(data), fsync=fsync)
