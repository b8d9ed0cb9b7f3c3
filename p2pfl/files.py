"""Files written whole or not at all: the one atomic write every writer of p2pfl uses
(records' side files, checkpoints, trained models, the dataset cache)."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_atomic(path: Path, write: Callable[[BinaryIO], object], *, fsync: bool = False) -> None:
    """``write(f)`` into a uniquely named temporary file beside ``path``, then rename it over
    ``path``: readers (and other processes writing the same file at once) never see a torn
    file, and a failed write (raised) leaves the old file in place and no temporary file
    behind. ``fsync``: the data is on disk before the rename (a checkpoint survives a
    crash)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_bytes_atomic(path: Path, data: bytes, *, fsync: bool = False) -> None:
    """:func:`write_atomic` of ``data``."""
    write_atomic(path, lambda f: f.write(data), fsync=fsync)
