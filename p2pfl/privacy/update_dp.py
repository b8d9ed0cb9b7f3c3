"""The mechanism of node-level DP on outgoing updates (``privacy.dp.level: update``;
docs/algorithms.md, "Differential privacy", "Update level").

Pure maths on states (name → tensor), no I/O and no model.

Contract: given the reference state ``ref`` (the node's model before the round's local
training), the trained state ``w``, the bound ``C``, the noise multiplier ``σ`` and a
generator, :func:`release` returns

    Δ  = w − ref                                  (every floating tensor, one vector)
    Δ̃ = Δ · min(1, C / ‖Δ‖₂) + N(0, σ²C²·I)
    released = ref + Δ̃

so ``‖Δ̃ − N‖₂ ≤ C``: one Gaussian mechanism of sensitivity ``C`` and noise multiplier
``σ`` (:mod:`p2pfl.privacy.update_accountant` composes them).

**Reading** (arithmetic). Δ, its norm, the clipping and the noise are computed in float64
(the noise drawn as float64 standard normals from ``gen``, one tensor at a time in the
state's key order) and the released tensor is cast back to the tensor's dtype: the same
generator state gives the same release whatever the device the model trained on.

**Reading** (non-floating tensors). Integer and bool tensors (BatchNorm's
``num_batches_tracked``, a method's integer buffers) are no part of Δ: they pass through
from ``w``.

**Reading** (a broken update). A Δ with a non-finite element (training diverged) counts as
``Δ = 0``: the release is ``ref`` plus noise. The mechanism stays total and its
sensitivity ``C``; the node itself rolls such a round back before releasing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

State = dict[str, torch.Tensor]  # as p2pfl.learning.state.State (privacy imports no learning)

NOISE_STREAM = 0xD9DA7E  # the noise generator's seed is (round's training seed ^ NOISE_STREAM)


@dataclass(frozen=True)
class Released:
    """What :func:`release` returns: the state to release and ``‖Δ‖₂`` before clipping
    (NaN when Δ was not finite and counted as 0)."""

    state: State
    norm: float

    def clipped(self, max_norm: float) -> bool:
        """Whether the update was scaled down to ``max_norm``."""
        return math.isfinite(self.norm) and self.norm > max_norm


def float_keys(state: State) -> list[str]:
    """The keys of the floating tensors of ``state``, in its order."""
    return [k for k, v in state.items() if torch.is_floating_point(v)]


def update_norm(ref: State, trained: State) -> float:
    """``‖trained − ref‖₂`` over the floating tensors, as one vector (float64)."""
    total = 0.0
    for k in float_keys(trained):
        d = trained[k].detach().to("cpu", torch.float64) - ref[k].detach().to("cpu", torch.float64)
        total += float(d.pow(2).sum())
    return math.sqrt(total)


def _check_layout(ref: State, trained: State) -> None:
    if list(ref) != list(trained):
        raise ValueError("release: ref and the trained state have different keys")
    for k, v in trained.items():
        r = ref[k]
        if r.shape != v.shape or r.dtype != v.dtype:
            raise ValueError(
                f"release: {k!r} is {tuple(v.shape)} {v.dtype} trained, "
                f"{tuple(r.shape)} {r.dtype} in ref"
            )


def release(
    ref: State,
    trained: State,
    max_norm: float,
    noise_multiplier: float,
    gen: torch.Generator,
) -> Released:
    """``ref + clip(trained − ref, max_norm) + N(0, (noise_multiplier·max_norm)²·I)`` over
    the floating tensors, non-floating ones from ``trained`` (module docstring). Detached
    CPU tensors sharing no storage with the inputs; ``gen`` (a CPU generator) advances by
    one normal per floating element. ``ValueError`` when the layouts differ or a
    parameter is not positive."""
    if not max_norm > 0 or not noise_multiplier > 0:
        raise ValueError(f"release: bad bound {max_norm} or noise {noise_multiplier}")
    _check_layout(ref, trained)
    keys = float_keys(trained)
    deltas = {
        k: trained[k].detach().to("cpu", torch.float64) - ref[k].detach().to("cpu", torch.float64)
        for k in keys
    }
    norm = math.sqrt(sum(float(d.pow(2).sum()) for d in deltas.values()))
    if math.isfinite(norm):
        scale = min(1.0, max_norm / norm) if norm > 0 else 1.0
    else:  # a diverged update counts as none
        scale, norm = 0.0, math.nan
    std = noise_multiplier * max_norm
    out: State = {}
    for k, v in trained.items():
        if k not in deltas:
            out[k] = v.detach().to("cpu", copy=True)
            continue
        noise = torch.randn(v.shape, generator=gen, dtype=torch.float64)
        step = deltas[k] * scale if scale > 0 else torch.zeros_like(deltas[k])
        base = ref[k].detach().to("cpu", torch.float64)
        out[k] = (base + step + std * noise).to(v.dtype)
    return Released(out, norm)
