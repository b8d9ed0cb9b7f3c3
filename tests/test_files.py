"""The one atomic write (p2pfl/files.py): whole or not at all, and nothing left behind."""

from __future__ import annotations

import pytest

from p2pfl.files import atomic_path, write_bytes_atomic


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "sub" / "f.json"
    write_bytes_atomic(path, b"old")
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("the writer failed")
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in path.parent.iterdir()) == ["f.json"]
    with atomic_path(path) as tmp:  # a library that writes to a path
        tmp.write_bytes(b"new")
        assert path.read_bytes() == b"old"  # readers see the old file until the end
    assert path.read_bytes() == b"new"
    assert sorted(p.name for p in path.parent.iterdir()) == ["f.json"]
