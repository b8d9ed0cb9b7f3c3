"""DiversiFed (p2pfl/algorithms/diversifed.py): the server rule against autograd and by hand,
and the method end to end on a tiny model."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from p2pfl.algorithms import get_algorithm, validate_params
from p2pfl.algorithms.base import Upload
from p2pfl.algorithms.diversifed import (
    DiversiFed,
    diversifed_targets,
    flatten_state,
    float_keys,
    unflatten,
)

D = torch.float64


def autograd_step(W: torch.Tensor, i: int, tau: float, alpha: float) -> torch.Tensor:
    """``w_i − α ∇L_d(w_i)`` with ``L_d(w_i) = (1/|a(i)|) Σ_j log softmax(d)_j``,
    ``d_j = ‖w_i − w_j‖ / τ``, differentiated by autograd with the other rows fixed."""
    x = W[i].clone().requires_grad_(True)
    others = [W[j] for j in range(W.shape[0]) if j != i]
    d = torch.stack([torch.linalg.vector_norm(x - w_j) / tau for w_j in others])
    L_d = torch.log_softmax(d, dim=0).sum() / len(others)
    (grad,) = torch.autograd.grad(L_d, x)
    return (W[i] - alpha * grad).detach()


# ------------------------------------------------------- (1) one autograd gradient step


@pytest.mark.parametrize("K", [4, 2, 3, 7])
@pytest.mark.parametrize("tau,alpha", [(1.0, 1.0), (0.5, 1.0), (1.1, 0.3), (0.7, 2.5)])
def test_targets_equal_one_autograd_descent_step_on_L_d(K, tau, alpha):
    gen = torch.Generator().manual_seed(1000 * K + int(100 * tau) + int(10 * alpha))
    W = torch.randn(K, 5, generator=gen, dtype=D)
    Z = diversifed_targets(W, tau, alpha)
    assert Z.shape == W.shape and Z.dtype == D
    for i in range(K):
        # the formula equals w_i − α∇L_d (gradient *descent*), not w_i + α∇L_d
        assert torch.allclose(Z[i], autograd_step(W, i, tau, alpha), atol=1e-10, rtol=0)


def test_targets_match_autograd_for_a_near_identical_pair_far_from_origin():
    gen = torch.Generator().manual_seed(7)
    W = 1e3 + torch.randn(4, 6, generator=gen, dtype=D)
    W[1] = W[0] + 1e-7 * torch.randn(6, generator=gen, dtype=D)
    Z = diversifed_targets(W, 0.8, 1.0)
    for i in range(4):
        assert torch.allclose(Z[i], autograd_step(W, i, 0.8, 1.0), atol=1e-8, rtol=0)


def test_step_is_not_the_ascent_step():
    W = torch.tensor([[0.0], [1.0], [3.0]], dtype=D)
    Z = diversifed_targets(W, 1.0, 1.0)
    x = W[1].clone().requires_grad_(True)
    d = torch.stack([(x - W[0]).abs().sum(), (x - W[2]).abs().sum()])
    (grad,) = torch.autograd.grad(torch.log_softmax(d, 0).mean(), x)
    assert abs(float(grad)) > 0.1
    assert not torch.allclose(Z[1], W[1] + grad)


# ------------------------------------------------------------------- (2) by hand


def test_two_models_in_1d_by_hand():
    # w = [0], [2], τ = 1: a(i) has one element, so s = softmax([2]) = [1] and
    # ξ = 1/|a(i)| − s = 1 − 1 = 0: no attraction, no repulsion, z_i = w_i.
    W = torch.tensor([[0.0], [2.0]], dtype=D)
    Z = diversifed_targets(W, tau=1.0, alpha=1.0)
    assert torch.equal(Z, W)


def test_three_models_in_1d_by_hand():
    # w = [0], [1], [3], τ = α = 1.
    # i = 1: others 0 (d = 1, (w_1 − w_0)/(τ² d) = +1) and 3 (d = 2, (1 − 3)/2 = −1).
    #   s = softmax([1, 2]) = [1/(1+e), e/(1+e)]
    #   ξ = [1/2 − 1/(1+e), 1/2 − e/(1+e)] = [(e−1)/(2(1+e)), −(e−1)/(2(1+e))]
    #   Σ ξ_j · dir_j = (e−1)/(1+e) = tanh(1/2) ≈ 0.46212
    #   z_1 = 1 − tanh(1/2) ≈ 0.53788: pulled towards the nearer model 0, away from 3.
    # i = 0 (and likewise i = 2): both others lie on the same side, both directions are −1
    #   (resp. +1) and Σ ξ_j = 1 − Σ s_j = 0, so z_0 = 0 and z_2 = 3.
    W = torch.tensor([[0.0], [1.0], [3.0]], dtype=D)
    Z = diversifed_targets(W, tau=1.0, alpha=1.0)
    assert float(Z[1, 0]) == pytest.approx(1.0 - math.tanh(0.5), abs=1e-14)
    assert float(Z[1, 0]) == pytest.approx(0.5378828427399902, abs=1e-12)
    assert float(Z[0, 0]) == pytest.approx(0.0, abs=1e-14)
    assert float(Z[2, 0]) == pytest.approx(3.0, abs=1e-14)
    # α scales the step; τ enters as 1/τ in the direction and in the softmax:
    # τ = 2, α = 0.5: d = [1/2, 1], ξ_0 = 1/2 − 1/(1+e^{1/2}) = tanh(1/4)/2,
    # Σ ξ_j dir_j / τ = 2 ξ_0 / 2 = tanh(1/4)/2, z_1 = 1 − 0.5 · tanh(1/4)/2.
    Z2 = diversifed_targets(W, tau=2.0, alpha=0.5)
    assert float(Z2[1, 0]) == pytest.approx(1.0 - 0.25 * math.tanh(0.25), abs=1e-14)


# ------------------------------------------------------------ (3) degenerate inputs


@pytest.mark.parametrize("K", [2, 3, 5])
def test_identical_models_give_finite_unchanged_targets(K):
    row = torch.tensor([0.25, -1.5, 3.0, 0.0], dtype=D)
    W = row.repeat(K, 1)
    Z = diversifed_targets(W, tau=0.5, alpha=1.0)
    assert bool(torch.isfinite(Z).all())
    assert torch.equal(Z, W)


def test_partly_identical_models_stay_finite_and_match_autograd():
    gen = torch.Generator().manual_seed(3)
    W = torch.randn(4, 5, generator=gen, dtype=D)
    W[2] = W[0]
    Z = diversifed_targets(W, 1.0, 1.0)
    assert bool(torch.isfinite(Z).all())
    for i in range(4):  # autograd's subgradient of ‖·‖ at 0 is 0, as the eps guard's
        assert torch.allclose(Z[i], autograd_step(W, i, 1.0, 1.0), atol=1e-10, rtol=0)


def test_single_model_is_unchanged():
    W = torch.tensor([[1.0, 2.0, 3.0]], dtype=D)
    assert torch.equal(diversifed_targets(W), W)


def test_targets_reject_a_non_matrix():
    with pytest.raises(ValueError):
        diversifed_targets(torch.zeros(3, dtype=D))


# ---------------------------------------------------------- (4) flatten / unflatten


def test_flatten_unflatten_round_trip_keeps_shapes_dtypes_and_int_buffers():
    state = {
        "b.weight": torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float32),
        "a.bias": torch.tensor([0.5, -0.5, 1.5], dtype=torch.float64),
        "bn.num_batches_tracked": torch.tensor(7, dtype=torch.long),
        "c.half": torch.tensor([0.25], dtype=torch.float16),
    }
    keys = float_keys(state)
    assert keys == ["a.bias", "b.weight", "c.half"]
    vec = flatten_state(state, keys)
    assert vec.dtype == D
    assert vec.tolist() == [0.5, -0.5, 1.5, 1.0, 2.0, 3.0, 4.0, 0.25]
    back = unflatten(vec, state)
    assert list(back) == list(state)
    for k, ref in state.items():
        assert back[k].dtype == ref.dtype and back[k].shape == ref.shape
        assert torch.equal(back[k], ref)
    # a changed vector lands in the float tensors; the int buffer is the template's copy
    back2 = unflatten(vec + 1.0, state)
    assert back2["a.bias"].tolist() == [1.5, 0.5, 2.5]
    assert back2["b.weight"].tolist() == [[2.0, 3.0], [4.0, 5.0]]
    assert int(back2["bn.num_batches_tracked"]) == 7
    assert back2["bn.num_batches_tracked"].data_ptr() != state["bn.num_batches_tracked"].data_ptr()
    with pytest.raises(ValueError):
        unflatten(vec[:-1], state)


# ----------------------------------------------------------------- (5) the method


@pytest.fixture
def make_alg(make_method):
    """``make_alg(params)``: DiversiFed on a 4-unit MLP, 10 samples (tests/conftest.py)."""
    return partial(make_method, DiversiFed)


def perturbed(state, scale: float, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return {
        k: v + scale * torch.randn(v.shape, generator=gen, dtype=v.dtype)
        if torch.is_floating_point(v)
        else v.clone()
        for k, v in state.items()
    }


def test_registered_and_knobs_validated():
    assert get_algorithm("diversifed") is DiversiFed
    assert DiversiFed.kind == "centralized" and DiversiFed.upload_part == "all"
    assert validate_params("diversifed", {}) == {
        "fraction": 1.0,  # every centralized method's client fraction
        "tau": 1.0,
        "alpha": 1.0,
        "lam": 2.0,
        "eps": 1e-12,
    }
    for bad in ({"tau": 0}, {"alpha": -1}, {"lam": -0.1}, {"eps": 0}, {"mu": 1}):
        with pytest.raises(ValueError):
            validate_params("diversifed", bad)


def test_method_end_to_end(make_alg):
    lam, alpha, tau = 3.0, 0.5, 0.7
    alg = make_alg({"lam": lam, "alpha": alpha, "tau": tau})
    assert alg.target is None and alg.extra_loss() is None  # round 1: plain CE

    base = alg.snapshot()
    states = {f"n{i}": perturbed(base, 0.1 * (i + 1), seed=i) for i in range(3)}
    uploads = {node: Upload(10 + i, st, {}) for i, (node, st) in enumerate(states.items())}
    agg = alg.aggregate(uploads, {}, ["n0", "n1", "n2", "n3"], 1)
    assert sorted(agg.results) == ["n0", "n1", "n2"]  # n3 did not upload: nothing
    assert agg.common is None
    assert agg.facts["mean_dist"] > 0 and math.isfinite(agg.facts["mean_dist"])

    keys = float_keys(base)
    W = torch.stack([flatten_state(states[n], keys) for n in ["n0", "n1", "n2"]])
    Z = diversifed_targets(W, tau, alpha)
    for i, node in enumerate(["n0", "n1", "n2"]):
        z_state = agg.results[node]
        assert list(z_state) == list(base)
        assert all(z_state[k].dtype == base[k].dtype for k in base)
        z_vec = flatten_state(z_state, keys)
        # each node gets its own z_i (to float32 precision), not someone else's
        assert torch.allclose(z_vec, Z[i], atol=1e-6)
        for j in range(3):
            if j != i:
                assert not torch.allclose(z_vec, Z[j], atol=1e-3)
        assert not torch.allclose(z_vec, W[i], atol=1e-6)  # K = 3: a real step

    # node n0: its model holds its own trained w_0; apply stores z_0, leaves w_0 alone
    alg.model.load_state_dict(states["n0"])
    before = {k: v.clone() for k, v in alg.model.state_dict().items()}
    facts = alg.apply(agg.results["n0"], {})
    after = alg.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert alg.target is not None
    assert all(not alg.target[k].requires_grad for k in alg.target)
    z0 = agg.results["n0"]
    assert all(torch.equal(alg.target[k], z0[k]) for k in z0)
    params = dict(alg.model.named_parameters())
    diff_sq = sum(
        float((p.detach().double() - z0[k].double()).pow(2).sum()) for k, p in params.items()
    )
    assert facts["prox_dist"] == pytest.approx(math.sqrt(diff_sq), rel=1e-9)

    # the proximal term and its gradient, by hand
    term = alg.extra_loss()
    assert term is not None
    x = torch.zeros(2, 1, 4, 4)
    y = torch.zeros(2, dtype=torch.long)
    alg.model.zero_grad()
    logits = alg.model(x)
    value = term(alg.model, x, y, logits)
    assert value.dim() == 0
    assert float(value.detach()) == pytest.approx(lam / (2 * alpha) * diff_sq, rel=1e-5)
    value.backward()
    for k, p in params.items():
        expected = (lam / alpha) * (p.detach() - z0[k])
        assert torch.allclose(p.grad, expected, atol=1e-6, rtol=1e-5)


def test_extra_loss_is_none_with_lambda_zero(make_alg):
    alg = make_alg({"lam": 0.0})
    alg.apply(alg.snapshot(), {})
    assert alg.extra_loss() is None


def test_round_one_identical_uploads_give_back_the_common_model(make_alg):
    alg = make_alg()
    base = alg.snapshot()
    uploads = {f"n{i}": Upload(5, {k: v.clone() for k, v in base.items()}, {}) for i in range(4)}
    agg = alg.aggregate(uploads, {}, sorted(uploads), 1)
    assert agg.facts["mean_dist"] == 0.0
    for z in agg.results.values():
        assert all(torch.equal(z[k], base[k]) for k in base)


def test_non_finite_upload_is_left_out(make_alg):
    alg = make_alg()
    base = alg.snapshot()
    states = {f"n{i}": perturbed(base, 0.1, seed=i) for i in range(4)}
    bad = next(iter(states["n2"]))
    states["n2"][bad] = states["n2"][bad].clone()
    states["n2"][bad].view(-1)[0] = float("nan")
    agg = alg.aggregate({n: Upload(5, s, {}) for n, s in states.items()}, {}, sorted(states), 2)
    assert sorted(agg.results) == ["n0", "n1", "n3"]
    assert agg.facts["excluded"] == ["n2"]
    for z in agg.results.values():
        assert all(bool(torch.isfinite(v).all()) for v in z.values())


# ------------------------------------------------------------ (6) apply rejects


def test_apply_rejects_a_mismatched_state(make_alg):
    alg = make_alg()
    good = alg.snapshot()
    k0 = next(iter(good))

    wrong_shape = dict(good)
    wrong_shape[k0] = torch.zeros(*good[k0].shape, 2)
    missing = {k: v for k, v in good.items() if k != k0}
    extra = {**good, "x.weight": torch.zeros(1)}
    nan = dict(good)
    nan[k0] = torch.full_like(good[k0], float("nan"))
    for bad in (wrong_shape, missing, extra, nan):
        with pytest.raises(ValueError):
            alg.apply(bad, {})
        assert alg.target is None
    alg.apply(good, {})
    assert alg.target is not None
