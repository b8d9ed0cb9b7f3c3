"""The attacks' maths: pure functions on states and labels, no I/O, no randomness of their own.

Every function on states follows one contract:

- only **floating** tensors are changed; every other tensor (integer buffers such as
  BatchNorm's ``num_batches_tracked``, bool masks) is a copy of the input's;
- each output tensor keeps the dtype and device of the (first) input's tensor of that name,
  keys keep their order, and the output **shares no storage** with the inputs;
- the inputs are never mutated.

The attacks, with the papers they come from:

- :func:`sign_flip` ``−w`` and :func:`scale` ``factor·w`` (model replacement / boosting);
- :func:`gaussian_noise`: the *Gaussian attack* of Blanchard et al. 2017 ("Machine Learning
  with Adversaries: Byzantine Tolerant Gradient Descent") and Fang et al. 2020 ("Local Model
  Poisoning Attacks to Byzantine-Robust Federated Learning"): the served values are
  *replaced* by ``N(0, σ²)`` draws, not perturbed;
- :func:`nan_state`: every floating element NaN (the crash test of a receiver's checks);
- :func:`alie`: Baruch et al. 2019 ("A Little Is Enough: Circumventing Defenses For
  Distributed Learning"), ``mean − z·std`` per coordinate, with :func:`alie_z` its ``z_max``;
- :func:`ipm`: Xie et al. 2020 ("Fall of Empires: Breaking Byzantine-tolerant SGD by Inner
  Product Manipulation"), ``−ε·mean``;
- :func:`flip_labels`: the label-flipping data poisoning (untargeted ``C − 1 − y`` or one
  class relabelled as another).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from statistics import NormalDist

import torch

from p2pfl.learning.state import State

ALIE_Z_MIN = 0.1
"""The smallest ``z`` :func:`alie_z` returns. Baruch et al.'s formula gives ``z ≤ 0`` when
the attackers cannot tip a majority (``(n − s)/n ≤ 1/2``, e.g. one attacker among an even
number of workers), and a shift of zero standard deviations is no attack at all; this floor
keeps a small shift that stays well inside the benign spread, the attack's whole point."""


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``t`` with its own storage."""
    return t.detach().clone()


def _map_floating(state: State, fn: Callable[[torch.Tensor], torch.Tensor]) -> State:
    """``fn(t)`` for each floating tensor of ``state`` (detached; ``fn`` must return a new
    tensor of ``t``'s dtype), a copy of every other."""
    return {k: fn(t.detach()) if torch.is_floating_point(t) else _copy(t) for k, t in state.items()}


def sign_flip(state: State) -> State:
    """``−w`` for every floating tensor: the sign-flipping attack."""
    return _map_floating(state, torch.neg)


def scale(state: State, factor: float) -> State:
    """``factor·w`` for every floating tensor: model replacement / boosting (a large factor
    lets one participant outweigh the others in a plain mean). Computed in the tensor's own
    dtype, so a half-precision tensor may overflow to ``inf``, as a real attacker's would."""
    f = float(factor)
    return _map_floating(state, lambda t: t * f)


def gaussian_noise(state: State, sigma: float, generator: torch.Generator) -> State:
    """The Gaussian attack (Blanchard et al. 2017; Fang et al. 2020): every floating tensor is
    **replaced** by independent ``N(0, sigma²)`` draws, one per coordinate. The served values
    carry no information from the honest model at all (adding the noise to ``w`` instead would
    be a weaker, different attack).

    Draws come from ``generator`` (a CPU generator), in float64, in the state's key order,
    then are cast to each tensor's dtype and moved to its device: the same generator seed and
    the same key order give the same values on any device. ``sigma`` must be finite and
    ``≥ 0`` (``ValueError``)."""
    s = float(sigma)
    if not math.isfinite(s) or s < 0:
        raise ValueError(f"gaussian_noise: sigma must be finite and non-negative, got {sigma}")

    def draw(t: torch.Tensor) -> torch.Tensor:
        z = torch.randn(t.shape, generator=generator, dtype=torch.float64)
        return (z * s).to(dtype=t.dtype, device=t.device)

    return _map_floating(state, draw)


def nan_state(state: State) -> State:
    """Every floating element NaN."""
    return _map_floating(state, lambda t: torch.full_like(t, math.nan))


def _stack64(benign: Sequence[State], who: str) -> tuple[State, list[str]]:
    """Check ``benign`` (non-empty, every state with the first state's keys and shapes) and
    return the first state and its keys; ``ValueError`` otherwise."""
    if not benign:
        raise ValueError(f"{who} needs at least one benign state")
    first = benign[0]
    keys = list(first)
    for i, s in enumerate(benign[1:], start=1):
        if set(s) != set(keys):
            raise ValueError(f"{who}: state {i} has other keys than state 0")
        for k in keys:
            if not isinstance(s[k], torch.Tensor) or s[k].shape != first[k].shape:
                raise ValueError(f"{who}: state {i}: tensor {k!r} differs in shape")
    return first, keys


def _coordinate_stats(benign: Sequence[State], key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and population standard deviation (divisor ``n``) over the states of tensor
    ``key``, per coordinate, in float64 on the first state's device."""
    ref = benign[0][key]
    x = torch.stack([s[key].detach().to(device=ref.device, dtype=torch.float64) for s in benign])
    return x.mean(dim=0), x.std(dim=0, correction=0)


def alie(benign: Sequence[State], z: float) -> State:
    """A Little Is Enough (Baruch et al. 2019): per coordinate ``μ − z·σ`` where ``μ`` and
    ``σ`` are the mean and the population standard deviation (divisor ``n``) of the benign
    states, computed in float64 and cast back to the first state's dtype. A shift of a few
    standard deviations stays inside the benign spread, so distance- and median-based rules
    keep it, while it pulls every coordinate the same way.

    Every state must have the first state's keys and shapes (``ValueError``); non-floating
    tensors are the first state's. One benign state gives that state itself (``σ = 0``)."""
    zf = float(z)
    return _per_coordinate(benign, "alie", lambda mean, std: mean - zf * std)


def _per_coordinate(
    benign: Sequence[State],
    what: str,
    rule: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> State:
    """``rule(mean, std)`` of the benign states per floating key (float64, cast back to the
    first state's dtype); non-floating tensors are the first state's."""
    first, keys = _stack64(benign, what)
    out: State = {}
    for k in keys:
        ref = first[k]
        if not torch.is_floating_point(ref):
            out[k] = _copy(ref)
            continue
        mean, std = _coordinate_stats(benign, k)
        out[k] = rule(mean, std).to(ref.dtype)
    return out


def alie_z(n: int, f: int) -> float:
    """Baruch et al. 2019's ``z_max`` for ``n`` workers of which ``f`` are attackers: the
    attackers need ``s = ⌊n/2 + 1⌋ − f`` benign workers on their side, and
    ``z = Φ⁻¹((n − s)/n)`` is the largest shift for which that many benign values are
    expected to lie farther from the mean than the attackers' value.

    Edge cases: ``s ≤ 0`` (the attackers alone are a majority; ``Φ⁻¹(1)`` is infinite) is
    taken as ``s = 1``; the result is never below :data:`ALIE_Z_MIN` (the formula gives
    ``z ≤ 0`` whenever ``(n − s)/n ≤ 1/2``). ``ValueError`` unless ``n ≥ 1`` and
    ``0 ≤ f ≤ n``."""
    if n < 1 or f < 0 or f > n:
        raise ValueError(f"alie_z: need n >= 1 and 0 <= f <= n, got n={n}, f={f}")
    s = max(1, math.floor(n / 2 + 1) - f)
    p = (n - s) / n
    if p <= 0.5:
        return ALIE_Z_MIN
    return max(ALIE_Z_MIN, NormalDist().inv_cdf(p))


def ipm(benign: Sequence[State], epsilon: float) -> State:
    """Inner Product Manipulation (Xie et al. 2020): ``−ε · mean`` of the benign states, per
    coordinate (plain mean in float64, cast back to the first state's dtype). A small ``ε``
    passes distance-based rules; the aggregate's inner product with the true mean turns
    negative once the attackers' share outweighs ``1/(1 + ε)``.

    Every state must have the first state's keys and shapes (``ValueError``); non-floating
    tensors are the first state's."""
    e = float(epsilon)
    return _per_coordinate(benign, "ipm", lambda mean, _std: -e * mean)


def flip_labels(
    y: torch.Tensor, num_classes: int, source: int | None, target: int | None
) -> torch.Tensor:
    """Label flipping (data poisoning), a new tensor of ``y``'s dtype and device:

    - untargeted (``source`` and ``target`` None): every label ``y`` becomes ``C − 1 − y``;
    - targeted: labels equal to ``source`` become ``target``, the others are unchanged.

    ``ValueError`` when ``num_classes < 1``, when only one of ``source``/``target`` is
    given, or when either lies outside ``[0, C)``."""
    if num_classes < 1:
        raise ValueError(f"flip_labels: num_classes must be at least 1, got {num_classes}")
    if (source is None) != (target is None):
        raise ValueError("flip_labels: source and target go together")
    if source is None or target is None:
        return (num_classes - 1) - y.detach()
    for name, c in (("source", source), ("target", target)):
        if not 0 <= c < num_classes:
            raise ValueError(f"flip_labels: {name} {c} outside [0, {num_classes})")
    y = y.detach()
    return torch.where(y == source, torch.full_like(y, target), y)
