"""The attacks' pure maths (p2pfl/attacks/transforms.py) against hand-computed values."""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest
import torch

from p2pfl.attacks.transforms import (
    ALIE_Z_MIN,
    alie,
    alie_z,
    flip_labels,
    gaussian_noise,
    ipm,
    nan_state,
    scale,
    sign_flip,
)


def _state(w, dtype=torch.float32):
    return {
        "g.w": torch.tensor(w, dtype=dtype),
        "g.n": torch.tensor(7, dtype=torch.long),
    }


def _snapshot(state):
    return {k: t.clone() for k, t in state.items()}


def _assert_untouched(state, before):
    assert set(state) == set(before)
    for k in state:
        assert torch.equal(state[k], before[k])


def _shares_storage(a, b) -> bool:
    return any(a[k].untyped_storage().data_ptr() == b[k].untyped_storage().data_ptr() for k in a)


# ----------------------------------------------------------------------------- simple ones


def test_sign_flip_negates_floating_tensors_only():
    s = _state([1.0, -2.0, 0.5])
    before = _snapshot(s)
    out = sign_flip(s)
    assert torch.equal(out["g.w"], torch.tensor([-1.0, 2.0, -0.5]))
    assert out["g.n"].item() == 7 and out["g.n"].dtype == torch.long
    assert out["g.w"].dtype == torch.float32
    assert list(out) == list(s)
    _assert_untouched(s, before)
    assert not _shares_storage(out, s)


def test_scale_multiplies_and_keeps_dtype():
    s = _state([1.0, -2.0], dtype=torch.float16)
    out = scale(s, 100.0)
    assert out["g.w"].dtype == torch.float16
    assert torch.equal(out["g.w"], torch.tensor([100.0, -200.0], dtype=torch.float16))
    assert out["g.n"].item() == 7
    assert not _shares_storage(out, s)
    same = scale(s, 1.0)  # a copy even when the values do not change
    assert torch.equal(same["g.w"], s["g.w"]) and not _shares_storage(same, s)


def test_nan_state_fills_every_floating_element():
    s = _state([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    out = nan_state(s)
    assert out["g.w"].shape == (2, 2) and out["g.w"].dtype == torch.float64
    assert torch.isnan(out["g.w"]).all()
    assert out["g.n"].item() == 7
    assert not torch.isnan(s["g.w"]).any()


def test_gaussian_noise_replaces_the_state_deterministically():
    s = _state([5.0] * 4)
    before = _snapshot(s)
    a = gaussian_noise(s, 2.0, torch.Generator().manual_seed(11))
    b = gaussian_noise(s, 2.0, torch.Generator().manual_seed(11))
    c = gaussian_noise(s, 2.0, torch.Generator().manual_seed(12))
    expected = (
        torch.randn(4, generator=torch.Generator().manual_seed(11), dtype=torch.float64) * 2
    ).float()
    assert torch.equal(a["g.w"], expected)  # replaced, not 5 + noise
    assert torch.equal(a["g.w"], b["g.w"]) and not torch.equal(a["g.w"], c["g.w"])
    assert a["g.w"].dtype == torch.float32 and a["g.n"].item() == 7
    _assert_untouched(s, before)
    with pytest.raises(ValueError):
        gaussian_noise(s, -1.0, torch.Generator())


# ----------------------------------------------------------------------------- ALIE and IPM


def test_alie_is_mean_minus_z_population_std():
    a, b = _state([1.0, 4.0]), _state([3.0, 8.0])
    # mean [2, 6], population std [1, 2]
    out = alie([a, b], 1.5)
    assert torch.allclose(out["g.w"], torch.tensor([0.5, 3.0]))
    assert out["g.n"].item() == 7 and out["g.w"].dtype == torch.float32
    assert not _shares_storage(out, a) and not _shares_storage(out, b)


def test_alie_three_states_and_float64_maths():
    states = [_state([1.0, 2.0], torch.float64), _state([3.0, 6.0], torch.float64)]
    states.append(_state([5.0, 10.0], torch.float64))
    before = [_snapshot(s) for s in states]
    out = alie(states, 1.0)
    # [1,3,5]: mean 3, var 8/3; [2,6,10]: mean 6, var 32/3
    expected = torch.tensor([3 - math.sqrt(8 / 3), 6 - math.sqrt(32 / 3)], dtype=torch.float64)
    assert torch.allclose(out["g.w"], expected, rtol=0, atol=1e-12)
    for s, b in zip(states, before, strict=True):
        _assert_untouched(s, b)


def test_alie_of_one_state_is_the_state():
    s = _state([1.0, -3.0])
    out = alie([s], 2.0)
    assert torch.equal(out["g.w"], s["g.w"]) and not _shares_storage(out, s)


def test_alie_and_ipm_reject_bad_inputs():
    with pytest.raises(ValueError):
        alie([], 1.0)
    with pytest.raises(ValueError):
        ipm([_state([1.0]), _state([1.0, 2.0])], 0.5)
    with pytest.raises(ValueError):
        alie([_state([1.0]), {"g.w": torch.tensor([1.0])}], 1.0)


def test_ipm_is_minus_epsilon_mean():
    a, b = _state([1.0, 4.0]), _state([3.0, 8.0])
    out = ipm([a, b], 0.5)
    assert torch.allclose(out["g.w"], torch.tensor([-1.0, -3.0]))
    out3 = ipm([a, b, _state([2.0, 0.0])], 2.0)  # mean [2, 4]
    assert torch.allclose(out3["g.w"], torch.tensor([-4.0, -8.0]))
    assert out3["g.n"].item() == 7


@pytest.mark.parametrize(
    ("n", "f", "p"),
    [(20, 4, 13 / 20), (50, 12, 36 / 50), (3, 1, 2 / 3), (10, 3, 7 / 10)],
)
def test_alie_z_matches_the_papers_formula(n, f, p):
    # s = floor(n/2 + 1) - f; z = inv_cdf((n - s) / n)
    assert alie_z(n, f) == pytest.approx(NormalDist().inv_cdf(p))


def test_alie_z_known_value_and_edges():
    assert alie_z(20, 4) == pytest.approx(0.3853, abs=1e-4)
    assert alie_z(2, 1) == ALIE_Z_MIN  # (n - s)/n = 1/2: the formula gives 0
    assert alie_z(10, 1) == ALIE_Z_MIN
    assert alie_z(1, 0) == ALIE_Z_MIN
    assert alie_z(5, 3) == pytest.approx(NormalDist().inv_cdf(4 / 5))  # s <= 0 taken as 1
    assert all(alie_z(n, f) >= ALIE_Z_MIN for n in range(1, 30) for f in range(n + 1))
    for n, f in ((0, 0), (5, -1), (5, 6)):
        with pytest.raises(ValueError):
            alie_z(n, f)


# ----------------------------------------------------------------------------- labels


def test_flip_labels_untargeted_and_targeted():
    y = torch.tensor([0, 1, 2, 3, 1])
    assert flip_labels(y, 4, None, None).tolist() == [3, 2, 1, 0, 2]
    assert flip_labels(y, 4, 1, 3).tolist() == [0, 3, 2, 3, 3]
    assert y.tolist() == [0, 1, 2, 3, 1]
    out = flip_labels(y, 4, None, None)
    assert out.dtype == y.dtype and out.data_ptr() != y.data_ptr()
    with pytest.raises(ValueError):
        flip_labels(y, 4, 1, None)
    with pytest.raises(ValueError):
        flip_labels(y, 4, 4, 0)
    with pytest.raises(ValueError):
        flip_labels(y, 0, None, None)
