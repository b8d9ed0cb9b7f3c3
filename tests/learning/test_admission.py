"""Admission on its own: what a peer's state and sample count must pass before a method sees
them (p2pfl/learning/admission.py)."""

from __future__ import annotations

import math

import torch

from p2pfl.learning.admission import admit_state, cap_claims, sample_cap, state_norm


def own() -> dict[str, torch.Tensor]:
    return {
        "g.w": torch.tensor([[3.0, 0.0], [0.0, 4.0]]),  # norm 5
        "g.n": torch.tensor(7, dtype=torch.long),  # a counter: not in the norm
    }


def test_an_honest_state_is_admitted():
    theirs = {"g.w": torch.tensor([[2.0, 1.0], [1.0, 4.0]]), "g.n": torch.tensor(3)}
    assert admit_state(theirs, own(), 10.0) is None


def test_layout_is_checked_name_shape_and_dtype():
    assert "keys differ" in admit_state({"g.w": own()["g.w"]}, own(), 10.0)
    bad_shape = {"g.w": torch.zeros(3, 2), "g.n": torch.tensor(1)}
    assert "shape (3, 2)" in admit_state(bad_shape, own(), 10.0)
    bad_dtype = {"g.w": torch.zeros(2, 2, dtype=torch.float64), "g.n": torch.tensor(1)}
    assert "dtype torch.float64" in admit_state(bad_dtype, own(), 10.0)
    assert admit_state(["not", "a", "map"], own(), 10.0) == "not a map"
    assert "not a tensor" in admit_state({"g.w": [1.0], "g.n": torch.tensor(1)}, own(), 10.0)


def test_nan_and_infinity_are_refused_by_name():
    for bad in (math.nan, math.inf, -math.inf):
        theirs = {"g.w": torch.tensor([[1.0, bad], [0.0, 1.0]]), "g.n": torch.tensor(1)}
        assert admit_state(theirs, own(), 10.0) == "non-finite values in 'g.w'"


def test_the_norm_bound_is_relative_to_the_own_state():
    at_bound = {"g.w": own()["g.w"] * 10, "g.n": torch.tensor(1)}  # norm 50 = 10 x 5
    assert admit_state(at_bound, own(), 10.0) is None
    over = {"g.w": own()["g.w"] * 10.01, "g.n": torch.tensor(1)}
    assert admit_state(over, own(), 10.0) == "norm 50.05 > 10 x own 5"
    zero = {"g.w": torch.zeros(2, 2), "g.n": torch.tensor(0)}
    assert admit_state(over, zero, 10.0) is None  # a zero reference bounds nothing


def test_without_layout_only_shared_keys_count():
    result = {"g.w": own()["g.w"] * 2, "h.extra": torch.ones(5)}  # apply checks the layout
    assert admit_state(result, own(), 10.0, layout=False) is None
    assert admit_state({"g.w": own()["g.w"] * 20}, own(), 10.0, layout=False).startswith("norm")
    assert "non-finite" in admit_state({"h.x": torch.tensor([math.nan])}, own(), 10.0, layout=False)


def test_state_norm_ignores_counters_and_flags_non_finite():
    assert state_norm(own()) == 5.0
    assert state_norm({"a": torch.tensor([math.inf])}) == math.inf


def test_one_liar_cannot_claim_the_weight_of_the_swarm():
    claims = {"b": 120, "c": 80, "d": 10**9}
    assert sample_cap(100, claims, 10.0, None) == 1100  # 10 x median(100, 120, 80, 1e9)
    capped, was = cap_claims(100, claims, 10.0, None)
    assert capped == {"b": 120, "c": 80, "d": 1100} and was == {"d": 10**9}
    # the liar's share of a sample-weighted mean: 1100 / 1400, not 1e9 / (1e9 + 300)
    assert sample_cap(100, claims, 10.0, 500) == 500  # a configured cap wins when lower
    assert sample_cap(0, {}, 10.0, None) == 10  # a node with no samples still bounds


def test_reference_norms_are_computed_once_per_reference(monkeypatch):
    """Every peer of a round is admitted against the same reference: its norm is computed
    once, and again when the reference's tensors change (in place, or other tensors)."""
    import p2pfl.learning.admission as admission

    calls = []

    def counted(state, keys=None):
        calls.append(keys)
        return state_norm(state, keys)

    monkeypatch.setattr(admission, "state_norm", counted)
    norms = admission.ReferenceNorms()
    ref = own()
    theirs = {"g.w": torch.tensor([[60.0, 0.0], [0.0, 0.0]]), "g.n": torch.tensor(1)}
    for _ in range(3):  # a new map over the same tensors each time, as a node's snapshot part
        why = admit_state(theirs, dict(ref), 10.0, reference_norm=norms)
        assert why == "norm 60 > 10 x own 5"
    assert len(calls) == 3 + 1  # each peer's own norm, and the reference's once
    ref["g.w"].mul_(2)  # changed in place: its norm is computed again (10)
    assert admit_state(theirs, ref, 10.0, reference_norm=norms) is None
    norms.clear()
    ref = own()
    assert admit_state(theirs, ref, 10.0, reference_norm=norms) == "norm 60 > 10 x own 5"
