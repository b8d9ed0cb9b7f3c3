"""The plain-data state of an accountant's history, checked on the way back in.

Both accountants (:mod:`p2pfl.privacy.accountant`, :mod:`p2pfl.privacy.update_accountant`)
keep ``{"mechanism": str, "history": [[number, ...], ...]}`` in a checkpoint. This module
holds the one parser of that shape, free of Opacus and dp-accounting, so each accountant only
says what one history entry is.

Contract: :func:`parse_history` returns ``(mechanism, entries)`` with each entry a tuple, or
raises ``ValueError`` naming ``where`` and the offending field.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_history(
    state: Any, where: str, fields: Sequence[str], counts: Sequence[str] = ()
) -> tuple[str, list[tuple[Any, ...]]]:
    """``state``'s mechanism and history, each entry a tuple of ``len(fields)`` numbers
    whose fields named in ``counts`` are integers. ``ValueError`` naming ``where`` (and
    ``history[i]`` with the expected ``[fields]``) otherwise."""
    if not isinstance(state, dict) or set(state) != {"mechanism", "history"}:
        raise ValueError(f"{where}: expected a map with keys 'history', 'mechanism'")
    history = state["history"]
    if not isinstance(history, list):
        raise ValueError(f"{where}: history is not a list")
    entries: list[tuple[Any, ...]] = []
    for i, entry in enumerate(history):
        ok = (
            isinstance(entry, (list, tuple))
            and len(entry) == len(fields)
            and all(
                _is_count(v) if name in counts else _is_number(v)
                for name, v in zip(fields, entry, strict=True)
            )
        )
        if not ok:
            raise ValueError(f"{where}: history[{i}] is not [{', '.join(fields)}]: {entry!r}")
        entries.append(tuple(entry))
    return str(state["mechanism"]), entries
