"""The privacy accountant of one node's DP-SGD (docs/algorithms.md, "Differential privacy").

Pure maths, no I/O and no model: what a node's local steps cost in (ε, δ).

Contract:

- One DP-SGD step draws each of the node's ``n`` samples independently with probability
  ``q = min(1, batch_size / n)`` (Poisson sampling), clips each sample's gradient to ``C``
  and adds Gaussian noise of standard deviation ``σ·C``: the sampled Gaussian mechanism.
- An epoch is ``max(1, ⌊1 / q⌋)`` such steps (Opacus's rule for Poisson loaders); a round is
  ``training.epochs`` epochs.
- :class:`Accountant` keeps the history ``[(σ, q, steps), ...]`` of every step the node took,
  over all of its rounds, and composes the whole history into ε for a given δ with
  Opacus's RDP accountant (``rdp``) or its PRV accountant (``prv``). Its state is plain
  data (:meth:`Accountant.state`), so a checkpoint carries it across a restart.
- :func:`plan_noise` is the σ for which the planned steps spend at most a target ε
  (Opacus's ``get_noise_multiplier``); :class:`PrivacyError` names the field when no σ can.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.utils import get_noise_multiplier

from p2pfl.privacy.errors import PrivacyError
from p2pfl.privacy.history_state import parse_history

MECHANISMS = ("rdp", "prv")
# Opacus warns when the best Rényi order is its largest (a huge σ, as planning tries): the
# bound it returns holds all the same. A filter set once (``catch_warnings`` is not
# thread-safe, and nodes account in worker threads)
warnings.filterwarnings(
    "ignore", message="Optimal order is the largest alpha", category=UserWarning
)
FLOOR_SIGMA = 1e4  # σ this large leaves only the conversion's floor of ε for a δ


def sample_rate(batch_size: int, n_samples: int) -> float:
    """``q = min(1, batch_size / n_samples)``; ``ValueError`` without samples."""
    if n_samples <= 0:
        raise ValueError("DP-SGD needs at least one training sample")
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    return min(1.0, batch_size / n_samples)


def steps_per_epoch(q: float) -> int:
    """Poisson-sampled steps in one epoch: ``max(1, ⌊1/q⌋)`` (as Opacus's DP data loader;
    ``1/q`` is nudged up by 1e-9 so that ``q = 1/3`` gives 3, not 2.999… → 2)."""
    return max(1, int(1.0 / q + 1e-9))


def steps_per_round(batch_size: int, n_samples: int, epochs: int) -> int:
    """The DP-SGD steps of one round of ``epochs`` epochs over ``n_samples`` samples."""
    return epochs * steps_per_epoch(sample_rate(batch_size, n_samples))


def _engine(mechanism: str, history: Sequence[tuple[float, float, int]]) -> Any:
    if mechanism not in MECHANISMS:
        raise ValueError(f"accountant {mechanism!r}: expected one of {list(MECHANISMS)}")
    engine = RDPAccountant() if mechanism == "rdp" else PRVAccountant()
    engine.history = [(float(s), float(q), int(k)) for s, q, k in history]
    return engine


def compose_epsilon(
    history: Iterable[tuple[float, float, int]], delta: float, mechanism: str = "rdp"
) -> float:
    """ε for ``delta`` of the composition of ``history`` (``(σ, q, steps)`` entries); 0.0
    for no step at all."""
    entries = [(s, q, k) for s, q, k in history if k > 0]
    if not entries:
        return 0.0
    with np.errstate(divide="ignore"):  # PRV's grid takes log(0) at q = 1: harmless
        return float(_engine(mechanism, entries).get_epsilon(delta=delta))


def plan_noise(
    target_epsilon: float, delta: float, q: float, steps: int, mechanism: str = "rdp"
) -> float:
    """The smallest σ (to Opacus's tolerance of 0.01 in ε) for which ``steps`` steps at
    sampling rate ``q`` spend at most ``target_epsilon`` for ``delta``. :class:`PrivacyError`
    naming ``privacy.dp.target_epsilon`` when no σ up to Opacus's bound reaches it."""
    if steps <= 0:
        raise ValueError(f"steps must be positive, got {steps}")
    floor = epsilon_floor(delta, mechanism)
    if target_epsilon <= floor:  # no σ reaches it: say so without Opacus's long search
        raise PrivacyError(
            "privacy.dp.target_epsilon",
            f"{target_epsilon} cannot be reached for delta {delta}: the {mechanism} "
            f"accountant certifies no less than about {floor:.3g}, whatever the noise",
        )
    try:
        with np.errstate(divide="ignore"):
            sigma = get_noise_multiplier(
                target_epsilon=target_epsilon,
                target_delta=delta,
                sample_rate=q,
                steps=steps,
                accountant=mechanism,
            )
        return float(sigma)
    except ValueError as exc:
        raise PrivacyError(
            "privacy.dp.target_epsilon",
            f"{target_epsilon} cannot be reached for delta "
            f"{delta} over {steps} steps at sampling rate {q:.4g} with the {mechanism} "
            f"accountant (the least it certifies is about {floor:.3g}): {exc}",
        ) from None


def epsilon_floor(delta: float, mechanism: str = "rdp") -> float:
    """About the least ε the accountant certifies for ``delta`` however large σ is: its
    value for one unsampled step at σ = :data:`FLOOR_SIGMA` (the conversion to (ε, δ) has
    a floor that sampling and more steps do not lower)."""
    return compose_epsilon([(FLOOR_SIGMA, 1.0, 1)], delta, mechanism)


class Accountant:
    """Every DP-SGD step a node took, as ``(σ, q, steps)`` entries, composed on demand."""

    def __init__(self, mechanism: str = "rdp", history: Iterable[Sequence[Any]] = ()):
        if mechanism not in MECHANISMS:
            raise ValueError(f"accountant {mechanism!r}: expected one of {list(MECHANISMS)}")
        self.mechanism = mechanism
        self.history: list[tuple[float, float, int]] = []
        for entry in history:
            self.step(*entry)

    def step(self, noise_multiplier: float, q: float, steps: int = 1) -> None:
        """Add ``steps`` steps of noise ``noise_multiplier`` at sampling rate ``q`` (merged
        into the last entry when both match; no entry for 0 steps)."""
        if steps < 0 or not 0 < q <= 1 or noise_multiplier <= 0:
            raise ValueError(f"bad DP-SGD steps: sigma {noise_multiplier}, q {q}, steps {steps}")
        if steps == 0:
            return
        if self.history and self.history[-1][:2] == (float(noise_multiplier), float(q)):
            s, r, k = self.history[-1]
            self.history[-1] = (s, r, k + int(steps))
        else:
            self.history.append((float(noise_multiplier), float(q), int(steps)))

    @property
    def steps(self) -> int:
        """All steps taken so far."""
        return sum(k for _, _, k in self.history)

    def epsilon(self, delta: float) -> float:
        """ε for ``delta`` of everything taken so far (0.0 before the first step)."""
        return compose_epsilon(self.history, delta, self.mechanism)

    def epsilon_after(self, noise_multiplier: float, q: float, steps: int, delta: float) -> float:
        """ε for ``delta`` if ``steps`` more steps of ``(noise_multiplier, q)`` were taken."""
        future = Accountant(self.mechanism, self.history)
        future.step(noise_multiplier, q, steps)
        return future.epsilon(delta)

    # -- checkpoints -------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Plain data: ``{"mechanism": str, "history": [[σ, q, steps], ...]}``."""
        return {"mechanism": self.mechanism, "history": [list(e) for e in self.history]}

    @classmethod
    def from_state(cls, state: Any, where: str = "accountant") -> Accountant:
        """The accountant :meth:`state` describes; ``ValueError`` naming ``where`` and the
        field when it is malformed."""
        mechanism, entries = parse_history(state, where, ("sigma", "q", "steps"), ("steps",))
        try:
            return cls(mechanism, entries)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
