"""How far apart DP noise alone puts two honest nodes' models after one round.

Pure maths, no I/O. The ``clip`` defence accepts a peer's state within a distance of the
node's own (docs/design.md, "Robust aggregation"); under ``privacy.dp`` every honest model
carries its own round's Gaussian noise, whose norm in ``d`` coordinates is about
``s·√d`` (a high-dimensional Gaussian's norm concentrates there), far above the models'
honest spread for a CNN. The defence widens its bound by what that noise explains
(docs/algorithms.md, "Differential privacy", "DP and the defence").

Contract: each function returns ``s``, the standard deviation per coordinate of the noise
one round leaves in one node's weights; 0 when there is none.

- DP-SGD (:func:`dp_sgd_spread`): a step's gradient noise is ``N(0, (σC/B)²)`` per
  coordinate (Opacus divides the summed noise by the expected batch size ``B``). Under SGD
  with momentum μ (PyTorch's ``v ← μv + g``, ``w ← w − ηv``), the noise of step ``t`` of
  ``k`` moves the weights by ``η·Σ_{j<k−t+1} μ^j`` by the round's end, so
  ``s = η·(σC/B)·√(Σ_t a_t²)`` with ``a_t = (1 − μ^t)/(1 − μ)`` (``a_t = 1`` for μ = 0).
  Under Adam noise dominates a DP gradient and ``v̂`` is its variance, so a step is about
  ``η·m̂_t/(σC/B)``, linear in the noise: ``s = η·√(Σ_j c_j²)`` with
  ``c_j = Σ_{t≥j} (1−β₁)β₁^(t−j)/(1−β₁^t)`` (β₁ = 0.9, PyTorch's default), whatever σ.
  Weight decay only shrinks the noise and is left out (the bound errs wide).
- Update level (:func:`update_spread`): the release adds ``N(0, σ²C²)`` per coordinate
  directly, so ``s = σC``.
"""

from __future__ import annotations

import math

ADAM_BETA1 = 0.9  # torch.optim.Adam's default, which p2pfl.learning.train uses


def dp_sgd_spread(
    *,
    lr: float,
    noise_multiplier: float,
    max_grad_norm: float,
    batch_size: float,
    steps: int,
    momentum: float = 0.0,
    optimizer: str = "sgd",
) -> float:
    """``s`` of a round of ``steps`` DP-SGD steps at learning rate ``lr`` (module
    docstring). ``ValueError`` for a negative input or a momentum outside [0, 1)."""
    if min(lr, noise_multiplier, max_grad_norm, steps) < 0 or batch_size <= 0:
        raise ValueError("dp_sgd_spread: lr, σ, C, steps must be >= 0 and batch_size > 0")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"dp_sgd_spread: momentum must be in [0, 1) (got {momentum})")
    if steps == 0 or noise_multiplier == 0:
        return 0.0
    if optimizer == "adam":
        gains = sum(
            sum(
                (1 - ADAM_BETA1) * ADAM_BETA1 ** (t - j) / (1 - ADAM_BETA1**t)
                for t in range(j, steps + 1)
            )
            ** 2
            for j in range(1, steps + 1)
        )
        return lr * math.sqrt(gains)
    step_std = noise_multiplier * max_grad_norm / batch_size
    gains = sum(((1.0 - momentum**t) / (1.0 - momentum)) ** 2 for t in range(1, steps + 1))
    return lr * step_std * math.sqrt(gains)


def update_spread(*, noise_multiplier: float, max_update_norm: float) -> float:
    """``s`` of one update-level release: ``σ·C``."""
    if min(noise_multiplier, max_update_norm) < 0:
        raise ValueError("update_spread: σ and C must be >= 0")
    return noise_multiplier * max_update_norm
