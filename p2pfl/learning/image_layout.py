"""Where the images of an ImageFolder are (a ``.zip`` or a directory): ``train/<class>/*``
and ``test/<class>/*``, at its top or under one top-level folder, or for a device's own
folder also ``train/<class>/*`` alone or ``<class>/*`` (:func:`image_layout`).

Contract: the standard library only (names are listed, no image is opened), so a site's
binding check (:mod:`p2pfl.sites.policy.binding_check`) reads an image folder's classes by the
rule the reader (:func:`p2pfl.learning.readers.load_imagefolder`) decodes it by. A zip that
cannot be read is a :class:`~p2pfl.learning.own_rules.DatasetError` naming it.
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

from p2pfl.learning.own_rules import DatasetError

IMAGE_EXTENSIONS = (
    ".jpg",
    ".jpeg",
    ".png",
    ".bmp",
    ".gif",
    ".ppm",
    ".pgm",
    ".tif",
    ".tiff",
    ".webp",
)


@dataclass
class Layout:
    """Where ``train/<class>/*`` and ``test/<class>/*`` are, inside a zip or a directory
    (``test`` empty: a device's own folder without a test split)."""

    source: Path
    is_zip: bool
    files: dict[str, list[tuple[str, str]]]  # split -> [(class, member path)]


def _is_image(name: str) -> bool:
    base = name.rsplit("/", 1)[-1]
    return not base.startswith(".") and base.lower().endswith(IMAGE_EXTENSIONS)


def _split_members(names: list[str], prefix: str) -> dict[str, list[tuple[str, str]]]:
    files: dict[str, list[tuple[str, str]]] = {"train": [], "test": []}
    for nm in names:
        if not nm.startswith(prefix) or not _is_image(nm):
            continue
        parts = nm[len(prefix) :].split("/")
        if len(parts) == 3 and parts[0] in files and parts[1]:
            files[parts[0]].append((parts[1], nm))
    return files


def _class_members(names: list[str], prefix: str) -> list[tuple[str, str]]:
    """``<prefix><class>/<image>`` members as ``(class, member)``."""
    found = []
    for nm in names:
        if not nm.startswith(prefix) or not _is_image(nm):
            continue
        parts = nm[len(prefix) :].split("/")
        if len(parts) == 2 and parts[0]:
            found.append((parts[0], nm))
    return found


def _layout_of_names(
    source: Path, is_zip: bool, names: list[str], prefixes: list[str], own: bool
) -> Layout | None:
    """The first layout the member ``names`` have under one of ``prefixes``: ``train/`` and
    ``test/``; with ``own`` also ``train/`` alone, then ``<class>/`` folders (everything in
    the ``train`` split, the ``test`` split empty)."""
    for prefix in prefixes:
        files = _split_members(names, prefix)
        if files["train"] and files["test"]:
            return Layout(source, is_zip, files)
    if not own:
        return None
    for prefix in prefixes:
        files = _split_members(names, prefix)
        if files["train"]:
            return Layout(source, is_zip, {"train": files["train"], "test": []})
    for prefix in prefixes:
        flat = _class_members(names, prefix)
        if flat:
            return Layout(source, is_zip, {"train": flat, "test": []})
    return None


def image_layout(source: Path, own: bool = False) -> Layout | None:
    """The layout of ``source`` (a ``.zip`` or a directory) if it has ``train/<class>/<img>``
    and ``test/<class>/<img>``, at the top or under one top-level folder; with ``own`` (a
    device's own folder) also ``train/<class>/<img>`` alone or ``<class>/<img>``, whose
    images all land in the train split. Else ``None``."""
    if source.is_file() and source.suffix.lower() == ".zip":
        try:
            with zipfile.ZipFile(source) as zf:
                names = [n for n in zf.namelist() if not n.startswith("__MACOSX/")]
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            raise DatasetError(
                f"{source}: not a readable zip (corrupt or truncated?): {exc}"
            ) from None
        tops = {n.split("/", 1)[0] for n in names if "/" in n}
        return _layout_of_names(source, True, names, ["", *sorted(t + "/" for t in tops)], own)
    if source.is_dir():
        subdirs = [p for p in sorted(source.iterdir()) if p.is_dir() and not p.name.startswith(".")]
        for base in [source, *subdirs]:
            if (base / "train").is_dir() and (base / "test").is_dir():
                names = [
                    str(p.relative_to(source)).replace(os.sep, "/")
                    for split in ("train", "test")
                    for p in sorted((base / split).glob("*/*"))
                    if p.is_file()
                ]
                rel = base.relative_to(source)
                prefix = "" if str(rel) == "." else str(rel).replace(os.sep, "/") + "/"
                files = _split_members(names, prefix)
                if files["train"] and files["test"]:
                    return Layout(source, False, files)
        if not own:
            return None
        names = [
            str(p.relative_to(source)).replace(os.sep, "/")
            for base in [source, *subdirs]
            for pattern in ("train/*/*", "*/*")
            for p in sorted(base.glob(pattern))
            if p.is_file()
        ]
        names = list(dict.fromkeys(names))
        prefixes = ["", *(p.name + "/" for p in subdirs)]
        return _layout_of_names(source, False, names, prefixes, own)
    return None


__all__ = ["IMAGE_EXTENSIONS", "Layout", "image_layout"]
