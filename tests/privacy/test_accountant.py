"""The accountant (p2pfl/privacy/accountant.py) against Opacus's own and dp-accounting's, the
composition over rounds, σ planned for a target ε, and the state a checkpoint carries."""

from __future__ import annotations

import dp_accounting
import pytest
from opacus.accountants import RDPAccountant

from p2pfl.privacy.accountant import (
    Accountant,
    PrivacyError,
    compose_epsilon,
    plan_noise,
    sample_rate,
    steps_per_epoch,
    steps_per_round,
)

DELTA = 1e-5


@pytest.mark.parametrize(("sigma", "q", "steps"), [(1.0, 0.1, 60), (0.8, 0.05, 200), (2.0, 1.0, 5)])
def test_epsilon_matches_opacus_step_by_step(sigma, q, steps):
    ours = Accountant("rdp")
    ours.step(sigma, q, steps)
    theirs = RDPAccountant()
    for _ in range(steps):  # Opacus's accountant as a training loop drives it
        theirs.step(noise_multiplier=sigma, sample_rate=q)
    assert ours.epsilon(DELTA) == pytest.approx(theirs.get_epsilon(DELTA), rel=1e-12)
    # an independent implementation (Google's dp-accounting) agrees to within its orders
    rdp = dp_accounting.rdp.RdpAccountant()
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    rdp.compose(event, steps)
    assert ours.epsilon(DELTA) == pytest.approx(rdp.get_epsilon(DELTA), rel=0.02)


def test_rounds_compose_like_one_accountant_over_all_steps():
    rounds = Accountant("rdp")
    for _ in range(4):  # four rounds of 15 steps
        rounds.step(1.1, 0.1, 15)
    whole = Accountant("rdp")
    whole.step(1.1, 0.1, 60)
    assert rounds.steps == 60
    assert rounds.epsilon(DELTA) == pytest.approx(whole.epsilon(DELTA), rel=1e-12)
    one_round = Accountant("rdp")
    one_round.step(1.1, 0.1, 15)
    assert one_round.epsilon(DELTA) < rounds.epsilon(DELTA)  # ε grows with the rounds
    # mixed settings compose too (a node whose σ or q changed): more than either part alone
    mixed = Accountant("rdp", [(1.1, 0.1, 30), (2.0, 0.2, 30)])
    assert len(mixed.history) == 2
    assert mixed.epsilon(DELTA) > compose_epsilon([(1.1, 0.1, 30)], DELTA)


def test_epsilon_after_does_not_spend():
    acc = Accountant("rdp", [(1.0, 0.1, 10)])
    before = acc.epsilon(DELTA)
    after = acc.epsilon_after(1.0, 0.1, 10, DELTA)
    assert after > before and acc.epsilon(DELTA) == before and acc.steps == 10


def test_no_step_is_zero_epsilon():
    assert Accountant().epsilon(DELTA) == 0.0


@pytest.mark.parametrize("mechanism", ["rdp", "prv"])
@pytest.mark.parametrize("target", [1.0, 8.0])
def test_planned_noise_spends_at_most_the_target_and_close_to_it(mechanism, target):
    q, steps = 0.1, 60
    sigma = plan_noise(target, DELTA, q, steps, mechanism)
    spent = compose_epsilon([(sigma, q, steps)], DELTA, mechanism)
    assert spent <= target
    assert spent >= target - 0.05  # Opacus's search stops within 0.01 of the target
    # a little less noise would overspend: σ is about the least that fits
    assert compose_epsilon([(sigma * 0.9, q, steps)], DELTA, mechanism) > target


def test_unreachable_target_names_the_field():
    with pytest.raises(PrivacyError) as info:
        plan_noise(0.01, DELTA, 0.5, 1000, "rdp")
    assert info.value.field == "privacy.dp.target_epsilon"
    assert str(info.value).startswith("privacy.dp.target_epsilon: 0.01 cannot be reached")
    assert "certifies no less than" in str(info.value)


def test_sampling_rate_and_steps():
    assert sample_rate(20, 200) == 0.1 and steps_per_epoch(0.1) == 10
    assert sample_rate(50, 30) == 1.0 and steps_per_epoch(1.0) == 1
    assert steps_per_round(32, 600, 2) == 2 * 18  # ⌊600 / 32⌋ per epoch, as Opacus
    assert 1 / sample_rate(1, 93) < 93  # in floats: ⌊1/q⌋ would be 92
    assert steps_per_epoch(sample_rate(1, 93)) == 93
    with pytest.raises(ValueError, match="at least one training sample"):
        sample_rate(20, 0)


def test_state_round_trips_and_bad_state_is_named():
    acc = Accountant("prv", [(1.0, 0.1, 10), (1.0, 0.1, 5), (2.0, 0.1, 3)])
    assert acc.history == [(1.0, 0.1, 15), (2.0, 0.1, 3)]
    again = Accountant.from_state(acc.state())
    assert again.mechanism == "prv" and again.history == acc.history
    with pytest.raises(ValueError, match=r"ckpt: history\[0\] is not \[sigma, q, steps\]"):
        Accountant.from_state({"mechanism": "rdp", "history": [[1.0, 0.1]]}, "ckpt")
    with pytest.raises(ValueError, match="ckpt: accountant 'gdp'"):
        Accountant.from_state({"mechanism": "gdp", "history": []}, "ckpt")
    with pytest.raises(ValueError, match="bad DP-SGD steps"):
        Accountant().step(1.0, 1.5, 1)
