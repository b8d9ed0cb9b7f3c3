"""The accountant of node-level DP on outgoing updates (``privacy.dp.level: update``;
docs/algorithms.md, "Differential privacy", "Update level").

Pure maths, no I/O and no model: what a node's releases cost in (ε, δ), composed with
Google's dp-accounting.

Contract:

- One **release** is one Gaussian mechanism: the round's update, clipped to L2 norm ``C``,
  plus ``N(0, σ²C²·I)`` (:func:`p2pfl.privacy.update_dp.release`). Its sensitivity is ``C``
  (the node's update with its data against no update at all) and its noise multiplier is
  ``σ``: ``dp_accounting.GaussianDpEvent(σ)``. There is no sampling amplification: whether
  a node trains and releases in a round is public.
- ``R`` releases at ``σ`` are ``SelfComposedDpEvent(GaussianDpEvent(σ), R)``; a node's
  history ``[(σ, R), ...]`` is the composition of those events, and ε for ``δ`` is read
  from dp-accounting's RDP accountant (``rdp``), or exactly (``analytic``): Gaussian
  releases compose into one Gaussian mechanism, ``R`` at ``σ`` into one at ``σ / √R``
  (Dong, Roth and Su, 2019: ``μ = √(Σ R_i / σ_i²)``), whose ε for ``δ`` is the analytic
  Gaussian mechanism's (Balle and Wang, 2018: ``dp_accounting.get_epsilon_gaussian``).
  ``analytic`` is the least ε any accountant can certify for these releases; ``rdp``'s
  conversion to (ε, δ) adds about 7%.
- :func:`plan_update_noise` is the least σ (to ``1e-4``) for which ``R`` releases spend
  at most a target ε (``dp_accounting.calibrate_dp_mechanism`` for ``rdp``,
  ``σ_eff·√R`` with ``dp_accounting.get_sigma_gaussian`` for ``analytic``);
  :class:`PrivacyError` names ``privacy.dp.target_epsilon`` when no σ can.
- :class:`UpdateAccountant`'s state is plain data, so a checkpoint carries it across a
  restart.

**Reading** (the relation). ``ε`` is for a node's whole dataset against none (the update
without its data is 0: distance ``C``), the user-level relation of DP-FedAvg (McMahan et
al., 2018). Two datasets of the node that differ arbitrarily (one patient's records
replaced, the count unchanged) give updates up to ``2C`` apart: their ε is that of
``σ / 2`` (docs/algorithms.md gives both).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import dp_accounting
from dp_accounting.mechanism_calibration import NoBracketIntervalFoundError
from dp_accounting.rdp import RdpAccountant

from p2pfl.privacy.errors import PrivacyError
from p2pfl.privacy.history_state import parse_history

MECHANISMS = ("rdp", "analytic")
FLOOR_SIGMA = 1e4  # σ this large leaves only the conversion's floor of ε for a δ
PLAN_TOL = 1e-4  # σ is planned to within this


def _check(mechanism: str) -> None:
    if mechanism not in MECHANISMS:
        raise ValueError(f"accountant {mechanism!r}: expected one of {list(MECHANISMS)}")


def releases_event(history: Iterable[tuple[float, int]]) -> dp_accounting.DpEvent:
    """The dp-accounting event of ``history``: per ``(σ, R)`` entry, ``R`` Gaussian releases
    of noise multiplier ``σ``, all composed."""
    return dp_accounting.ComposedDpEvent(
        [
            dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(float(s)), int(r))
            for s, r in history
            if r > 0
        ]
    )


def equivalent_sigma(history: Iterable[tuple[float, int]]) -> float:
    """The noise multiplier of the one Gaussian mechanism the releases ``history`` compose
    into: ``(Σ R_i / σ_i²)^(-1/2)`` (infinite for no release)."""
    rho = sum(int(r) / float(s) ** 2 for s, r in history if r > 0)
    return math.inf if rho == 0 else 1.0 / math.sqrt(rho)


def update_epsilon(
    history: Iterable[tuple[float, int]], delta: float, mechanism: str = "rdp"
) -> float:
    """ε for ``delta`` of the releases ``history`` (``(σ, R)`` entries); 0.0 for none."""
    _check(mechanism)
    entries = [(s, r) for s, r in history if r > 0]
    if not entries:
        return 0.0
    if mechanism == "analytic":
        return float(dp_accounting.get_epsilon_gaussian(equivalent_sigma(entries), delta))
    accountant = RdpAccountant()
    accountant.compose(releases_event(entries))
    return float(accountant.get_epsilon(delta))


def update_epsilon_floor(delta: float, mechanism: str = "rdp") -> float:
    """About the least ε the accountant certifies for ``delta`` however large σ is: one
    release at σ = :data:`FLOOR_SIGMA`."""
    return update_epsilon([(FLOOR_SIGMA, 1)], delta, mechanism)


def plan_update_noise(
    target_epsilon: float, delta: float, releases: int, mechanism: str = "rdp"
) -> float:
    """The least σ (to :data:`PLAN_TOL`) for which ``releases`` releases spend at most
    ``target_epsilon`` for ``delta``; :class:`PrivacyError` naming
    ``privacy.dp.target_epsilon`` when the target is at or below the accountant's floor."""
    if releases <= 0:
        raise ValueError(f"releases must be positive, got {releases}")
    floor = update_epsilon_floor(delta, mechanism)
    if target_epsilon <= floor:
        raise PrivacyError(
            "privacy.dp.target_epsilon",
            f"{target_epsilon} cannot be reached for delta {delta}: the {mechanism} "
            f"accountant certifies no less than about {floor:.3g}, whatever the noise",
        )
    if mechanism == "analytic":
        sigma = float(dp_accounting.get_sigma_gaussian(target_epsilon, delta)) * math.sqrt(releases)
    else:
        try:
            sigma = float(
                dp_accounting.calibrate_dp_mechanism(
                    RdpAccountant,
                    lambda s: releases_event([(s, releases)]),
                    target_epsilon,
                    delta,
                    dp_accounting.LowerEndpointAndGuess(0.01, 1.0),
                    tol=PLAN_TOL,
                )
            )
        except NoBracketIntervalFoundError as exc:
            raise PrivacyError(
                "privacy.dp.target_epsilon",
                f"{target_epsilon} cannot be reached for delta {delta} over {releases} "
                f"releases with the {mechanism} accountant: {exc}",
            ) from None
    # the searches stop within their tolerance of the target, on either side: a step more
    # keeps the promise
    while update_epsilon([(sigma, releases)], delta, mechanism) > target_epsilon:
        sigma += PLAN_TOL
    return sigma


class UpdateAccountant:
    """Every release a node made, as ``(σ, releases)`` entries, composed on demand."""

    def __init__(self, mechanism: str = "rdp", history: Iterable[Sequence[Any]] = ()):
        _check(mechanism)
        self.mechanism = mechanism
        self.history: list[tuple[float, int]] = []
        for entry in history:
            self.release(*entry)

    def release(self, noise_multiplier: float, count: int = 1) -> None:
        """Add ``count`` releases at ``noise_multiplier`` (merged into the last entry when
        σ matches; no entry for 0)."""
        if count < 0 or not noise_multiplier > 0:
            raise ValueError(f"bad releases: sigma {noise_multiplier}, count {count}")
        if count == 0:
            return
        if self.history and self.history[-1][0] == float(noise_multiplier):
            self.history[-1] = (self.history[-1][0], self.history[-1][1] + int(count))
        else:
            self.history.append((float(noise_multiplier), int(count)))

    @property
    def releases(self) -> int:
        """All releases so far."""
        return sum(r for _, r in self.history)

    def epsilon(self, delta: float) -> float:
        """ε for ``delta`` of every release so far (0.0 before the first)."""
        return update_epsilon(self.history, delta, self.mechanism)

    def epsilon_after(self, noise_multiplier: float, count: int, delta: float) -> float:
        """ε for ``delta`` if ``count`` more releases at ``noise_multiplier`` were made."""
        future = UpdateAccountant(self.mechanism, self.history)
        future.release(noise_multiplier, count)
        return future.epsilon(delta)

    # -- checkpoints -------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Plain data: ``{"mechanism": str, "history": [[σ, releases], ...]}``."""
        return {"mechanism": self.mechanism, "history": [list(e) for e in self.history]}

    @classmethod
    def from_state(cls, state: Any, where: str = "accountant") -> UpdateAccountant:
        """The accountant :meth:`state` describes; ``ValueError`` naming ``where`` and the
        field when it is malformed."""
        mechanism, entries = parse_history(state, where, ("sigma", "releases"), ("releases",))
        try:
            return cls(mechanism, entries)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
