"""The update-level accountant (p2pfl/privacy/update_accountant.py): ε grows with the releases
and falls with σ, agrees with independent computations (the exact ε of the Gaussian
mechanism from its closed form, dp-accounting's PLD accountant, Opacus's RDP accountant
at q = 1), σ planned for a target spends it, and the state a checkpoint carries."""

from __future__ import annotations

import math

import dp_accounting
import pytest
from dp_accounting.pld import PLDAccountant
from opacus.accountants import RDPAccountant
from scipy.stats import norm

from p2pfl.privacy.errors import PrivacyError
from p2pfl.privacy.update_accountant import (
    UpdateAccountant,
    equivalent_sigma,
    plan_update_noise,
    update_epsilon,
    update_epsilon_floor,
)

DELTA = 1e-5


def _exact_epsilon(sigma: float, releases: int, delta: float) -> float:
    """ε of ``releases`` Gaussian releases at ``sigma`` from first principles: they are one
    Gaussian mechanism with ``μ = √releases / σ`` (μ-GDP), whose privacy profile is
    ``δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2)`` (Balle and Wang, 2018); bisect for ε."""
    mu = math.sqrt(releases) / sigma

    def profile(eps: float) -> float:
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)

    lo, hi = 0.0, 1000.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if profile(mid) > delta else (lo, mid)
    return hi


@pytest.mark.parametrize(("sigma", "releases"), [(1.0, 1), (2.0, 10), (5.0, 50), (0.8, 3)])
def test_epsilon_agrees_with_independent_computations(sigma, releases):
    exact = _exact_epsilon(sigma, releases, DELTA)
    ours = update_epsilon([(sigma, releases)], DELTA, "analytic")
    assert ours == pytest.approx(exact, rel=1e-6)
    # dp-accounting's numerical privacy loss distribution (a pessimistic estimate)
    pld = PLDAccountant()
    pld.compose(dp_accounting.GaussianDpEvent(sigma), releases)
    assert pld.get_epsilon(DELTA) == pytest.approx(exact, rel=2e-3)
    # RDP: an upper bound, and the same as Opacus's RDP accountant of unsampled steps
    rdp = update_epsilon([(sigma, releases)], DELTA, "rdp")
    assert exact < rdp < 1.15 * exact
    opacus = RDPAccountant()
    opacus.history = [(sigma, 1.0, releases)]
    assert rdp == pytest.approx(opacus.get_epsilon(DELTA), rel=0.02)


@pytest.mark.parametrize("mechanism", ["rdp", "analytic"])
def test_epsilon_grows_with_releases_and_falls_with_noise(mechanism):
    by_rounds = [update_epsilon([(1.5, r)], DELTA, mechanism) for r in (1, 2, 5, 20)]
    assert by_rounds == sorted(by_rounds) and len(set(by_rounds)) == 4
    by_sigma = [update_epsilon([(s, 10)], DELTA, mechanism) for s in (0.8, 1.5, 3.0, 10.0)]
    assert by_sigma == sorted(by_sigma, reverse=True) and len(set(by_sigma)) == 4
    assert update_epsilon([], DELTA, mechanism) == 0.0


def test_releases_compose_like_one_history():
    rounds = UpdateAccountant("rdp")
    for _ in range(4):
        rounds.release(2.0)
    assert rounds.history == [(2.0, 4)] and rounds.releases == 4
    assert rounds.epsilon(DELTA) == update_epsilon([(2.0, 4)], DELTA)
    # mixed noise: the analytic composition is one Gaussian at (Σ R/σ²)^-1/2
    assert equivalent_sigma([(1.0, 1), (2.0, 4)]) == pytest.approx(1 / math.sqrt(2))
    mixed = update_epsilon([(1.0, 1), (2.0, 4)], DELTA, "analytic")
    assert mixed == pytest.approx(_exact_epsilon(1 / math.sqrt(2), 1, DELTA), rel=1e-6)


def test_epsilon_after_does_not_spend():
    acc = UpdateAccountant("analytic", [(1.0, 2)])
    before = acc.epsilon(DELTA)
    assert acc.epsilon_after(1.0, 1, DELTA) > before == acc.epsilon(DELTA)
    assert acc.releases == 2


@pytest.mark.parametrize("mechanism", ["rdp", "analytic"])
@pytest.mark.parametrize(("target", "releases"), [(1.0, 1), (4.0, 10), (8.0, 100)])
def test_planned_noise_spends_at_most_the_target_and_close_to_it(mechanism, target, releases):
    sigma = plan_update_noise(target, DELTA, releases, mechanism)
    spent = update_epsilon([(sigma, releases)], DELTA, mechanism)
    assert target - 1e-3 < spent <= target
    assert update_epsilon([(sigma * 0.99, releases)], DELTA, mechanism) > target
    # one release more than planned overspends: the node's budget check refuses it
    assert update_epsilon([(sigma, releases + 1)], DELTA, mechanism) > target


def test_an_unreachable_target_names_the_field():
    floor = update_epsilon_floor(DELTA, "rdp")
    assert 0 < floor < 0.01
    with pytest.raises(PrivacyError) as info:
        plan_update_noise(floor / 2, DELTA, 10, "rdp")
    assert info.value.field == "privacy.dp.target_epsilon"
    assert "certifies no less than" in str(info.value)


def test_state_round_trips_and_bad_state_is_named():
    acc = UpdateAccountant("analytic", [(1.0, 2), (1.0, 1), (2.0, 3)])
    assert acc.history == [(1.0, 3), (2.0, 3)]
    again = UpdateAccountant.from_state(acc.state())
    assert again.mechanism == "analytic" and again.history == acc.history
    with pytest.raises(ValueError, match=r"ckpt: history\[0\] is not \[sigma, releases\]"):
        UpdateAccountant.from_state({"mechanism": "rdp", "history": [[1.0, 0.1, 3]]}, "ckpt")
    with pytest.raises(ValueError, match="ckpt: accountant 'prv'"):
        UpdateAccountant.from_state({"mechanism": "prv", "history": []}, "ckpt")
    with pytest.raises(ValueError, match="bad releases"):
        UpdateAccountant().release(0.0)
