"""Model states and their parts: the one home of what every method and driver exchanges.

A *state* is a ``state_dict``-like map from parameter name to tensor. Every name starts with
``g.`` (feature extractor) or ``h.`` (classifier), the contract of
:class:`~p2pfl.learning.models.SplitModel`, so a *part* of a state (``g``, ``h`` or
``all``) is chosen by name alone. This module holds the names (:data:`State`,
:data:`PARTS`), part selection, the layout check applied to every state a peer sends, and
the aggregation maths shared by the methods (docs/algorithms.md, "Shared aggregation").
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

State = dict[str, torch.Tensor]
PARTS = ("g", "h", "all")


def part_keys(keys: Iterable[str], part: str) -> list[str]:
    """The keys of ``keys`` (state_dict names, order kept) that belong to ``part``:
    ``"g"`` → those starting with ``g.``, ``"h"`` → ``h.``, ``"all"`` → every key.
    Raises ``ValueError`` for any other part."""
    if part == "all":
        return list(keys)
    if part in ("g", "h"):
        prefix = part + "."
        return [k for k in keys if k.startswith(prefix)]
    raise ValueError(f"unknown model part {part!r}; expected one of {', '.join(PARTS)}")


def select_part(state: State, part: str) -> State:
    """The named part (``g``, ``h``, ``all``) of ``state``, by parameter names."""
    return {k: state[k] for k in part_keys(list(state), part)}


def layout_mismatch(state: State, template: State) -> str | None:
    """None if ``state`` has exactly ``template``'s keys, and each tensor its shape and
    dtype; otherwise a short reason (for the log and the drop counters)."""
    if set(state) != set(template):
        missing, extra = set(template) - set(state), set(state) - set(template)
        return f"keys differ (missing {sorted(missing)[:3]}, extra {sorted(extra)[:3]})"
    for k, t in template.items():
        v = state[k]
        if not isinstance(v, torch.Tensor) or v.shape != t.shape or v.dtype != t.dtype:
            return f"tensor {k!r} does not match the model"
    return None
