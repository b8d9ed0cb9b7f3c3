"""DisPFL's rules against hand-computed values (docs/algorithms.md, "DisPFL"): the mask-aware
average, ERK densities, prune-and-regrow, the cosine schedule, the
sparse wire form, and the method's round on a tiny model."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from p2pfl.algorithms.dispfl import (
    DisPFL,
    decode_sparse,
    encode_sparse,
    erk_densities,
    mask_overlap,
    maskable_keys,
    masked_average,
    prune_and_regrow,
    prune_fraction,
    random_masks,
)
from p2pfl.config.schema import TrainingConfig
from p2pfl.learning.train import train_local
from p2pfl.wire.codec import buffer_to_state, state_to_buffer

T = torch.tensor
B = lambda *v: torch.tensor(v, dtype=torch.bool)  # noqa: E731

# ----------------------------------------------------------------------------- the average


def _three_models():
    own = ({"w": T([1.0, 2.0, 0.0, 4.0]), "b": T([1.0])}, {"w": B(1, 1, 0, 1)})
    a = ({"w": T([3.0, 0.0, 5.0, 8.0]), "b": T([2.0])}, {"w": B(1, 0, 1, 1)})
    b = ({"w": T([0.0, 6.0, 7.0, 2.0]), "b": T([6.0])}, {"w": B(0, 1, 1, 1)})
    return own, a, b


def test_masked_average_hand_checked_uniform():
    (own, m0), (a, ma), (b, mb) = _three_models()
    out = masked_average([(1.0, own, m0), (1.0, a, ma), (1.0, b, mb)], m0)
    # element 0: own 1 and a 3 hold it → 2; element 1: own 2 and b 6 → 4;
    # element 2: a 5 and b 7 hold it, but own's mask does not → 0;
    # element 3: 4, 8, 2 → 14/3. The dense bias: (1 + 2 + 6) / 3 = 3.
    assert torch.allclose(out["w"], T([2.0, 4.0, 0.0, 14 / 3]))
    assert torch.allclose(out["b"], T([3.0]))
    assert out["w"].dtype == torch.float32


def test_masked_average_hand_checked_weighted():
    (own, m0), (a, ma), (b, mb) = _three_models()
    out = masked_average([(2.0, own, m0), (1.0, a, ma), (1.0, b, mb)], m0)
    # element 0: (2·1 + 1·3) / 3; element 1: (2·2 + 1·6) / 3; element 3: (2·4 + 8 + 2) / 4
    assert torch.allclose(out["w"], T([5 / 3, 10 / 3, 0.0, 4.5]))
    assert torch.allclose(out["b"], T([(2 * 1 + 2 + 6) / 4]))


def test_masked_average_alone_is_identity_and_keeps_int_buffers():
    own = {"w": T([1.5, 0.0, -2.0]), "steps": T(7)}
    masks = {"w": B(1, 0, 1)}
    out = masked_average([(1.0, own, masks)], masks)
    assert torch.equal(out["w"], own["w"]) and int(out["steps"]) == 7
    with pytest.raises(ValueError):
        masked_average([], masks)
    with pytest.raises(ValueError):
        masked_average([(0.0, own, masks)], masks)


# ----------------------------------------------------------------------------- masks


def test_erk_densities_reach_the_target_and_favour_small_layers():
    shapes = {"conv": (8, 3, 3, 3), "fc1": (256, 512), "fc2": (10, 256)}
    d = erk_densities(shapes, 0.5)
    total = sum(math.prod(s) for s in shapes.values())
    kept = sum(d[k] * math.prod(s) for k, s in shapes.items())
    assert kept == pytest.approx(0.5 * total, rel=1e-9)
    assert d["fc1"] < 0.5 < d["conv"]  # the big layer is sparser than the small ones
    assert all(0 < v <= 1 for v in d.values())


def test_erk_makes_a_layer_dense_when_it_would_exceed_one():
    shapes = {"tiny": (2, 2), "big": (1000, 1000)}
    d = erk_densities(shapes, 0.5)
    assert d["tiny"] == 1.0
    kept = d["tiny"] * 4 + d["big"] * 1_000_000
    assert kept == pytest.approx(0.5 * 1_000_004, rel=1e-9)
    assert erk_densities(shapes, 1.0) == {"tiny": 1.0, "big": 1.0}
    with pytest.raises(ValueError):
        erk_densities(shapes, 0.0)


def test_random_masks_have_exact_counts_and_depend_on_the_seed():
    shapes = {"a": (10, 10), "b": (4, 5)}
    dens = {"a": 0.3, "b": 0.5}
    m1 = random_masks(shapes, dens, torch.Generator().manual_seed(1))
    m2 = random_masks(shapes, dens, torch.Generator().manual_seed(2))
    assert int(m1["a"].sum()) == 30 and int(m1["b"].sum()) == 10
    assert m1["a"].shape == (10, 10) and m1["a"].dtype == torch.bool
    assert not torch.equal(m1["a"], m2["a"])  # personalized masks
    assert mask_overlap(m1, m1) == 1.0 and 0 < mask_overlap(m1, m2) < 1


def test_prune_fraction_is_cosine_annealed():
    assert prune_fraction(0, 100, 0.5) == pytest.approx(0.5)
    assert prune_fraction(50, 100, 0.5) == pytest.approx(0.25)
    assert prune_fraction(100, 100, 0.5) == pytest.approx(0.0)
    assert prune_fraction(25, 100, 0.5) == pytest.approx(0.25 * (1 + math.cos(math.pi / 4)))


def test_prune_and_regrow_hand_checked_by_gradient():
    w = T([0.1, -5.0, 0.2, 3.0, 0.0, 0.0])
    m = B(1, 1, 1, 1, 0, 0)
    grad = T([9.0, 0.0, 0.5, 0.0, 4.0, 1.0])
    new, k = prune_and_regrow(w, m, 0.5, torch.Generator().manual_seed(0), grad)
    # k = 2: drop the two smallest |w| among active (0.1, 0.2 at 0 and 2); the inactive
    # after the drop are {0, 2, 4, 5}; the two largest |grad| among them are 0 (9) and 4 (4)
    assert k == 2
    assert new.tolist() == [True, True, False, True, True, False]


def test_prune_and_regrow_random_keeps_the_count():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(20, 30, generator=g)
    m = torch.rand(20, 30, generator=g) < 0.4
    new, k = prune_and_regrow(w * m, m, 0.25, g, None)
    assert k == int(0.25 * int(m.sum()))
    assert int(new.sum()) == int(m.sum()) and new.shape == m.shape
    # the k smallest active weights went away (unless regrown by chance)
    same, zero = prune_and_regrow(w, m, 0.0, g, None)
    assert zero == 0 and torch.equal(same, m)


# ----------------------------------------------------------------------------- the wire


def _state_and_masks():
    g = torch.Generator().manual_seed(0)
    state = {
        "g.fc.weight": torch.randn(7, 9, generator=g),
        "g.fc.bias": torch.randn(7, generator=g),
        "h.weight": torch.randn(3, 7, generator=g),
        "h.bias": torch.randn(3, generator=g),
    }
    masks = random_masks(
        {k: tuple(v.shape) for k, v in state.items() if v.dim() >= 2},
        {"g.fc.weight": 0.5, "h.weight": 0.5},
        g,
    )
    return {k: v * masks[k] if k in masks else v for k, v in state.items()}, masks


def test_sparse_wire_round_trip_through_the_codec_and_is_smaller():
    state, masks = _state_and_masks()
    assert maskable_keys(state) == ["g.fc.weight", "h.weight"]
    wire = encode_sparse(state, masks)
    assert wire["g.fc.weight:mask"].dtype == torch.uint8
    assert wire["g.fc.weight:values"].numel() == int(masks["g.fc.weight"].sum())
    index, buf = state_to_buffer(wire)
    back_wire = buffer_to_state(index, buf)
    dense, got_masks = decode_sparse(back_wire, state, maskable_keys(state))
    for k in state:
        assert torch.equal(dense[k], state[k]), k
    for k in masks:
        assert torch.equal(got_masks[k], masks[k])
    dense_bytes = sum(v.numel() * 4 for v in state.values())
    wire_bytes = sum(v.numel() * v.element_size() for v in wire.values())
    assert wire_bytes < 0.7 * dense_bytes  # half the weights plus one bit each


@pytest.mark.parametrize(
    "breakage",
    ["values_count", "padding", "dtype", "extra", "missing", "nan", "shape", "not_map"],
)
def test_decode_sparse_rejects_malformed_peers(breakage):
    state, masks = _state_and_masks()
    wire = encode_sparse(state, masks)
    if breakage == "values_count":
        wire["h.weight:values"] = wire["h.weight:values"][:-1]
    elif breakage == "padding":  # 21 elements: the last byte has 3 unused bits
        wire["h.weight:mask"] = wire["h.weight:mask"].clone()
        wire["h.weight:mask"][-1] |= 1
    elif breakage == "dtype":
        wire["g.fc.weight:values"] = wire["g.fc.weight:values"].double()
    elif breakage == "extra":
        wire["h.evil"] = torch.zeros(1)
    elif breakage == "missing":
        del wire["g.fc.bias"]
    elif breakage == "nan":
        wire["h.bias"] = torch.tensor([float("nan"), 0.0, 0.0])
    elif breakage == "shape":
        wire["g.fc.bias"] = torch.zeros(8)
    else:
        wire = [1, 2, 3]
    with pytest.raises(ValueError):
        decode_sparse(wire, state, maskable_keys(state))


# ----------------------------------------------------------------------------- the class


@pytest.fixture
def make_alg(make_method):
    """``make_alg(seed, params)``: DisPFL node ``n<seed>`` on a 16-unit MLP, 30 samples, the
    same initial model on every node (torch seed 0, as the daemon does) and its masks drawn
    from ``seed`` (tests/conftest.py)."""

    def make(seed=0, params=None, n=30):
        alg = make_method(
            "dispfl",
            params,
            hidden=16,
            num_samples=n,
            node_id=f"n{seed}",
            seed=0,
            rng_seed=seed,
            total_rounds=10,
        )
        assert isinstance(alg, DisPFL)
        return alg

    return make


def _zeros_off_mask(alg) -> bool:
    params = dict(alg.model.named_parameters())
    return all(bool((params[k][~alg.masks[k]] == 0).all()) for k in alg.masked)


def test_params_are_validated(make_alg):
    with pytest.raises(ValidationError):
        make_alg(params={"density": 0})
    with pytest.raises(ValidationError):
        make_alg(params={"regrow": "magic"})
    with pytest.raises(ValidationError):
        make_alg(params={"sparsity": 0.5})


def test_initial_masks_are_personal_and_applied(make_alg):
    a, b = make_alg(0), make_alg(1)
    assert a.masked == ["g.fc.weight", "h.weight"]
    assert a.density() == pytest.approx(0.5, abs=0.01)
    assert _zeros_off_mask(a) and _zeros_off_mask(b)
    assert mask_overlap(a.masks, b.masks) < 0.9  # different nodes, different masks


def test_training_keeps_the_mask_and_prune_regrow_keeps_density(make_alg):
    alg = make_alg(0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(60, 1, 4, 4, generator=g), torch.randint(0, 3, (60,), generator=g)
    before = {k: m.clone() for k, m in alg.masks.items()}
    counts = {k: int(m.sum()) for k, m in alg.masks.items()}
    cfg = TrainingConfig(epochs=1, batch_size=10, lr=0.1, momentum=0.5)
    train_local(alg.model, x, y, cfg, 0.1, step_hook=alg.step_hook())
    assert _zeros_off_mask(alg)  # masked entries stayed 0 through momentum SGD
    assert set(alg._grad_sum) == set(alg.masked)  # the regrow score was collected
    facts = alg.after_train()
    assert facts["prune_fraction"] == pytest.approx(prune_fraction(1, 10, 0.5))
    assert facts["regrown"] > 0
    assert {k: int(m.sum()) for k, m in alg.masks.items()} == counts
    assert any(not torch.equal(before[k], alg.masks[k]) for k in alg.masks)
    assert _zeros_off_mask(alg) and not alg._grad_sum


def test_merge_averages_over_covering_masks_and_drops_a_bad_peer(make_alg):
    a, b = make_alg(0), make_alg(1)
    with torch.no_grad():  # make the two models differ
        for p in b.model.parameters():
            p.add_(1.0)
    b._apply_own_masks()
    own = {k: v.clone() for k, v in a.model.state_dict().items()}
    peer_wire = b.snapshot()
    bad_wire = dict(peer_wire)
    bad_wire["h.weight:values"] = bad_wire["h.weight:values"][:-1]
    gossip = {"b": {"n": 30}, "c": {"n": 30}}
    facts = a.merge(gossip, {"b": peer_wire, "c": bad_wire})
    assert facts["merged_from"] == ["b"] and "c" in facts["rejected"]
    assert 0 < facts["mask_overlap"] < 1
    new = a.model.state_dict()
    peer = b.model.state_dict()
    for k in a.masked:
        both = a.masks[k] & b.masks[k]
        only_a = a.masks[k] & ~b.masks[k]
        assert torch.allclose(new[k][both], (own[k][both] + peer[k][both]) / 2)
        assert torch.allclose(new[k][only_a], own[k][only_a])
        assert bool((new[k][~a.masks[k]] == 0).all())
    assert torch.allclose(new["h.bias"], (own["h.bias"] + peer["h.bias"]) / 2)


def test_choose_peers_draws_at_most_peers(make_alg):
    alg = make_alg(0, {"peers": 2})
    got = alg.choose_peers(["d", "c", "b", "a"])
    assert len(got) == 2 and set(got) <= {"a", "b", "c", "d"}
    assert make_alg(0, {"peers": None}).choose_peers(["b", "a"]) == ["a", "b"]
