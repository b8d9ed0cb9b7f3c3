"""What a watched data binding holds now (docs/design.md, "Series"): a content hash and a
row count, the ``data_version`` a site announces when its file or folder changes.

:func:`data_version` is a pure function of the files: the same bytes give the same version
on any machine. A table counts its records (a CSV's lines after the header, a Parquet
file's rows from its footer), a folder of images its image files, an ``.npz`` file the
length of its first array. The hash is BLAKE3 over the bytes (and, for a folder, each
file's path relative to it), so a renamed, added or edited file changes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import blake3

from p2pfl.errors import P2PFLError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
CHUNK = 1 << 20


class DataVersionError(P2PFLError, ValueError):
    """The binding's file or folder cannot be read; the message names it."""


@dataclass(frozen=True)
class DataVersion:
    """A binding's content: ``version`` (16 hex digits of BLAKE3) and ``rows``."""

    version: str
    rows: int

    def as_dict(self) -> dict[str, object]:
        return {"data_version": self.version, "rows": self.rows}


def data_version(root: str | Path) -> DataVersion:
    """The version and row count of the file or folder ``root`` (a binding's ``root``)."""
    path = Path(root)
    try:
        if path.is_dir():
            return _folder(path)
        if path.is_file():
            digest = blake3.blake3()
            _feed(digest, path)
            return DataVersion(digest.hexdigest()[:16], _rows(path))
    except OSError as exc:
        raise DataVersionError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    raise DataVersionError(f"{path}: no such file or folder")


def _folder(path: Path) -> DataVersion:
    digest = blake3.blake3()
    rows = 0
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    for f in files:
        rel = f.relative_to(path).as_posix().encode()
        digest.update(len(rel).to_bytes(4, "big") + rel)
        _feed(digest, f)
        if f.suffix.lower() in IMAGE_SUFFIXES:
            rows += 1
        elif f.suffix.lower() in (".csv", ".parquet", ".pq", ".npz"):
            rows += _rows(f)
    return DataVersion(digest.hexdigest()[:16], rows)


def _feed(digest: blake3.blake3, path: Path) -> None:
    size = path.stat().st_size
    digest.update(size.to_bytes(8, "big"))
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)


def _rows(path: Path) -> int:
    """The records in one data file (0 for a kind it does not count)."""
    suffix = path.suffix.lower()
    if suffix in (".csv", ".tsv", ".txt"):
        with open(path, "rb") as f:
            lines = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(CHUNK), b""))
            f.seek(max(0, path.stat().st_size - 1))
            if path.stat().st_size and f.read(1) != b"\n":
                lines += 1  # a last line without its newline
        return max(0, lines - 1)  # the header
    if suffix in (".parquet", ".pq"):
        import pyarrow.parquet as pq

        try:
            return int(pq.ParquetFile(path).metadata.num_rows)
        except (OSError, ValueError) as exc:
            raise DataVersionError(f"{path}: not a readable Parquet file: {exc}") from None
    if suffix == ".npz":
        import numpy as np

        try:
            with np.load(path, allow_pickle=False) as arrays:
                names = arrays.files
                return int(arrays[names[0]].shape[0]) if names else 0
        except (OSError, ValueError) as exc:
            raise DataVersionError(f"{path}: not a readable .npz file: {exc}") from None
    return 0
