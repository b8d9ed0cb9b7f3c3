""" "Did you mean …": the valid names nearest a mistyped one (a field, a method, a model, a
dataset, a command), for error messages. Pure standard library (``difflib``); the ground
floor, so the schema, the loader, the method registry and the command line share it."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def nearest(name: str, choices: Iterable[str], n: int = 3, cutoff: float = 0.6) -> list[str]:
    """Up to ``n`` of ``choices`` closest to ``name``, closest first, ties in the order
    given (``difflib`` ratio at least ``cutoff``, compared without case); ``name`` itself
    never."""
    options = [c for c in dict.fromkeys(choices) if c != name]
    lowered: dict[str, str] = {}
    for c in options:
        lowered.setdefault(c.lower(), c)
    key = name.lower()
    found = difflib.get_close_matches(key, list(lowered), n=n, cutoff=cutoff)
    order = {c: i for i, c in enumerate(lowered)}  # ties: in the order of ``choices``
    found.sort(key=lambda c: (-difflib.SequenceMatcher(None, key, c).ratio(), order[c]))
    return [lowered[c] for c in found]


def did_you_mean(name: str, choices: Iterable[str], n: int = 3) -> str:
    """``did you mean 'a'?`` / ``did you mean 'a' or 'b'?`` for the names nearest
    ``name``; empty when none is near."""
    close = [repr(c) for c in nearest(name, choices, n)]
    if not close:
        return ""
    listed = close[0] if len(close) == 1 else f"{', '.join(close[:-1])} or {close[-1]}"
    return f"did you mean {listed}?"


def with_suggestion(message: str, name: str, choices: Iterable[str]) -> str:
    """``message (did you mean …?)``, or ``message`` when no name is near."""
    hint = did_you_mean(name, choices)
    return f"{message} ({hint})" if hint else message
