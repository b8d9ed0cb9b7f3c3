"""Model states and their parts: the one home of what every method and driver exchanges.

A *state* is a ``state_dict``-like map from parameter name to tensor. Every name starts with
``g.`` (feature extractor) or ``h.`` (classifier), the contract of
:class:`~p2pfl.learning.models.SplitModel`, so a *part* of a state (``g``, ``h`` or
``all``) is chosen by name alone. This module holds the names (:data:`State`,
:data:`PARTS`), part selection, the layout check applied to every state a peer sends, and
the aggregation maths shared by the methods (docs/algorithms.md, "Shared aggregation").
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

State = dict[str, torch.Tensor]
PARTS = ("g", "h", "all")


@dataclass(frozen=True, eq=False)
class TensorStamp:
    """Which tensor objects, at which of torch's version counters (which every in-place
    change, an optimizer step or a ``load_state_dict`` moves): what a cache of a value
    computed from tensors keys on, so that the value is reused only while the very same
    tensors are unchanged."""

    tensors: tuple[torch.Tensor, ...]
    versions: tuple[int, ...]

    @classmethod
    def of(cls, tensors: Iterable[torch.Tensor]) -> TensorStamp | None:
        """The stamp of ``tensors``; None where one is not a tensor or keeps no version
        (nothing can then be cached)."""
        held = tuple(tensors)
        try:
            return cls(held, tuple(t._version for t in held))
        except (AttributeError, RuntimeError):
            return None

    def matches(self, other: TensorStamp | None) -> bool:
        """Whether ``other`` stamps the same tensor objects at the same versions."""
        return (
            other is not None
            and len(self.tensors) == len(other.tensors)
            and self.versions == other.versions
            and all(a is b for a, b in zip(self.tensors, other.tensors, strict=True))
        )


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


def layout_mismatch(state: State, template: State, *, dtype: bool = True) -> str | None:
    """None if ``state`` has exactly ``template``'s keys, and each tensor its shape and (with
    ``dtype``, the default) its dtype; otherwise a short reason (for the log, the drop
    counters and error messages). ``dtype=False`` is for a state the caller casts itself
    (``load_state_dict`` copies into the model's dtype)."""
    if not isinstance(state, Mapping):
        return "not a map"
    if set(state) != set(template):
        missing, extra = set(template) - set(state), set(state) - set(template)
        return f"keys differ (missing {sorted(missing)[:3]}, extra {sorted(extra)[:3]})"
    for k, t in template.items():
        v = state[k]
        if not isinstance(v, torch.Tensor):
            return f"tensor {k!r} does not match (not a tensor)"
        if v.shape != t.shape:
            return (
                f"tensor {k!r} does not match (shape {tuple(v.shape)}, expected {tuple(t.shape)})"
            )
        if dtype and v.dtype != t.dtype:
            return f"tensor {k!r} does not match (dtype {v.dtype}, expected {t.dtype})"
    return None


def _check_weights(weights: Sequence[float], n: int) -> tuple[list[float], float]:
    """``weights`` as floats and their sum; ``ValueError`` unless there is one per state, each
    finite and non-negative, with a positive finite sum."""
    if len(weights) != n:
        raise ValueError(f"weighted_mean: {n} states but {len(weights)} weights")
    w = [float(x) for x in weights]
    if any(not math.isfinite(x) or x < 0 for x in w):
        raise ValueError("weighted_mean: weights must be finite and non-negative")
    total = sum(w)
    if not (total > 0) or not math.isfinite(total):
        raise ValueError("weighted_mean: weights must sum to a positive finite number")
    return w, total


def weighted_mean(
    states: Sequence[State],
    weights: Sequence[float],
    keys: Iterable[str] | None = None,
    *,
    masks: Sequence[Mapping[str, torch.Tensor]] | None = None,
) -> State:
    """``Σ w_i s_i / Σ w_i`` per key: the one weighted mean of the methods
    (docs/algorithms.md, "Shared aggregation").

    - **Keys**: ``keys`` (default: every key of the first state, in its order). Every state
      must hold them with the first state's shape and dtype (:func:`layout_mismatch`; with
      ``keys=None`` the key sets must be equal), else ``ValueError``.
    - **Weights**: one per state, finite and non-negative, with a positive finite sum, else
      ``ValueError``. A state of weight 0 is left out of the sums.
    - **Floating tensors** are accumulated in float64 and cast back to their own dtype. The
      order of the float64 arithmetic is fixed (runs reproduce to the last digit): without
      ``masks``, ``acc += (w_i / Σ w) · s_i`` in state order.
    - **Non-floating tensors** (integer buffers such as BatchNorm's ``num_batches_tracked``;
      a mean of counters is meaningless) are a copy of the **first** state's: a caller puts
      the state whose counters it wants first (a node's own, or the first in sorted order).
    - **Masks** (the mask-aware mean, DisPFL's): one map per state, name → mask of 0/1 (bool)
      of the tensor's shape. A floating key the first map holds is averaged element-wise
      over the states whose mask holds the element, ``Σ w_i m_i s_i / Σ w_i m_i`` (0 where
      no state holds it; every map must hold that key); other floating keys are the case of
      an all-ones mask. With ``masks`` *every* floating key is computed in this order
      (numerator and denominator summed in state order, then divided), which is not
      bit-identical to the order without ``masks``.

    The result lives on the first state's device and shares no storage with the inputs."""
    if not states:
        raise ValueError("weighted_mean needs at least one state")
    w, total = _check_weights(weights, len(states))
    first = states[0]
    names = list(first) if keys is None else list(keys)
    missing = [k for k in names if k not in first]
    if missing:
        raise ValueError(f"weighted_mean: state 0 lacks {missing[:3]}")
    template = first if keys is None else {k: first[k] for k in names}
    odd = [k for k in names if not isinstance(first[k], torch.Tensor)]
    if odd:
        raise ValueError(f"weighted_mean: state 0: {odd[:3]} are not tensors")
    for i, state in enumerate(states[1:], start=1):
        view = state if keys is None else {k: state[k] for k in names if k in state}
        why = layout_mismatch(view, template)
        if why is not None:
            raise ValueError(f"weighted_mean: state {i}: {why}")
    if masks is not None:
        if len(masks) != len(states):
            raise ValueError(f"weighted_mean: {len(states)} states but {len(masks)} masks")
        masked = {k for k in names if k in masks[0] and torch.is_floating_point(first[k])}
        for i, (m, state) in enumerate(zip(masks, states, strict=True)):
            for k in masked:
                if k not in m or tuple(m[k].shape) != tuple(state[k].shape):
                    raise ValueError(f"weighted_mean: mask {i} lacks {k!r} or differs in shape")
    out: State = {}
    for k in names:
        ref = first[k]
        if not torch.is_floating_point(ref):
            out[k] = ref.detach().clone()
            continue
        f64 = {"device": ref.device, "dtype": torch.float64}
        if masks is None:
            acc = torch.zeros(ref.shape, **f64)
            for wi, state in zip(w, states, strict=True):
                if wi:
                    acc += (wi / total) * state[k].detach().to(**f64)
            out[k] = acc.to(ref.dtype)
            continue
        num = torch.zeros(ref.shape, **f64)
        den = torch.zeros_like(num)
        for wi, state, m in zip(w, states, masks, strict=True):
            if not wi:
                continue
            if k in masked:
                cm = wi * m[k].to(**f64)
                num += cm * state[k].detach().to(**f64)
                den += cm
            else:
                num += wi * state[k].detach().to(**f64)
                den += wi
        avg = torch.where(den > 0, num / den.clamp_min(1e-300), torch.zeros_like(num))
        out[k] = avg.to(ref.dtype)
    return out
