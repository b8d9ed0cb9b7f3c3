"""The robust-combination layer (p2pfl/learning/defence.py): the configured rule, the
node's own state never refused, refusals named for the record, fallbacks counted, and the
round's inputs taken as one value."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch

from p2pfl.config.schema import DefenceConfig
from p2pfl.learning import robust
from p2pfl.learning.defence import Defence, DefenceInputs
from p2pfl.learning.state import weighted_mean


def st(*values: float, n: int = 3) -> dict[str, torch.Tensor]:
    return {"g.w": torch.tensor(values, dtype=torch.float32), "g.n": torch.tensor(n)}


def defence(rule: str, **kw) -> Defence:
    d = Defence(DefenceConfig(rule=rule, **kw), rounds=10)
    d.begin_round(DefenceInputs(1))
    return d


def test_mean_is_the_weighted_mean_to_the_bit():
    states = [st(1.0, 2.0), st(3.0, 5.0), st(0.1, 0.7)]
    out = Defence().combine(states, [3, 1, 2], who=["a", "b", "c"])
    ref = weighted_mean(states, [3, 1, 2])
    assert torch.equal(out["g.w"], ref["g.w"]) and Defence().rejected == {}


def test_clip_refuses_a_far_state_by_name_and_mixes_the_rest():
    d = defence("clip", gamma=0.5, kappa=0.0)  # bound: 0.5 x ||own|| = 0.5 x 5 = 2.5
    own, near, flipped = st(3.0, 4.0), st(3.5, 4.5), st(-3.0, -4.0)
    out = d.combine([own, near, flipped], [1, 1, 1], who=["me", "b", "c"])
    assert torch.allclose(out["g.w"], torch.tensor([3.25, 4.25]))
    assert list(d.rejected) == ["c"] and d.rejected["c"].startswith("clip: distance 10 > 2.5")


def test_clip_tightens_over_the_run():
    d = Defence(DefenceConfig(rule="clip", gamma=0.5, kappa=1.0), rounds=10)
    d.begin_round(DefenceInputs(0))
    assert d.clip_ratio() == 0.5
    d.begin_round(DefenceInputs(10))
    assert d.clip_ratio() == pytest.approx(0.5 * math.exp(-1))


def test_clip_without_an_own_state_measures_from_the_median():
    d = defence("clip", gamma=0.5, kappa=0.0)
    states = [st(3.0, 4.0), st(3.2, 4.1), st(2.9, 3.9), st(300.0, 400.0)]
    d.combine(states, [1, 1, 1, 1], who=["a", "b", "c", "d"], own=None)
    assert list(d.rejected) == ["d"]


def test_multikrum_keeps_the_own_state_and_refuses_the_outlier():
    d = defence("multikrum", f=1, m=3)
    states = [st(0.0), st(1.0), st(2.0), st(1.5), st(100.0)]
    out = d.combine(states, [1] * 5, who=["me", "a", "b", "c", "x"])
    assert "x" in d.rejected and "me" not in d.rejected
    assert out["g.w"].item() < 5


def test_median_and_the_fallback_when_the_rule_lacks_inputs():
    d = defence("bulyan", f=1)  # needs 7 inputs
    out = d.combine([st(1.0), st(2.0), st(90.0)], [1, 1, 1], who=["me", "a", "b"])
    assert out["g.w"].item() == 2.0 and d.fallbacks == 1
    assert out["g.n"].item() == 3  # counters from the own state


def test_coordinate_rules_refuse_masks():
    d = defence("median")
    masks = [{"g.w": torch.ones(2, dtype=torch.bool)}] * 2
    with pytest.raises(ValueError, match="median cannot combine masked states"):
        d.combine([st(1.0, 2.0), st(3.0, 4.0)], [1, 1], who=["a", "b"], masks=masks)


def test_screen_gates_a_whole_model_adoption_under_clip_only():
    own = st(3.0, 4.0)
    cands = {"near": st(3.1, 4.0), "far": st(-3.0, -4.0)}
    d = defence("clip", gamma=0.5, kappa=0.0)
    assert list(d.screen(own, cands)) == ["near"] and list(d.rejected) == ["far"]
    assert sorted(defence("median").screen(own, cands)) == ["far", "near"]
    d.begin_round(DefenceInputs(2))
    assert d.rejected == {}


def test_clip_on_sparse_states_compares_where_both_masks_hold():
    # DisPFL: an element one mask lacks is a zero there, not a difference
    d = defence("clip", gamma=0.5, kappa=0.0)
    own = {"g.w": torch.tensor([3.0, 4.0, 0.0, 0.0])}
    peer = {"g.w": torch.tensor([3.1, 0.0, 9.0, 0.0])}  # shares element 0 only
    far = {"g.w": torch.tensor([-3.0, 0.0, 9.0, 0.0])}
    masks = [
        {"g.w": torch.tensor([True, True, False, False])},
        {"g.w": torch.tensor([True, False, True, False])},
        {"g.w": torch.tensor([True, False, True, False])},
    ]
    out = d.combine([own, peer, far], [1, 1, 1], who=["me", "p", "x"], masks=masks)
    assert list(d.rejected) == ["x"]  # |-3 - 3| = 6 > 0.5 x 3; |3.1 - 3| = 0.1 passes
    assert torch.allclose(out["g.w"], torch.tensor([3.05, 4.0, 9.0, 0.0]))


def test_without_an_own_state_a_trusted_reference_separates_honest_from_flipped():
    # an aggregator that did not train: the median of w and -w is 0, the reference is not
    d = defence("clip", gamma=0.5, kappa=0.0)
    reference = st(3.0, 4.0)
    d.take(DefenceInputs(1, reference=reference))
    out = d.combine([st(3.2, 4.1), st(-3.2, -4.1)], [1, 1], who=["a", "b"], own=None)
    assert list(d.rejected) == ["b"] and torch.allclose(out["g.w"], torch.tensor([3.2, 4.1]))
    d.begin_round(DefenceInputs(2, reference=reference))
    out = d.combine([st(-3.0, -4.0)], [1], who=["b"], own=None)  # one input: gated too
    assert list(d.rejected) == ["b"] and torch.equal(out["g.w"], reference["g.w"])
    out = d.combine([st(-3.0, -4.0), st(30.0, 40.0)], [1, 1], who=["b", "c"], own=None)
    assert sorted(d.rejected) == ["b", "c"]
    assert torch.equal(out["g.w"], reference["g.w"])  # nothing trusted: the model stays


def test_staleness_weights_scale_each_peer_and_reset_each_round():
    d = defence("mean")
    d.take(DefenceInputs(1, staleness={"b": 0.5}))  # b is stale: (1 + 3)^-0.5
    states = [st(1.0, 1.0), st(3.0, 3.0)]
    out = d.combine(states, [1, 1], who=["me", "b"])
    assert torch.allclose(out["g.w"], weighted_mean(states, [1, 0.5])["g.w"])
    d.begin_round(DefenceInputs(2))
    assert d.inputs.staleness == {}
    assert torch.equal(d.combine(states, [1, 1], who=["me", "b"])["g.w"], torch.tensor([2.0, 2.0]))


def test_clip_allows_for_the_dp_noise_between_honest_states():
    """Under DP the bound grows by NOISE_MARGIN·√2·s·√m over the m coordinates compared: a
    state that far (and no further) is kept, in screen, combine and on masked states."""
    from p2pfl.learning.defence import NOISE_MARGIN

    d = defence("clip", gamma=0.5, kappa=0.0)  # bound 0.5 x ||own|| = 2.5 without DP
    own, noisy = st(3.0, 4.0), st(3.0 + 4.0, 4.0)  # distance 4 > 2.5
    d.combine([own, noisy], [1, 1], who=["me", "b"])
    assert list(d.rejected) == ["b"]
    spread = 1.5 / (NOISE_MARGIN * math.sqrt(2) * math.sqrt(2))  # allowance 1.5
    d.begin_round(DefenceInputs(2, noise_spread=spread))
    assert d.noise_allowance(2) == pytest.approx(1.5)
    out = d.combine([own, noisy], [1, 1], who=["me", "b"])
    assert d.rejected == {} and torch.allclose(out["g.w"], torch.tensor([5.0, 4.0]))
    assert list(d.screen(own, {"b": noisy})) == ["b"]
    far = st(3.0 + 4.2, 4.0)  # 4.2 > 2.5 + 1.5
    assert d.screen(own, {"c": far}) == {} and "> 4" in d.rejected["c"]
    masks = [{"g.w": torch.tensor([True, False])}, {"g.w": torch.tensor([True, True])}]
    kept = d.select([own, noisy], who=["me", "b"], masks=masks)  # one coordinate compared
    assert list(kept) == [0] and d.rejected["b"].startswith("clip: distance 4 > 2.56")


def test_without_dp_the_clip_bound_is_unchanged():
    d = defence("clip", gamma=0.5, kappa=0.0)
    assert d.inputs.noise_spread == 0.0 and d.noise_allowance(10**6) == 0.0


def test_the_inputs_are_one_value_the_caller_cannot_change_afterwards():
    weights = {"b": 0.5}
    inputs = DefenceInputs(3, staleness=weights)
    weights["b"] = 0.0  # the caller's dict is copied
    assert inputs.staleness == {"b": 0.5}
    with pytest.raises(TypeError):
        inputs.staleness["b"] = 0.1  # type: ignore[index]
    with pytest.raises(AttributeError):
        inputs.noise_spread = 1.0  # type: ignore[misc]
    for again in (copy.deepcopy(inputs), pickle.loads(pickle.dumps(inputs))):  # a checkpoint
        assert (again.round, dict(again.staleness)) == (3, {"b": 0.5})


def test_take_keeps_the_round_s_refusals_and_refuses_another_round():
    d = defence("clip", gamma=0.5, kappa=0.0)
    d.combine([st(3.0, 4.0), st(-3.0, -4.0)], [1, 1], who=["me", "c"])
    assert list(d.rejected) == ["c"]
    d.take(DefenceInputs(1, reference=st(3.0, 4.0)))
    assert list(d.rejected) == ["c"] and d.inputs.reference is not None
    with pytest.raises(ValueError, match="inputs of round 2 in round 1"):
        d.take(DefenceInputs(2))
    d.begin_round(DefenceInputs(2))
    assert d.rejected == {} and d.inputs.reference is None


def test_centered_clip_pulls_a_far_state_onto_the_bound_and_refuses_nothing():
    d = defence("centered_clip", gamma=0.5, kappa=0.0)  # bound: 0.5 x ||own|| = 2.5
    own, near, flipped = st(3.0, 4.0), st(3.5, 4.5), st(-3.0, -4.0)
    out = d.combine([own, near, flipped], [1, 1, 1], who=["me", "b", "c"])
    # c sits at distance 10: own + (c - own) x 2.5 / 10 = (1.5, 2.0)
    assert torch.allclose(out["g.w"], torch.tensor([(3 + 3.5 + 1.5) / 3, (4 + 4.5 + 2) / 3]))
    assert d.rejected == {} and d.clipped == {"c": 4.0}
    kept = d.select([own, near, flipped], who=["me", "b", "c"])
    assert kept[1] is near  # within the bound: the very state, bit for bit
    assert torch.allclose(kept[2]["g.w"], torch.tensor([1.5, 2.0]))
    assert kept[2]["g.w"].dtype == torch.float32 and torch.equal(kept[2]["g.n"], flipped["g.n"])


def test_centered_clip_refuses_a_non_finite_state():
    d = defence("centered_clip", gamma=0.5, kappa=0.0)
    own, broken = st(3.0, 4.0), st(math.nan, 4.0)
    out = d.combine([own, broken], [1, 1], who=["me", "b"])
    assert torch.equal(out["g.w"], own["g.w"]) and list(d.rejected) == ["b"]


def test_centered_clip_refuses_a_whole_model_to_adopt_beyond_the_bound():
    d = defence("centered_clip", gamma=0.5, kappa=0.0)
    own, far, near = st(3.0, 4.0), st(3.0, 14.0), st(3.0, 5.0)  # distances 10, 1; bound 2.5
    assert d.screen(own, {"p": far, "q": near}) == {"q": near}
    assert list(d.rejected) == ["p"] and d.clipped == {}


def test_centered_clip_masked_measures_on_both_masks_and_moves_every_element():
    d = defence("centered_clip", gamma=0.5, kappa=0.0)
    own, far = st(3.0, 4.0), st(13.0, 9.0)
    masks = [{"g.w": torch.tensor([True, True])}, {"g.w": torch.tensor([True, False])}]
    kept = d.select([own, far], who=["me", "b"], masks=masks)
    # measured on element 0 only: distance 10 against 0.5 x 3 = 1.5, factor 0.15, applied to
    # every element (element 1 is the peer's claim as much as element 0)
    assert torch.allclose(kept[1]["g.w"], torch.tensor([4.5, 4.75]))


def test_spread_widens_the_bound_to_the_rounds_own_distances():
    own = st(3.0, 4.0)
    honest = [st(3.0 + 3, 4.0), st(3.0, 4.0 + 3.2), st(3.0 - 3.1, 4.0)]  # 3 to 3.2 away
    flipped = st(-3.0, -4.0)  # 10 away
    who = ["me", "a", "b", "c", "x"]
    fixed = defence("clip", gamma=0.5, kappa=0.0)  # 2.5: every honest peer refused
    assert sorted(fixed.select([own, *honest, flipped], who=who)) == [0]
    learnt = defence("clip", gamma=0.5, kappa=0.0, spread=2.0)  # 2 x lower median 3.1 = 6.2
    assert sorted(learnt.select([own, *honest, flipped], who=who)) == [0, 1, 2, 3]
    assert list(learnt.rejected) == ["x"] and "> 6.2" in learnt.rejected["x"]
    # centered_clip's radius: 2 x that median; the honest states whole, the flip pulled in
    default = defence("centered_clip", gamma=0.5, kappa=0.0)
    kept = default.select([own, *honest, flipped], who=who)
    assert all(kept[i] is s for i, s in enumerate([own, *honest]))  # whole, untouched
    assert default.clipped == {"x": pytest.approx(10 / 6.2, abs=1e-4)}
    moved = robust.distances(own, [kept[4]])[0]
    assert moved == pytest.approx(6.2) and default.rejected == {}


def test_centered_clip_takes_balances_bound_with_fewer_than_three_other_states():
    d = defence("centered_clip", gamma=0.5, kappa=0.0)  # bound 2.5 around (3, 4)
    own, far = st(3.0, 4.0), st(-3.0, -4.0)
    d.select([own, st(3.5, 4.5), far], who=["me", "b", "c"])
    assert d.clipped == {"c": 4.0}
