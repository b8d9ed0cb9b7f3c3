"""Paths a YAML file names, resolved as docker-compose resolves them: a relative path is
relative to the folder of the file it is written in; an absolute path (or ``~/…``) is
unchanged. Values given on the command line (``--data-root``, ``--set``, ``--certs``)
resolve against the current directory, as any command-line path does.

Contract: :func:`resolve_fields` rewrites the named fields of a raw YAML mapping in place
into absolute paths and says, per field it rewrote, where it resolved from
(:attr:`PathBase.note`), so that a "does not exist" error can print the path it looked at
and why there. A user's own code (``package.module:name``) is imported from the folder of
the topology that names it (``code_dir``, :func:`use_code_dir`) before the current
directory. Pure standard library: the ground floor (docs/design.md, "Configuration").
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOPOLOGY_PATHS = (
    "dataset.root",
    "dataset.test_root",
    "dataset.stats",
    "security.certs",
    "code_dir",
)
"""The fields of a topology file that hold paths (dotted)."""

NODE_PATHS = ("data_root", "certs")
"""The fields of a device's ``nodes/`` file that hold paths."""


@dataclass(frozen=True)
class PathBase:
    """The folder relative paths resolve against (absolute), and how to name it to a user
    (``the folder of topology.yaml``, ``the current directory``)."""

    folder: str
    what: str

    @classmethod
    def of_file(cls, path: str | os.PathLike[str]) -> PathBase:
        """The folder of the YAML file at ``path``."""
        p = Path(path)
        return cls(os.path.dirname(os.path.abspath(p)), f"the folder of {p.name}")

    @classmethod
    def cwd(cls) -> PathBase:
        """The current directory: where command-line values resolve."""
        return cls(os.getcwd(), "the current directory")

    def resolve(self, value: str) -> str:
        """``value`` as an absolute, normalised path (``{id}`` templates kept)."""
        if not is_relative(value):
            return value
        return os.path.normpath(os.path.join(self.folder, value))

    @property
    def note(self) -> str:
        """Where relative paths resolve, for an error message."""
        return f"relative paths resolve against {self.folder}, {self.what}"


def is_relative(value: Any) -> bool:
    """Whether ``value`` is a relative path to resolve: a non-empty string, not absolute,
    not ``~``-rooted (the reader expands it) and not a URL (a dataset function's root may
    be one)."""
    return (
        isinstance(value, str)
        and bool(value.strip())
        and not value.startswith("~")
        and not os.path.isabs(value)
        and "://" not in value
    )


def field_value(data: dict[str, Any], name: str) -> Any:
    """The value of the dotted field ``name`` in the mapping ``data`` (None if absent)."""
    cur: Any = data
    for key in name.split("."):
        cur = cur.get(key) if isinstance(cur, dict) else None
    return cur


def resolve_fields(data: dict[str, Any], fields: Iterable[str], base: PathBase) -> dict[str, str]:
    """Rewrite each dotted field of ``data`` that holds a relative path into an absolute one
    against ``base``, in place; ``{field: base.note}`` for each one rewritten. A field that
    is missing, or under a value that is not a mapping, is left for the schema to report."""
    notes: dict[str, str] = {}
    for name in fields:
        *parents, leaf = name.split(".")
        cur: Any = data
        for key in parents:
            cur = cur.get(key) if isinstance(cur, dict) else None
        if isinstance(cur, dict) and is_relative(cur.get(leaf)):
            cur[leaf] = base.resolve(cur[leaf])
            notes[name] = base.note
    return notes


_CODE_DIRS: list[str] = []


def use_code_dir(folder: str) -> None:
    """Make ``folder`` (absolute) the first place a user's ``package.module`` is imported
    from; the latest topology loaded wins."""
    if folder in sys.path:
        sys.path.remove(folder)
    sys.path.insert(0, folder)
    if folder in _CODE_DIRS:
        _CODE_DIRS.remove(folder)
    _CODE_DIRS.insert(0, folder)


def code_dirs() -> list[str]:
    """The folders :func:`use_code_dir` made importable, latest first."""
    return list(_CODE_DIRS)
