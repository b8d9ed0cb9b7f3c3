"""The shared state helpers (p2pfl/learning/state.py; docs/algorithms.md, "Shared
aggregation"): the layout check and the one weighted mean of the methods."""

from __future__ import annotations

import pytest
import torch

from p2pfl.learning.state import layout_mismatch, weighted_mean

# ----------------------------------------------------------------------------- layout check


def test_layout_mismatch_names_the_first_difference():
    t = {"w": torch.zeros(2, 3), "n": torch.zeros((), dtype=torch.long)}
    assert (
        layout_mismatch({"w": torch.ones(2, 3), "n": torch.ones((), dtype=torch.long)}, t) is None
    )
    assert "keys differ" in layout_mismatch({"w": torch.ones(2, 3)}, t)
    extra = layout_mismatch({**t, "x": torch.zeros(1)}, t)
    assert "keys differ" in extra and "'x'" in extra
    shape = layout_mismatch({"w": torch.ones(3, 2), "n": t["n"]}, t)
    assert "'w'" in shape and "shape (3, 2), expected (2, 3)" in shape
    dtype = layout_mismatch({"w": torch.ones(2, 3, dtype=torch.float64), "n": t["n"]}, t)
    assert "'w'" in dtype and "dtype" in dtype
    assert "not a tensor" in layout_mismatch({"w": [[0.0] * 3] * 2, "n": t["n"]}, t)
    assert layout_mismatch([1, 2], t) == "not a map"  # type: ignore[arg-type]


def test_layout_mismatch_without_dtype_checks_keys_and_shapes_only():
    t = {"w": torch.zeros(2, 3)}
    assert layout_mismatch({"w": torch.zeros(2, 3, dtype=torch.float16)}, t, dtype=False) is None
    assert layout_mismatch({"w": torch.zeros(3, 2)}, t, dtype=False) is not None
    assert layout_mismatch({}, t, dtype=False) is not None


# ----------------------------------------------------------------------------- weighted mean


def _reference(states, weights, key):
    """The documented order: ``acc += (w_i / Σ w) · s_i`` in float64, in state order."""
    total = sum(float(w) for w in weights)
    acc = torch.zeros(states[0][key].shape, dtype=torch.float64)
    for w, s in zip(weights, states, strict=True):
        if w:
            acc += (float(w) / total) * s[key].to(torch.float64)
    return acc.to(states[0][key].dtype)


def test_weighted_mean_hand_values():
    a = {"w": torch.tensor([0.0, 2.0]), "steps": torch.tensor(5)}
    b = {"w": torch.tensor([4.0, 6.0]), "steps": torch.tensor(9)}
    out = weighted_mean([a, b], [1, 3])
    assert torch.equal(out["w"], torch.tensor([3.0, 5.0]))  # (0 + 3·4)/4, (2 + 3·6)/4
    assert out["w"].dtype == torch.float32
    assert int(out["steps"]) == 5  # non-floating: the first state's, whatever the weights
    assert out["steps"].dtype == a["steps"].dtype
    out = weighted_mean([a, b], [3, 1])
    assert torch.equal(out["w"], torch.tensor([1.0, 3.0]))
    assert int(out["steps"]) == 5
    assert int(weighted_mean([b, a], [2, 2])["steps"]) == 9  # the first, again


def test_weighted_mean_keeps_dtype_and_does_not_alias():
    a = {"w": torch.tensor([1.0, 2.0], dtype=torch.float16), "n": torch.tensor([3])}
    b = {"w": torch.tensor([2.0, 3.0], dtype=torch.float16), "n": torch.tensor([4])}
    out = weighted_mean([a, b], [1, 1])
    assert out["w"].dtype == torch.float16
    assert torch.equal(out["w"], torch.tensor([1.5, 2.5], dtype=torch.float16))
    single = weighted_mean([a], [7])
    assert torch.equal(single["w"], a["w"]) and single["w"] is not a["w"]
    assert torch.equal(single["n"], a["n"]) and single["n"].data_ptr() != a["n"].data_ptr()


def test_weighted_mean_accumulates_in_float64_in_the_documented_order():
    g = torch.Generator().manual_seed(0)
    for n in range(1, 7):
        states = [
            {
                "f32": torch.randn(5, 4, generator=g) * 1e3,
                "f64": torch.randn(7, generator=g, dtype=torch.float64),
                "f16": torch.randn(3, generator=g).half(),
                "i64": torch.randint(0, 100, (2,), generator=g),
            }
            for _ in range(n)
        ]
        for weights in ([1] * n, list(range(1, n + 1)), [0.3 + i * 1.7 for i in range(n)]):
            out = weighted_mean(states, weights)
            for key in ("f32", "f64", "f16"):
                assert out[key].dtype == states[0][key].dtype
                assert torch.equal(out[key], _reference(states, weights, key))
            assert torch.equal(out["i64"], states[0]["i64"])
    # float64 accumulation: a float32 running sum would lose the small terms
    big, small = {"w": torch.tensor([1.0])}, {"w": torch.tensor([3e-8])}
    out = weighted_mean([big] + [small] * 4, [1, 1, 1, 1, 1])
    assert out["w"].item() == torch.tensor([(1.0 + 4 * 3e-8) / 5]).item()


def test_weighted_mean_leaves_out_a_zero_weight():
    a = {"w": torch.tensor([1.0, 2.0])}
    bad = {"w": torch.tensor([float("nan"), float("inf")])}
    assert torch.equal(weighted_mean([a, bad], [2, 0])["w"], a["w"])


def test_weighted_mean_over_chosen_keys():
    a = {"g.w": torch.tensor([1.0]), "h.w": torch.tensor([10.0]), "x": torch.tensor([5.0])}
    b = {"g.w": torch.tensor([3.0]), "h.w": torch.tensor([30.0])}  # no "x": not averaged
    out = weighted_mean([a, b], [1, 1], ["h.w", "g.w"])
    assert list(out) == ["h.w", "g.w"]
    assert out["g.w"].item() == 2.0 and out["h.w"].item() == 20.0
    with pytest.raises(ValueError):
        weighted_mean([a, b], [1, 1], ["x"])  # a later state lacks a chosen key
    with pytest.raises(ValueError):
        weighted_mean([b, a], [1, 1], ["x"])  # so does the first
    with pytest.raises(ValueError):
        weighted_mean([a, b], [1, 1])  # all keys: the key sets must be equal


def test_weighted_mean_rejects_bad_input():
    a = {"w": torch.tensor([1.0, 2.0])}
    with pytest.raises(ValueError):
        weighted_mean([], [])
    with pytest.raises(ValueError):
        weighted_mean([a, {"v": torch.tensor([1.0, 2.0])}], [1, 1])  # keys
    with pytest.raises(ValueError):
        weighted_mean([a, {"w": torch.tensor([1.0, 2.0, 3.0])}], [1, 1])  # shapes
    with pytest.raises(ValueError):
        weighted_mean([a, {"w": torch.tensor([1.0, 2.0], dtype=torch.float64)}], [1, 1])
    with pytest.raises(ValueError):
        weighted_mean([a, a], [0, 0])  # total weight not positive
    with pytest.raises(ValueError):
        weighted_mean([a, a], [1, -1])
    with pytest.raises(ValueError):
        weighted_mean([a, a], [1])  # length mismatch
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError):
            weighted_mean([a, a], [1, bad])
    with pytest.raises(ValueError):
        weighted_mean([a, a], [1e308, 1e308])  # the sum overflows
    with pytest.raises(ValueError):
        weighted_mean([{"w": [1.0, 2.0]}, a], [1, 1])  # type: ignore[list-item]


# ----------------------------------------------------------------------------- with masks


def test_masked_mean_hand_values():
    own = {"w": torch.tensor([1.0, 2.0, 0.0]), "b": torch.tensor([1.0]), "n": torch.tensor(4)}
    peer = {"w": torch.tensor([3.0, 0.0, 0.0]), "b": torch.tensor([3.0]), "n": torch.tensor(9)}
    masks = [{"w": torch.tensor([True, True, False])}, {"w": torch.tensor([True, False, False])}]
    out = weighted_mean([own, peer], [1.0, 3.0], masks=masks)
    # element 0: (1·1 + 3·3) / 4; element 1: only the own holds it; element 2: nobody
    assert out["w"].tolist() == [2.5, 2.0, 0.0]
    assert out["b"].tolist() == [2.5]  # not in the first map: an all-ones mask
    assert int(out["n"]) == 4


def test_masked_mean_sums_then_divides():
    g = torch.Generator().manual_seed(1)
    states = [
        {"w": torch.randn(6, 5, generator=g), "b": torch.randn(5, generator=g)} for _ in "abc"
    ]
    masks = [{"w": torch.rand(6, 5, generator=g) < 0.5} for _ in "abc"]
    weights = [2.0, 1.0, 7.0]
    out = weighted_mean(states, weights, masks=masks)
    num = sum(
        w * m["w"].double() * s["w"].double()
        for w, s, m in zip(weights, states, masks, strict=True)
    )
    den = sum(w * m["w"].double() for w, m in zip(weights, masks, strict=True))
    want = torch.where(den > 0, num / den.clamp_min(1e-300), torch.zeros_like(num)).float()
    assert torch.equal(out["w"], want)
    dense = sum(w * s["b"].double() for w, s in zip(weights, states, strict=True)) / sum(weights)
    assert torch.equal(out["b"], dense.float())


def test_masked_mean_rejects_missing_or_misshaped_masks():
    s = {"w": torch.zeros(2)}
    with pytest.raises(ValueError):
        weighted_mean([s, s], [1, 1], masks=[{"w": torch.ones(2, dtype=torch.bool)}])
    with pytest.raises(ValueError):
        weighted_mean([s, s], [1, 1], masks=[{"w": torch.ones(2, dtype=torch.bool)}, {}])
    with pytest.raises(ValueError):
        weighted_mean(
            [s, s], [1, 1], masks=[{"w": torch.ones(2, dtype=torch.bool)}, {"w": torch.ones(3)}]
        )
