"""The update-level mechanism (p2pfl/privacy/update_dp.py): the clip is exact below and above
C, the noise's standard deviation is σC, non-floating tensors pass through, a broken update
counts as none, and a seed gives the same release."""

from __future__ import annotations

import math

import pytest
import torch

from p2pfl.privacy.update_dp import release, update_norm


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _states(delta_scale: float):
    """A reference and a trained state whose floating update is ``delta_scale`` times a
    fixed direction of norm 5 (3 + 4 over two tensors), with an integer buffer that moved."""
    ref = {
        "w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
        "b": torch.tensor([0.5, -0.5], dtype=torch.float64),
        "n": torch.tensor(7, dtype=torch.long),
    }
    direction = {"w": torch.tensor([[3.0, 0.0], [0.0, 0.0]]), "b": torch.tensor([0.0, 4.0])}
    trained = {
        "w": ref["w"] + delta_scale * direction["w"],
        "b": ref["b"] + delta_scale * direction["b"].double(),
        "n": torch.tensor(9, dtype=torch.long),
    }
    return ref, trained


def _noise_free(ref, trained, max_norm):
    """The release minus its noise: draw the same noise from the same seed and remove it."""
    released = release(ref, trained, max_norm, 1.0, _gen(3)).state
    zero = release(ref, ref, max_norm, 1.0, _gen(3)).state  # ref + the same noise
    return {k: released[k].double() - zero[k].double() for k in ("w", "b")}


@pytest.mark.parametrize(("scale", "max_norm", "kept"), [(0.1, 1.0, 1.0), (2.0, 1.0, 0.1)])
def test_the_clip_is_exact_under_and_over_the_bound(scale, max_norm, kept):
    ref, trained = _states(scale)
    assert update_norm(ref, trained) == pytest.approx(5 * scale)
    step = _noise_free(ref, trained, max_norm)
    # under C the update goes through whole; over C it is scaled to norm C exactly
    want = {k: (trained[k].double() - ref[k].double()) * kept for k in ("w", "b")}
    for k in ("w", "b"):
        assert torch.allclose(step[k], want[k], atol=1e-6), (k, step[k], want[k])
    norm = math.sqrt(sum(float(v.pow(2).sum()) for v in step.values()))
    assert norm == pytest.approx(min(5 * scale, max_norm), rel=1e-6)
    out = release(ref, trained, max_norm, 1.0, _gen())
    assert out.norm == pytest.approx(5 * scale) and out.clipped(max_norm) is (5 * scale > max_norm)


def test_the_noise_has_standard_deviation_sigma_c():
    n = 200_000
    ref = {"w": torch.zeros(n), "h": torch.zeros(n, dtype=torch.float64)}
    sigma, c = 0.7, 2.5
    out = release(ref, dict(ref), c, sigma, _gen(11)).state
    for k in ("w", "h"):
        x = out[k].double()
        assert abs(float(x.mean())) < 4 * sigma * c / math.sqrt(n)
        # the sample std of n normals is within 1% of σC with overwhelming probability
        assert float(x.std()) == pytest.approx(sigma * c, rel=0.01)
    assert out["w"].dtype == torch.float32 and out["h"].dtype == torch.float64


def test_non_floating_tensors_pass_through_from_the_trained_state():
    ref, trained = _states(1.0)
    out = release(ref, trained, 1.0, 1.0, _gen()).state
    assert out["n"].dtype == torch.long and int(out["n"]) == 9
    assert list(out) == list(trained)
    assert out["n"].data_ptr() != trained["n"].data_ptr()  # a copy, not the caller's tensor


def test_the_same_seed_gives_the_same_release_and_another_does_not():
    ref, trained = _states(1.0)
    a = release(ref, trained, 1.0, 1.0, _gen(5)).state
    b = release(ref, trained, 1.0, 1.0, _gen(5)).state
    c = release(ref, trained, 1.0, 1.0, _gen(6)).state
    assert all(a[k].equal(b[k]) for k in a)
    assert not a["w"].equal(c["w"])


def test_a_non_finite_update_counts_as_none():
    ref, trained = _states(1.0)
    trained["w"][0, 0] = math.nan
    out = release(ref, trained, 1.0, 0.5, _gen(2))
    assert math.isnan(out.norm) and not out.clipped(1.0)
    zero = release(ref, ref, 1.0, 0.5, _gen(2)).state  # ref + the same noise
    assert all(torch.isfinite(out.state[k]).all() for k in ("w", "b"))
    assert out.state["w"].equal(zero["w"]) and out.state["b"].equal(zero["b"])


def test_bad_inputs_are_refused():
    ref, trained = _states(1.0)
    with pytest.raises(ValueError, match="different keys"):
        release(ref, {k: v for k, v in trained.items() if k != "b"}, 1.0, 1.0, _gen())
    with pytest.raises(ValueError, match="'w' is"):
        release(ref, dict(trained, w=torch.zeros(3)), 1.0, 1.0, _gen())
    with pytest.raises(ValueError, match="bad bound"):
        release(ref, trained, 0.0, 1.0, _gen())
