"""The robust aggregation maths (p2pfl/learning/robust.py): hand-computed cases for every
function, the bounds, dtype/counter/storage conventions, non-finite inputs, determinism,
and a comparison with Flower's reference implementations."""

from __future__ import annotations

import math

import pytest
import torch

from p2pfl.learning import robust
from p2pfl.learning.state import weighted_mean


def _scalars(values, dtype=torch.float64):
    """One state per value: ``{"w": tensor([v])}``."""
    return [{"w": torch.tensor([float(v)], dtype=dtype)} for v in values]


def _with_counter(states, counts):
    return [
        {**s, "n": torch.tensor(c, dtype=torch.long)} for s, c in zip(states, counts, strict=True)
    ]


# ----------------------------------------------------------------------------- norm, distances


def test_norm_is_the_l2_norm_of_the_floating_tensors():
    s = {
        "a": torch.tensor([3.0, 0.0]),
        "n": torch.tensor(1000, dtype=torch.long),  # skipped: not floating
        "b": torch.tensor([[4.0]], dtype=torch.float16),
    }
    assert robust.norm(s) == 5.0
    assert robust.norm(s, ["a"]) == 3.0
    assert robust.norm(s, ["n"]) == 0.0
    assert robust.norm({"a": torch.tensor([1.0, math.nan])}) == math.inf
    assert robust.norm({"a": torch.tensor([1.0, -math.inf])}) == math.inf
    with pytest.raises(ValueError, match="lacks"):
        robust.norm(s, ["zz"])


def test_distances_from_a_reference():
    ref = {"w": torch.tensor([0.0, 0.0]), "n": torch.tensor(7)}
    states = [
        {"w": torch.tensor([3.0, 4.0]), "n": torch.tensor(1)},
        {
            "w": torch.tensor([1.0, 0.0], dtype=torch.float64),
            "n": torch.tensor(1),
        },  # dtype may differ
        {"w": torch.tensor([math.nan, 0.0]), "n": torch.tensor(1)},
        {"w": torch.tensor([math.inf, 0.0]), "n": torch.tensor(1)},
        {"w": torch.tensor([-math.inf, math.inf]), "n": torch.tensor(1)},
    ]
    assert robust.distances(ref, states) == [5.0, 1.0, math.inf, math.inf, math.inf]
    assert robust.distances(ref, []) == []
    nan_ref = {"w": torch.tensor([math.nan, 0.0])}
    assert robust.distances(nan_ref, states[:2]) == [math.inf, math.inf]  # inf, never nan
    with pytest.raises(ValueError, match="state 1"):
        robust.distances(ref, [states[0], {"w": torch.zeros(3)}])
    with pytest.raises(ValueError, match="state 0"):
        robust.distances(ref, [{"v": torch.zeros(2)}])


def test_clip_bound_follows_balance_schedule():
    assert robust.clip_bound(0.5, 0.5, 0, 10) == 0.5
    assert robust.clip_bound(0.5, 0.5, 10, 10) == pytest.approx(0.5 * math.exp(-0.5), rel=1e-15)
    assert robust.clip_bound(2.0, 1.0, 5, 10) == pytest.approx(2.0 * math.exp(-0.5), rel=1e-15)
    assert robust.clip_bound(0.3, 0.0, 7, 10) == 0.3
    with pytest.raises(ValueError, match="rounds"):
        robust.clip_bound(0.5, 0.5, 1, 0)


# ----------------------------------------------------------------------------- median, trimmed mean


def test_median_odd_and_even():
    assert robust.coordinate_median(_scalars([1, 5, 2]))["w"].tolist() == [2.0]
    assert robust.coordinate_median(_scalars([1, 5, 2, 10]))["w"].tolist() == [3.5]  # (2 + 5) / 2
    states = [
        {"w": torch.tensor([[1.0, -4.0], [0.0, 9.0]])},
        {"w": torch.tensor([[3.0, 2.0], [0.5, -1.0]])},
        {"w": torch.tensor([[2.0, 0.0], [7.0, 8.0]])},
        {"w": torch.tensor([[100.0, 1.0], [-3.0, 2.0]])},
    ]
    assert robust.coordinate_median(states)["w"].tolist() == [[2.5, 0.5], [0.25, 5.0]]
    assert robust.coordinate_median(states[:3])["w"].tolist() == [[2.0, 0.0], [0.5, 8.0]]
    assert robust.coordinate_median(states[:1])["w"].tolist() == [[1.0, -4.0], [0.0, 9.0]]


def test_median_treats_nan_as_the_largest_value():
    out = robust.coordinate_median(_scalars([1, math.nan, 2]))
    assert out["w"].tolist() == [2.0]


def test_trimmed_mean_trims_outliers():
    states = _scalars([3, -100, 1, 2, 1000, 4, 5])  # n = 7
    # beta 0.2: k = floor(1.4) = 1 -> mean(1, 2, 3, 4, 5) = 3
    assert robust.trimmed_mean(states, 0.2)["w"].tolist() == [3.0]
    # beta 0.3: k = floor(2.1) = 2 -> mean(2, 3, 4) = 3
    assert robust.trimmed_mean(states, 0.3)["w"].tolist() == [3.0]
    # beta 0.1: k = 0 -> the plain mean, outliers included: 915 / 7
    assert robust.trimmed_mean(states, 0.1)["w"].item() == pytest.approx(915 / 7, rel=1e-15)
    # n = 3, beta = 0.5: k = 1 -> the median
    assert robust.trimmed_mean(_scalars([9, 1, 4]), 0.5)["w"].tolist() == [4.0]


def test_trimmed_mean_with_beta_zero_is_the_plain_mean():
    g = torch.Generator().manual_seed(3)
    states = [{"w": torch.randn(4, 5, generator=g, dtype=torch.float64)} for _ in range(6)]
    plain = weighted_mean(states, [1.0] * 6)
    torch.testing.assert_close(
        robust.trimmed_mean(states, 0.0)["w"], plain["w"], rtol=1e-15, atol=1e-15
    )
    exact = _scalars([1, 2, 4, 8, 16])
    assert robust.trimmed_mean(exact, 0.0)["w"].tolist() == [31 / 5]
    assert (
        robust.trimmed_mean(exact, 0.0)["w"].tolist() == weighted_mean(exact, [1] * 5)["w"].tolist()
    )


def test_trimmed_mean_rejects_a_cut_that_leaves_nothing():
    with pytest.raises(ValueError, match="leaves none"):
        robust.trimmed_mean(_scalars([1, 2]), 0.5)  # k = 1, 2k = n
    with pytest.raises(ValueError, match="leaves none"):
        robust.trimmed_mean(_scalars([1, 2, 3, 4]), 0.5)
    with pytest.raises(ValueError, match="beta"):
        robust.trimmed_mean(_scalars([1, 2, 3]), -0.1)
    with pytest.raises(ValueError, match="beta"):
        robust.trimmed_mean(_scalars([1, 2, 3]), math.nan)


# ----------------------------------------------------------------------------- Krum, Multi-Krum


def test_krum_scores_use_the_n_minus_f_minus_2_nearest():
    # n = 5, f = 1: each score sums the squared distances to the 2 nearest others.
    states = _scalars([0, 1, 2, 10, 10])
    scores = robust.krum_scores(states, 1)
    # 0: 1² + 2² = 5; 1: 1² + 1² = 2; 2: 1² + 2² = 5; 10: 0² + 8² = 64 (twice)
    assert scores == [5.0, 2.0, 5.0, 64.0, 64.0]
    assert robust.multikrum_select(states, 1, 1) == [1]
    # Summing over *all* others (Nebula's and the old p2pfl's Krum) would elect state 2:
    # 0: 1+4+100+100 = 205; 1: 1+1+81+81 = 164; 2: 4+1+64+64 = 133; 10: 100+81+64+0 = 245.
    values = [0.0, 1.0, 2.0, 10.0, 10.0]
    all_sum = [sum((a - b) ** 2 for b in values) for a in values]
    assert all_sum == [205.0, 164.0, 133.0, 245.0, 245.0]
    assert min(range(5), key=all_sum.__getitem__) == 2


def test_krum_scores_in_two_dimensions_over_every_floating_key():
    # Points (x, y) split over two keys, plus a counter that must not count.
    pts = [(0.0, 0.0), (1.0, 0.0), (0.0, 2.0), (3.0, 4.0)]
    states = [
        {"x": torch.tensor([x]), "n": torch.tensor(i * 1000), "y": torch.tensor([[y]])}
        for i, (x, y) in enumerate(pts)
    ]
    # n = 4, f = 1: the single nearest other, squared
    # (0,0): 1; (1,0): 1; (0,2): min(4, 5, 13) = 4; (3,4): min(25, 20, 13) = 13
    assert robust.krum_scores(states, 1) == [1.0, 1.0, 4.0, 13.0]
    assert robust.krum_scores(states, 1, ["x"]) == [0.0, 1.0, 0.0, 4.0]  # x only: 0,1,0,3


def test_krum_needs_enough_states():
    with pytest.raises(ValueError, match=r"n = 4, f = 2"):
        robust.krum_scores(_scalars([0, 1, 2, 3]), 2)
    with pytest.raises(ValueError, match="f >= 0"):
        robust.krum_scores(_scalars([0, 1, 2, 3]), -1)
    assert len(robust.krum_scores(_scalars([0, 1, 2]), 0)) == 3


def test_multikrum_orders_best_first_and_breaks_ties_by_index():
    states = _scalars([-1, 1, 0, 5, -5])  # f = 1: 2 nearest
    # -1: 1 + 4 = 5; 1: 1 + 4 = 5; 0: 1 + 1 = 2; 5: 16 + 25 = 41; -5: 16 + 25 = 41
    assert robust.krum_scores(states, 1) == [5.0, 5.0, 2.0, 41.0, 41.0]
    assert robust.multikrum_select(states, 1, 5) == [2, 0, 1, 3, 4]
    assert robust.multikrum_select(states, 1, 3) == [2, 0, 1]
    assert robust.multikrum_select(states, 1, 1) == [2]
    for m in (0, 6):
        with pytest.raises(ValueError, match="1 <= m <= n"):
            robust.multikrum_select(states, 1, m)


def test_multikrum_ranks_non_finite_states_last():
    states = _scalars([math.nan, 0, 1, 2, math.inf, 3])
    scores = robust.krum_scores(states, 1)
    assert scores[0] == math.inf and scores[4] == math.inf
    assert all(math.isfinite(s) for i, s in enumerate(scores) if i not in (0, 4))
    assert robust.multikrum_select(states, 1, 6)[-2:] == [0, 4]


# ----------------------------------------------------------------------------- Bulyan


def test_bulyan_rejects_an_outlier():
    # n = 7, f = 1: theta = 5 selected, then the beta = 3 values closest to their median.
    # Krum rounds (nearest = max(1, r - 3)): r=7 -> 2 (tie with 3); r=6 -> 3; r=5 -> 1
    # (tie with 4); r=4 -> 4 (tie with 5); r=3 -> 0 (tie with 5). Selected 0..4, median 2,
    # closest 3: {2, 1, 3} -> 2.
    states = _with_counter(_scalars([0, 1, 2, 3, 4, 5, 100]), [7, 1, 2, 3, 4, 5, 6])
    out, selected = robust.bulyan(states, 1)
    assert selected == [0, 1, 2, 3, 4]
    assert out["w"].tolist() == [2.0]
    assert out["n"].item() == 7  # the first state's counter


def test_bulyan_with_f_zero_selects_everything():
    # theta = n, beta = n: the last Krum round has a lone state (score 0); the plain mean
    out, selected = robust.bulyan(_scalars([0, 1, 5]), 0)
    assert selected == [0, 1, 2]
    assert out["w"].tolist() == [2.0]


def test_bulyan_bounds():
    with pytest.raises(ValueError, match=r"n >= 4f \+ 3 \(n = 6, f = 1\)"):
        robust.bulyan(_scalars(range(6)), 1)
    with pytest.raises(ValueError, match=r"n = 10, f = 2"):
        robust.bulyan(_scalars(range(10)), 2)
    with pytest.raises(ValueError, match="f >= 0"):
        robust.bulyan(_scalars(range(7)), -1)
    out, selected = robust.bulyan(_scalars(range(11)), 2)  # n = 4f + 3: accepted
    assert len(selected) == 11 - 2 * 2 and selected == sorted(selected)


# ----------------------------------------------------------------------------- bounds


def test_check_bounds_messages_name_rule_n_and_f():
    robust.check_bounds("multikrum", 5, 1, None, 0.1)
    robust.check_bounds("multikrum", 5, 1, 5, 0.1)
    robust.check_bounds("bulyan", 7, 1, None, 0.1)
    robust.check_bounds("trimmed_mean", 3, 1, None, 0.4)
    for rule in ("mean", "clip", "median"):
        robust.check_bounds(rule, 1, 3, None, 0.1)
        with pytest.raises(ValueError) as e:
            robust.check_bounds(rule, 0, 1, None, 0.1)
        assert str(e.value) == f"defence.rule {rule} needs n >= 1 inputs (n = 0, f = 1)"
    with pytest.raises(ValueError) as e:
        robust.check_bounds("multikrum", 4, 1, None, 0.1)
    assert str(e.value) == "defence.rule multikrum needs n >= 2f + 3 inputs (n = 4, f = 1)"
    with pytest.raises(ValueError) as e:
        robust.check_bounds("multikrum", 5, 1, 6, 0.1)
    assert str(e.value) == "defence.rule multikrum needs 1 <= m <= n (n = 5, f = 1, m = 6)"
    with pytest.raises(ValueError) as e:
        robust.check_bounds("bulyan", 6, 1, None, 0.1)
    assert str(e.value) == "defence.rule bulyan needs n >= 4f + 3 inputs (n = 6, f = 1)"
    with pytest.raises(ValueError) as e:
        robust.check_bounds("trimmed_mean", 2, 0, None, 0.5)
    assert "trimmed_mean" in str(e.value) and "(n = 2, f = 0, beta = 0.5)" in str(e.value)
    with pytest.raises(ValueError, match=r"defence.rule trimmed_mean needs beta >= 0"):
        robust.check_bounds("trimmed_mean", 5, 0, None, -0.1)
    with pytest.raises(ValueError, match=r"defence.rule multikrum needs f >= 0 \(n = 5, f = -1\)"):
        robust.check_bounds("multikrum", 5, -1, None, 0.1)
    with pytest.raises(ValueError, match="'krum' is unknown"):
        robust.check_bounds("krum", 5, 1, None, 0.1)


# ----------------------------------------------------------------------------- conventions


def _combiners():
    return [
        ("median", lambda s: robust.coordinate_median(s)),
        ("trimmed_mean", lambda s: robust.trimmed_mean(s, 0.2)),
        ("bulyan", lambda s: robust.bulyan(s, 1)[0]),
    ]


@pytest.mark.parametrize("name,combine", _combiners())
def test_counters_come_from_the_first_state_and_storage_is_fresh(name, combine):
    g = torch.Generator().manual_seed(1)
    states = [
        {
            "w": torch.randn(3, 2, generator=g),
            "n": torch.tensor(10 + i, dtype=torch.long),
            "b": torch.randn(4, generator=g, dtype=torch.float64),
        }
        for i in range(7)
    ]
    out = combine(states)
    assert list(out) == ["w", "n", "b"]
    assert out["n"].item() == 10 and out["n"].dtype == torch.long
    for k in out:
        for s in states:
            assert out[k].untyped_storage().data_ptr() != s[k].untyped_storage().data_ptr()
    # a single-element float64 key must not be a view of a larger working buffer either
    assert out["b"].untyped_storage().nbytes() == 4 * 8


@pytest.mark.parametrize("name,combine", _combiners())
def test_dtype_is_preserved(name, combine):
    for dtype in (torch.float16, torch.float32, torch.bfloat16, torch.float64):
        states = _scalars([1, 2, 3, 4, 5, 6, 100], dtype)
        out = combine(states)
        assert out["w"].dtype == dtype
        expected = {"median": 4.0, "trimmed_mean": 4.0, "bulyan": 3.0}[name]
        assert out["w"].tolist() == [expected]


def test_half_precision_maths_is_done_in_float64():
    # float16 holds 2048 and 2049 is not representable: the float64 mean of the two middle
    # values (2048 + 2050) / 2 = 2049 rounds to 2048 (ties to even), not to inf / garbage.
    out = robust.coordinate_median(_scalars([2048, 2050, 60000, 1], torch.float16))
    assert out["w"].tolist() == [2048.0]
    f32 = _scalars([0.1, 0.2, 0.7, 0.3, 50.0], torch.float32)
    expected = (
        sum(float(torch.tensor(v, dtype=torch.float32)) for v in (0.2, 0.3, 0.7)) / 3
    )  # float64 maths on the float32 inputs, cast back once
    assert (
        robust.trimmed_mean(f32, 0.2)["w"].item() == torch.tensor(expected).to(torch.float32).item()
    )


@pytest.mark.parametrize(
    "call",
    [
        lambda s: robust.coordinate_median(s),
        lambda s: robust.trimmed_mean(s, 0.1),
        lambda s: robust.krum_scores(s, 0),
        lambda s: robust.bulyan(s, 0),
    ],
)
def test_layout_mismatches_are_value_errors(call):
    good = [{"w": torch.zeros(2)} for _ in range(3)]
    with pytest.raises(ValueError, match="state 2"):
        call(good[:2] + [{"w": torch.zeros(3)}])
    with pytest.raises(ValueError, match="state 1"):
        call([good[0], {"w": torch.zeros(2, dtype=torch.float64)}, good[2]])
    with pytest.raises(ValueError, match="state 1"):
        call([good[0], {"v": torch.zeros(2)}, good[2]])
    with pytest.raises(ValueError, match="at least one"):
        call([])


def test_keys_select_what_is_combined():
    states = [{"a": torch.tensor([float(i)]), "b": torch.tensor([10.0 * i])} for i in range(3)]
    assert list(robust.coordinate_median(states, ["b"])) == ["b"]
    assert robust.coordinate_median(states, ["b"])["b"].tolist() == [10.0]
    # extra keys in later states are ignored when keys are given
    extra = [states[0], {**states[1], "z": torch.zeros(1)}, states[2]]
    assert robust.trimmed_mean(extra, 0.0, ["a"])["a"].tolist() == [1.0]


# ----------------------------------------------------------------------------- determinism


def test_row_sums_reduce_in_blocks(monkeypatch):
    monkeypatch.setattr(robust, "_BLOCK", 4)
    x = torch.arange(1.0, 103.0, dtype=torch.float64).reshape(2, 51)  # 51 -> 13 -> 4 partials
    assert robust._row_sums(x).tolist() == [sum(range(1, 52)), sum(range(52, 103))]
    assert robust._row_sums(torch.zeros(3, 0, dtype=torch.float64)).tolist() == [0.0] * 3


def test_same_input_twice_is_bit_identical_whatever_the_thread_count():
    g = torch.Generator().manual_seed(7)
    states = [
        {"g.w": torch.randn(300, 701, generator=g), "h.b": torch.randn(13, generator=g)}
        for _ in range(9)
    ]
    threads = torch.get_num_threads()

    def run():
        return (
            robust.norm(states[0]),
            robust.distances(states[0], states),
            robust.krum_scores(states, 2),
            robust.multikrum_select(states, 2, 9),
            robust.coordinate_median(states),
            robust.trimmed_mean(states, 0.25),
            robust.bulyan(states, 1),
        )

    try:
        torch.set_num_threads(1)
        a = run()
        torch.set_num_threads(16)
        b = run()
        torch.set_num_threads(3)
        c = run()
    finally:
        torch.set_num_threads(threads)
    for x in (b, c):
        assert a[0].hex() == x[0].hex()
        assert [v.hex() for v in a[1]] == [v.hex() for v in x[1]]
        assert [v.hex() for v in a[2]] == [v.hex() for v in x[2]]
        assert a[3] == x[3] and a[6][1] == x[6][1]
        for sa, sx in ((a[4], x[4]), (a[5], x[5]), (a[6][0], x[6][0])):
            for k in sa:
                assert torch.equal(sa[k], sx[k])
    assert a[1][0] == 0.0
    # the sums agree with an exactly rounded reference to float64 accuracy
    flat = torch.cat([states[0]["g.w"].reshape(-1), states[0]["h.b"]]).double()
    assert a[0] == pytest.approx(math.sqrt(math.fsum((flat * flat).tolist())), rel=1e-13)


def test_pairwise_distances_are_symmetric_and_exact_on_integers():
    states = [{"w": torch.tensor([float(i), float(i * i)])} for i in range(5)]
    x = robust._matrix(states, ["w"], torch.device("cpu"))
    d = robust._pairwise_sq(x)
    for i in range(5):
        assert d[i][i] == 0.0
        for j in range(5):
            assert d[i][j] == d[j][i] == (i - j) ** 2 + (i * i - j * j) ** 2


# ----------------------------------------------------------------------------- Flower reference

# Expected outputs produced by Flower 1.42.0 (flwr/server/strategy/aggregate.py, numpy 2.4.6),
# run in a separate venv on these exact inputs: 7 clients, each with two float64 layers
# "a" = FL_A[i] (shape (2, 2)) and "b" = FL_B[i] (shape (3,)), num_examples = 10, 20, ..., 70
# (ignored by every function below but aggregate_krum's Multi-Krum mean). Client 6 is an
# outlier. Calls: aggregate_median(results), aggregate_trimmed_avg(results, p),
# aggregate_krum(results, f, to_keep), aggregate_bulyan(results, f, aggregate_krum,
# to_keep=0); "first 6" means results[:6]. Krum winners and Multi-Krum/Bulyan selections
# were read back by matching the returned arrays against the inputs.
FL_A = [
    [[0.1, -0.4], [1.2, 0.3]],
    [[0.2, -0.5], [1.0, 0.35]],
    [[0.15, -0.3], [1.1, 0.2]],
    [[0.05, -0.45], [1.3, 0.25]],
    [[0.25, -0.35], [0.9, 0.4]],
    [[0.12, -0.42], [1.15, 0.28]],
    [[9.0, 8.0], [-7.0, 6.0]],
]
FL_B = [
    [0.5, 0.6, -0.1],
    [0.55, 0.4, 0.0],
    [0.45, 0.5, -0.2],
    [0.6, 0.65, -0.05],
    [0.4, 0.55, 0.1],
    [0.52, 0.58, -0.12],
    [-5.0, 5.0, 5.0],
]
FL_MEDIAN_7 = ([[0.15, -0.4], [1.1, 0.3]], [0.5, 0.58, -0.05])
FL_MEDIAN_6 = (
    [[0.135, -0.41000000000000003], [1.125, 0.29000000000000004]],
    [0.51, 0.565, -0.07500000000000001],
)
FL_TRIMMED = {
    # (clients, proportiontocut): output
    (7, 0.2): ([[0.164, -0.384], [1.07, 0.316]], [0.484, 0.576, -0.034]),
    (7, 0.3): (
        [[0.15666666666666668, -0.38999999999999996], [1.0833333333333333, 0.31]],
        [0.49, 0.5766666666666667, -0.05000000000000001],
    ),
    (6, 0.34): (
        [[0.135, -0.41000000000000003], [1.125, 0.29000000000000004]],
        [0.51, 0.565, -0.07500000000000001],
    ),
}
FL_KRUM_WINNER = {1: 5, 2: 5, 3: 0}  # aggregate_krum(results, f, 0) returned client i
FL_MULTIKRUM = {
    # (f, to_keep): (clients averaged, the returned sample-weighted mean)
    (1, 3): (
        [0, 2, 5],
        ([[0.127, -0.382], [1.14, 0.258]], [0.49700000000000005, 0.5579999999999999, -0.142]),
    ),
    (2, 2): (
        [0, 5],
        (
            [
                [0.11714285714285713, -0.41714285714285715],
                [1.1571428571428573, 0.28285714285714286],
            ],
            [0.5171428571428572, 0.5828571428571429, -0.11714285714285713],
        ),
    ),
    (1, 5): ([0, 1, 2, 3, 5], None),
}
FL_BULYAN = {
    # f: (clients selected, output)
    1: (
        [0, 1, 2, 3, 5],
        (
            [
                [0.12333333333333334, -0.42333333333333334],
                [1.1500000000000001, 0.27666666666666667],
            ],
            [0.5233333333333333, 0.61, -0.09000000000000001],
        ),
    ),
    0: (
        [0, 1, 2, 3, 4, 5, 6],
        (
            [[1.4100000000000001, 0.7971428571428572], [-0.04999999999999995, 1.1114285714285714]],
            [-0.28285714285714286, 1.1828571428571428, 0.6614285714285714],
        ),
    ),
}
FL_SAMPLES = [10, 20, 30, 40, 50, 60, 70]


def _fl_states(count=7):
    return [
        {
            "a": torch.tensor(FL_A[i], dtype=torch.float64),
            "n": torch.tensor(i, dtype=torch.long),
            "b": torch.tensor(FL_B[i], dtype=torch.float64),
        }
        for i in range(count)
    ]


def _assert_matches(out, expected):
    a, b = expected
    tol = {"rtol": 1e-12, "atol": 1e-15}
    torch.testing.assert_close(out["a"], torch.tensor(a, dtype=torch.float64), **tol)
    torch.testing.assert_close(out["b"], torch.tensor(b, dtype=torch.float64), **tol)


def test_matches_flower_median():
    _assert_matches(robust.coordinate_median(_fl_states(7)), FL_MEDIAN_7)
    _assert_matches(robust.coordinate_median(_fl_states(6)), FL_MEDIAN_6)


@pytest.mark.parametrize("count,beta", list(FL_TRIMMED))
def test_matches_flower_trimmed_avg(count, beta):
    _assert_matches(robust.trimmed_mean(_fl_states(count), beta), FL_TRIMMED[(count, beta)])


@pytest.mark.parametrize("f", list(FL_KRUM_WINNER))
def test_matches_flower_krum(f):
    assert robust.multikrum_select(_fl_states(), f, 1) == [FL_KRUM_WINNER[f]]
    assert robust.krum_scores(_fl_states(), f)[6] > 100  # the outlier scores worst


@pytest.mark.parametrize("f,m", list(FL_MULTIKRUM))
def test_matches_flower_multikrum(f, m):
    chosen, mean = FL_MULTIKRUM[(f, m)]
    states = _fl_states()
    picked = robust.multikrum_select(states, f, m)
    assert sorted(picked) == chosen
    if mean is not None:
        out = weighted_mean([states[i] for i in chosen], [FL_SAMPLES[i] for i in chosen])
        _assert_matches(out, mean)


@pytest.mark.parametrize("f", list(FL_BULYAN))
def test_matches_flower_bulyan(f):
    chosen, expected = FL_BULYAN[f]
    out, selected = robust.bulyan(_fl_states(), f)
    assert selected == chosen
    _assert_matches(out, expected)
    assert out["n"].item() == 0


def test_median_radius_takes_the_lower_median_and_skips_non_finite():
    assert robust.median_radius([3.0, 10.0], 2.0, 1) == 6.0  # lower median of two: 3
    assert robust.median_radius([3.0, math.inf, 4.0, 5.0], 2.0, 1) == 8.0
    assert robust.median_radius([3.0], 0.0, 1) == 0.0 and robust.median_radius([], 2, 1) is None


def test_median_radius_needs_enough_finite_distances():
    assert robust.median_radius([3.0, 10.0, 4.0], 2.0, 3) == 8.0
    assert robust.median_radius([3.0, 10.0, math.inf], 2.0, 3) is None
    assert robust.median_radius([1.0, 2.0, 3.0, 100.0], 2.0, 3) == 4.0  # lower median


def test_centered_clip_moves_a_far_state_onto_the_radius_in_float64():
    ref = {"w": torch.tensor([0.0, 0.0], dtype=torch.float16), "n": torch.tensor(1)}
    far = {"w": torch.tensor([3.0, 4.0], dtype=torch.float16), "n": torch.tensor(7)}
    out = robust.centered_clip(ref, far, 5.0, 1.0, ["w", "n"])
    assert out["w"].dtype == torch.float16 and torch.allclose(
        out["w"].float(), torch.tensor([0.6, 0.8]), atol=1e-3
    )
    assert int(out["n"]) == 7 and robust.centered_clip(ref, far, 5.0, 5.0, ["w"]) is far
    with pytest.raises(ValueError, match="finite"):
        robust.centered_clip(ref, far, math.inf, 1.0, ["w"])
