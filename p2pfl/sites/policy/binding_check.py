"""Whether a site's data bindings can serve a run, checked before the site consents
(docs/design.md, "The site daemon"): at the daemon's start, whenever a binding's files or
the site file change, and at every vote; and by ``p2pfl validate --site``.

:func:`check_binding` applies the rules the worker's readers apply as they load the data
(:mod:`p2pfl.learning.own_rules`, :mod:`p2pfl.learning.image_layout`), so a binding that
passes is one the worker reads:

- the binding's configuration: a site's own files (csv, parquet, npz) or a user function
  are read whole (``partition: none``, a site binding's default for them) and need
  ``classes``, the swarm's label space;
- ``csv`` / ``parquet``: the file (or ``train``/``test`` files of a folder) opens, its
  ``label`` column exists (else the nearest columns), every other column is numeric and
  finite, its labels are in ``classes``, and the ``stats`` file covers its features. Read
  :data:`~p2pfl.learning.own_rules.CHUNK_ROWS` rows at a time, so the daemon's memory stays
  bounded whatever the file's size;
- ``npz``: its four arrays, their labels in ``classes``, their shapes;
- ``imagefolder``: its class folders (by their names: no image is decoded), in ``classes``
  when it is given;
- a built-in dataset: its root exists (or it may be downloaded); ``synthetic``: nothing;
- a user function (``package.module:function``) is never imported here: the daemon runs no
  user code and imports no torch. It is reported as not checked, and the worker checks it.

Contract: torch-free (pandas and pyarrow are imported only when a table is read). A problem
names the binding's field (``data.<binding>.<field>``) and the file. The daemon runs the
check in a child process (:func:`check_in_child_main`, :mod:`p2pfl.sites.policy.binding_watch`),
so its own memory never holds pandas or a table.
"""

from __future__ import annotations

import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from p2pfl.child_answer import answer_main
from p2pfl.config.dataset_schema import DOWNLOADABLE, FILE_DATASETS, DatasetConfig, is_import_path
from p2pfl.learning.image_layout import image_layout
from p2pfl.learning.own_rules import (
    DatasetError,
    class_folders,
    four_arrays,
    frame_chunks,
    frame_columns,
    label_indices,
    labels_error,
    load_npz,
    nonfinite,
    nonfinite_error,
    own_files,
    read_stats,
    swarm_classes,
)
from p2pfl.learning.user_code import describe


@dataclass(frozen=True)
class Problem:
    """Why a binding cannot serve a run: its ``field`` (``root``, ``label``, ``classes``,
    ``partition``, ``stats``, ``name``) and what is wrong, naming the file."""

    field: str
    message: str


@dataclass(frozen=True)
class BindingCheck:
    """The check of binding ``binding``: its ``problems`` (none: it can serve a run) and a
    ``summary`` of what it holds (or why it was not looked into: ``checked`` false)."""

    binding: str
    problems: tuple[Problem, ...] = ()
    summary: str = ""
    checked: bool = True

    @property
    def ok(self) -> bool:
        return not self.problems

    def where(self, problem: Problem) -> str:
        """The site file's field of ``problem``: ``data.<binding>.<field>``."""
        return f"data.{self.binding}.{problem.field}"

    def text(self) -> str:
        """Every problem as ``data.<binding>.<field>: message``, joined by ``; ``."""
        return "; ".join(f"{self.where(p)}: {p.message}" for p in self.problems)


def _problem(exc: Exception) -> Problem:
    """A reader's error as the binding's problem (``dataset.label`` → ``label``)."""
    if isinstance(exc, DatasetError):
        return Problem(exc.field.removeprefix("dataset."), str(exc))
    if isinstance(exc, OSError):
        where = exc.filename if exc.filename else "the data"
        return Problem("root", f"{where}: cannot be read: {exc.strerror or exc}")
    return Problem("root", describe(exc))


def _own(binding: DatasetConfig) -> bool:
    """Whether the binding is data a node reads whole and only whole: a device's own files
    or a user function (``p2pfl.learning.data``: they have no partition)."""
    return binding.name in FILE_DATASETS or is_import_path(binding.name)


def check_binding(name: str, binding: DatasetConfig, site: str) -> BindingCheck:
    """The check of site ``site``'s binding ``name`` (see the module's rules), reading its
    files as the site's worker will (``{id}`` in a path is the site's name). Never raises
    for the data's sake: every problem is in the result."""
    problems: list[Problem] = []
    if _own(binding) and not binding.own_data:
        problems.append(
            Problem(
                "partition",
                f"dataset {binding.name!r} is the site's own data, read whole: partition must "
                f"be none (a site binding's default for it), not {binding.partition!r}",
            )
        )
    root = binding.root_for(site)
    if _own(binding) and binding.classes is None:  # said even when its file is missing
        try:
            swarm_classes(binding, f"data binding {name!r}")
        except DatasetError as exc:
            problems.append(_problem(exc))
    if is_import_path(binding.name):
        why = "a user function: not imported by the daemon, checked by the worker as it starts"
        return BindingCheck(name, tuple(problems), f"{binding.name}: {why}", checked=False)
    try:
        summary = _read(binding, root, site)
    except Exception as exc:  # what a reader raises on these files is this binding's problem
        found = _problem(exc)
        if all(p.field != found.field for p in problems):
            problems.append(found)
        summary = ""
    return BindingCheck(name, tuple(problems), summary)


def _read(binding: DatasetConfig, root: str | None, site: str) -> str:
    """What the binding holds (a line), or the reader's error on its files."""
    kind = binding.name
    if kind in ("csv", "parquet"):
        return _table(binding, root, site)
    if kind == "npz":
        path, _ = own_files(root, "npz", ".npz")
        names = swarm_classes(binding, str(path))
        counted = isinstance(binding.classes, int)
        x, y, tx, _, _ = four_arrays(load_npz(path), names, str(path), counted)
        return (
            f"npz {path}: {len(x)} train and {len(tx)} test samples of shape "
            f"{list(x.shape[1:])}, {_counts(np.bincount(y, minlength=len(names)), names)}"
        )
    if kind == "imagefolder":
        return _images(binding, root)
    if kind == "synthetic":
        return f"synthetic data ({binding.num_classes} classes), made by the worker"
    if root and not Path(root).expanduser().exists():
        if not (binding.download and kind in DOWNLOADABLE):
            raise DatasetError(f"{Path(root).expanduser()} does not exist")
    where = f"at {root}" if root else "in the cache"
    return f"built-in dataset {kind!r} {where} (opened by the worker)"


def _counts(counts: np.ndarray, names: list[str]) -> str:
    """``classes a 12, b 30`` (the first 10 classes), for a summary."""
    shown = ", ".join(f"{n} {int(c)}" for n, c in zip(names[:10], counts[:10], strict=False))
    more = f", … ({len(names)} classes)" if len(names) > 10 else ""
    return f"classes {shown}{more}"


def _table(binding: DatasetConfig, root: str | None, site: str) -> str:
    kind = binding.name
    ext = ".csv" if kind == "csv" else ".parquet"
    train, test = own_files(root, kind, ext)
    names = swarm_classes(binding, str(train))
    features, counts = _scan(kind, train, binding, names, None)
    rows = int(counts.sum())
    if test is not None:
        rows_test = int(_scan(kind, test, binding, names, features)[1].sum())
    if binding.stats:
        read_stats(binding.stats, site, features)
    held = f"{rows_test} test rows in {test.name}" if test is not None else "test split held out"
    return (
        f"{kind} {train}: {rows} rows, {len(features)} features, label {binding.label!r} "
        f"({_counts(counts, names)}), {held}"
    )


def _scan(
    kind: str, path: Path, binding: DatasetConfig, names: list[str], features: list[str] | None
) -> tuple[list[str], np.ndarray]:
    """``(feature columns, rows per class)`` of one table, read by chunks under the rules
    of :func:`~p2pfl.learning.own_rules.frame_xy` and
    :func:`~p2pfl.learning.own_rules.map_labels` (the same errors, over the whole file)."""
    counts = np.zeros(len(names), dtype=np.int64)
    bad_labels: dict[Any, None] = {}
    bad_columns: np.ndarray | None = None
    bad_rows = 0
    for df in frame_chunks(kind, path):
        features = frame_columns(df, binding.label, path, features)
        cols, rows = nonfinite(df[features].to_numpy(dtype=np.float64, na_value=np.nan))
        bad_columns = cols if bad_columns is None else bad_columns | cols
        bad_rows += rows
        idx, bad = label_indices(df[binding.label].to_numpy(), names)
        bad_labels.update(dict.fromkeys(bad))
        if not bad:
            counts += np.bincount(idx, minlength=len(names))
    assert features is not None  # frame_chunks yields at least one frame or raises
    if bad_rows:
        assert bad_columns is not None
        raise nonfinite_error(path, [features[j] for j in np.flatnonzero(bad_columns)], bad_rows)
    if bad_labels:
        try:  # as np.unique over the whole column lists them
            bad = sorted(bad_labels)
        except TypeError:  # pragma: no cover - a column of mixed types is text in every chunk
            bad = list(bad_labels)
        raise labels_error(str(path), bad, names, isinstance(binding.classes, int))
    return features, counts


def _images(binding: DatasetConfig, root: str | None) -> str:
    if not root:
        raise DatasetError("dataset 'imagefolder' needs dataset.root (a directory or a .zip)")
    path = Path(root).expanduser()
    if not path.exists():
        raise DatasetError(f"{path} does not exist")
    own = binding.own_data
    layout = image_layout(path, own=own)
    if layout is None:
        looked = (
            "train/<class>/ with or without test/<class>/, and <class>/"
            if own
            else ("train/<class>/ and test/<class>/")
        )
        raise DatasetError(
            f"{path} has no images in <class>/ folders (looked for {looked}, at its top or "
            "under one top-level folder)"
        )
    folders = [c for split in layout.files.values() for c, _ in split]
    names = class_folders(path, folders, binding)
    images = sum(len(split) for split in layout.files.values())
    test = len(layout.files["test"])
    held = f"{test} in test/" if test else "test split held out"
    return (
        f"imagefolder {path}: {images} images, {len(set(folders))} class folders "
        f"({', '.join(sorted(set(folders))[:10])}) of {len(names)} classes, {held}"
    )


# ----------------------------------------------------------------------------- marks


def path_mark(path: str | Path | None, depth: int = 3) -> tuple:
    """A cheap mark of a file's or folder's state (stats only): a file's inode, mtime and
    size; for a folder, those of its files and the mtimes of its folders ``depth`` deep (an
    image added to ``top/train/<class>/`` changes its folder's mtime). Empty when absent."""
    if path is None:
        return ()
    try:
        st = os.stat(Path(path).expanduser())
    except OSError:
        return ()
    if not stat.S_ISDIR(st.st_mode):
        return (st.st_ino, st.st_mtime_ns, st.st_size)
    marks: list[tuple] = [("", st.st_mtime_ns)]

    def visit(folder: str, rel: str, level: int) -> None:
        try:
            entries = list(os.scandir(folder))
        except OSError:
            return
        for e in entries:
            try:
                if e.is_dir():
                    if level < depth:
                        marks.append((f"{rel}{e.name}/", e.stat().st_mtime_ns))
                        visit(e.path, f"{rel}{e.name}/", level + 1)
                elif level == 0:
                    s = e.stat()
                    marks.append((e.name, s.st_ino, s.st_mtime_ns, s.st_size))
            except OSError:
                continue

    visit(str(Path(path).expanduser()), "", 0)
    return tuple(sorted(marks))


def binding_mark(binding: DatasetConfig, site: str) -> tuple:
    """What a binding's check depends on: its fields and the marks of its root and stats."""
    stats = binding.stats.replace("{id}", site) if binding.stats else None
    return (binding.model_dump_json(), path_mark(binding.root_for(site)), path_mark(stats))


def check_in_child_main(argv: list[str]) -> dict[str, Any]:
    """``python -m p2pfl.sites.policy.binding_check SITE BINDING_NAME BINDING_JSON``'s
    answer (:func:`~p2pfl.child_answer.answer_main`): the check of the binding (the daemon's
    memory never holds pandas or a table)."""
    from p2pfl.sites.daemon.site_file import SiteBinding

    site, name, raw = argv
    check = check_binding(name, SiteBinding.model_validate_json(raw), site)
    return {
        "problems": [[p.field, p.message] for p in check.problems],
        "summary": check.summary,
        "checked": check.checked,
    }


def check_from_answer(name: str, answer: dict[str, Any]) -> BindingCheck:
    """A :class:`BindingCheck` from :func:`check_in_child_main`'s answer."""
    problems = tuple(Problem(str(f), str(m)) for f, m in answer["problems"])
    return BindingCheck(name, problems, str(answer["summary"]), bool(answer["checked"]))


__all__ = [
    "BindingCheck",
    "Problem",
    "binding_mark",
    "check_binding",
    "check_from_answer",
    "path_mark",
]


if __name__ == "__main__":
    sys.exit(answer_main(check_in_child_main, sys.argv[1:]))
