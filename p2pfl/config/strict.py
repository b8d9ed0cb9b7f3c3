"""The base of every topology section: unknown keys and non-finite numbers refused; and of
a file the loader resolved paths in, what it recorded about them."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, PrivateAttr


class StrictModel(BaseModel):
    """A topology section: an unknown key is an error (a typo never falls back to a
    default), and so is an inf or nan anywhere (every number of a topology is a finite
    count, size or rate); assignments are validated too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class PathNotes(StrictModel):
    """A whole file's model (a topology, a ``nodes/`` file) that remembers where the loader
    resolved its relative paths from (:mod:`p2pfl.config.paths`), for error messages only:
    never validated, dumped or compared."""

    _path_notes: dict[str, str] = PrivateAttr(default_factory=dict)

    def path_note(self, field: str) -> str:
        """Where the relative path of ``field`` (``dataset.root``, ``data_root``, ...) was
        resolved from; empty when it was absolute or not recorded."""
        return self._path_notes.get(field, "")

    def note_paths(self, notes: dict[str, str]) -> None:
        """Record where relative paths resolved from (``{field: note}``; the loader's)."""
        self._path_notes = {**self._path_notes, **notes}  # copies share the old dict
