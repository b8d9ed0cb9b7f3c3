"""FedSA's server rule (p2pfl/algorithms/fedsa.py) on small hand-checked tensors."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from p2pfl.algorithms import get_algorithm, validate_params
from p2pfl.algorithms.base import Upload
from p2pfl.algorithms.fedsa import (
    FedSA,
    FedSAParams,
    client_similarity,
    dispersion_split,
    fedsa_aggregate_states,
    fedsa_tensor,
    mac_alpha,
    mac_clusters,
    mic_categories,
)

D = torch.float64


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=D)


# ----------------------------------------------------------------- (1) full agreement


@pytest.mark.parametrize(
    "row",
    [
        [0.1, -0.3, 1e-7, 123.456, -2.5e-3],
        [0.0, 0.0, 0.0, 0.0, 0.0],
    ],
)
def test_agreeing_clients_give_their_common_value_bit_exact(row):
    value = torch.tensor(row, dtype=torch.float32)
    states = [{"w": value.clone().reshape(5, 1)} for _ in range(3)]
    out = fedsa_aggregate_states(states, [1, 7, 2], FedSAParams(weighted=True))
    assert out["w"].dtype == torch.float32
    assert out["w"].shape == (5, 1)
    assert torch.equal(out["w"], value.reshape(5, 1))


def test_zero_mean_and_no_spread_gives_cv_zero_not_nan():
    w = torch.zeros(4, 3, dtype=D)
    mu, high = dispersion_split(w, 0.2, 1e-12)
    assert torch.equal(mu, torch.zeros(3, dtype=D))
    assert not bool(high.any())
    out = fedsa_tensor(w)
    assert torch.equal(out, torch.zeros(3, dtype=D))


# ----------------------------------------------- (2) agreeing positions inside a skewed tensor


def test_agreeing_positions_keep_their_value_while_others_are_high():
    g = torch.Generator().manual_seed(1)
    k, m = 6, 40
    w = torch.randn(k, m, generator=g, dtype=torch.float32)
    agree = torch.arange(m) % 4 == 0
    w[:, agree] = torch.tensor(0.3, dtype=torch.float32)
    w[:, 1] = 0.0  # an agreeing position with μ = 0
    agree[1] = True
    mu, high = dispersion_split(w.double(), 0.2, 1e-12)
    assert bool(high.any())
    assert not bool(high[agree].any())
    out = fedsa_aggregate_states([{"w": w[i]} for i in range(k)], [1] * k, FedSAParams())["w"]
    assert torch.equal(out[agree], w[0, agree])
    assert bool(torch.isfinite(out).all())


# ----------------------------------------------------------------------- (3) the CV split


def test_cv_split_by_hand():
    w = t(
        [
            [1, 2, 0, 1],
            [1, 4, 0, 3],
            [1, 6, 0, -1],
        ]
    )
    # col 0: μ=1, every deviation 0                 -> cv = 0
    # col 1: μ=4, s = 4,0,4, sqrt(8/3) = 1.63299    -> cv = 1.63299/4 = 0.40825
    # col 2: μ=0, every deviation 0 (guarded |μ|)   -> cv = 0
    # col 3: μ=1, s = 0,4,4                         -> cv = 1.63299/1 = 1.63299
    # normalised (min 0, max 1.63299): 0, 0.25, 0, 1
    mu, high = dispersion_split(w, 0.2, 1e-12)
    assert torch.allclose(mu, t([1, 4, 0, 1]))
    assert high.tolist() == [False, True, False, True]
    _, high = dispersion_split(w, 0.3, 1e-12)  # 0.25 ≤ 0.3: col 1 now low
    assert high.tolist() == [False, False, False, True]
    _, high = dispersion_split(w, 0.25, 1e-12)  # strict ">" (eq. 5): 0.25 is low
    assert high.tolist() == [False, False, False, True]


def test_equal_cv_everywhere_means_no_high_positions():
    # col 0: μ=2, std=1, cv=0.5; col 1: μ=4, std=2, cv=0.5 -> range 0 -> all low
    w = t([[1, 2], [3, 6]])
    _, high = dispersion_split(w, 0.2, 1e-12)
    assert not bool(high.any())


# ------------------------------------------------------------------------ (4) MIC binning


def test_mic_categories_by_hand():
    w = t(
        [
            [0, 2, 5],
            [2, 4, 5],
            [3, 6, 5],
            [7, 0, 5],
        ]
    )
    # col 0: μ=3, s = 9,1,0,16 -> per-position min-max: 9/16, 1/16, 0, 1
    #        C=4: ceil(2.25)=3, ceil(0.25)=1, 0 -> 1, 4
    # col 1: μ=3, s = 1,1,9,9 -> 0,0,1,1 -> 1,1,4,4 ; but col 1 is masked out here -> 0
    # col 2: every client agrees (range 0) -> category 1 for all
    mu = w.mean(dim=0)
    high = torch.tensor([True, False, True])
    mic = mic_categories(w, mu, high, 4, 1e-12)
    assert mic.dtype == torch.long
    assert mic.tolist() == [[3, 0, 1], [1, 0, 1], [1, 0, 1], [4, 0, 1]]
    # C=2: 0.5625 -> 2, 0.0625 -> 1, 0 -> 1, 1 -> 2 ; col 1: 1,1,2,2
    mic2 = mic_categories(w, mu, torch.ones(3, dtype=torch.bool), 2, 1e-12)
    assert mic2[:, 0].tolist() == [2, 1, 1, 2]
    assert mic2[:, 1].tolist() == [1, 1, 2, 2]
    # C=1: every client in the single category
    mic1 = mic_categories(w, mu, torch.ones(3, dtype=torch.bool), 1, 1e-12)
    assert bool((mic1 == 1).all())


def test_mic_two_clients_are_always_one_category():
    # K = 2: both deviate by the same |w − μ| -> equal s -> flat -> category 1
    w = t([[0.1, -3.0], [0.7, 5.0]])
    mic = mic_categories(w, w.mean(dim=0), torch.ones(2, dtype=torch.bool), 4, 1e-12)
    assert bool((mic == 1).all())


# -------------------------------------------------------------- (5) similarity, clustering

# 5 clients, 4 high positions (+ one masked-out column that must not count)
MIC5 = torch.tensor(
    [
        [1, 1, 2, 2, 0],  # a
        [1, 1, 2, 3, 0],  # b: one mismatch with a        -> SIM 0.75
        [3, 4, 1, 1, 0],  # c
        [3, 4, 1, 2, 0],  # d: one mismatch with c -> 0.75; matches a at pos 3 -> 0.25
        [2, 3, 3, 4, 0],  # e: mismatches everyone everywhere -> 0
    ]
)
HIGH5 = torch.tensor([True, True, True, True, False])
SIM4 = [
    [1.0, 0.75, 0.0, 0.25],
    [0.75, 1.0, 0.0, 0.0],
    [0.0, 0.0, 1.0, 0.75],
    [0.25, 0.0, 0.75, 1.0],
]


def test_similarity_by_hand():
    sim = client_similarity(MIC5, HIGH5)
    assert sim.shape == (5, 5)
    assert torch.allclose(sim[:4, :4], t(SIM4))
    assert torch.allclose(sim[4, :4], torch.zeros(4, dtype=D))
    assert torch.allclose(sim.diagonal(), torch.ones(5, dtype=D))
    # no high positions: everyone fully similar
    assert torch.equal(
        client_similarity(MIC5, torch.zeros(5, dtype=torch.bool)), torch.ones(5, 5, dtype=D)
    )


def test_two_obvious_pairs_make_two_clusters():
    assert mac_clusters(t(SIM4), 4, 0.2) == [[0, 1], [2, 3]]


def test_dissimilar_client_stays_unclustered():
    sim = client_similarity(MIC5, HIGH5)
    # e's best option is 0 (joining either pair) < 0.2 -> unclustered
    assert mac_clusters(sim, 4, 0.2) == [[0, 1], [2, 3]]
    # with sim_t = 0 it joins the first cluster on the tie
    assert mac_clusters(sim, 4, 0.0) == [[0, 1, 4], [2, 3]]


def test_cluster_cap_and_mean_cluster_similarity():
    sim = t(SIM4)
    # S = 1: {a,b} first; c joins with mean(0, 0) = 0, d with mean(0.25, 0) = 0.125: both < 0.2
    assert mac_clusters(sim, 1, 0.2) == [[0, 1]]
    # sim_t = 0.1: d joins (0.125); then c's similarity to {a,b,d} is mean(0,0,0.75) = 0.25
    assert mac_clusters(sim, 1, 0.1) == [[0, 1, 2, 3]]
    # a high threshold keeps everyone apart
    assert mac_clusters(sim, 4, 0.8) == []
    assert mac_clusters(torch.ones(1, 1, dtype=D), 4, 0.2) == [[0]]


# ------------------------------------------------------------------------------ (6) alpha


def test_alpha_by_hand_and_sums_to_one():
    mic = torch.tensor([[2, 1, 1], [2, 1, 2], [3, 1, 3]])
    alpha = mac_alpha(mic, [[0], [1], [2]], 4)
    # pos 0: MACs 2,2,3 -> shares 2,2,1 -> 0.4, 0.4, 0.2 ; pos 1: all 1 -> 1/3 each
    # pos 2: MACs 1,2,3 -> 1/3 each
    assert torch.allclose(alpha[:, 0], t([0.4, 0.4, 0.2]))
    assert torch.allclose(alpha[:, 1], torch.full((3,), 1 / 3, dtype=D))
    assert torch.allclose(alpha.sum(dim=0), torch.ones(3, dtype=D))
    # MAC = most frequent category, ties -> the lower id: cluster {0,1} has MAC 2,1,1 here
    # (pos 2 tie between 1 and 2 -> 1), cluster {2} has 3,1,3 -> pos 0/2 differ, pos 1 shared
    alpha2 = mac_alpha(mic, [[0, 1], [2]], 4)
    assert torch.allclose(alpha2, t([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))


def test_alpha_sums_to_one_on_random_maps():
    g = torch.Generator().manual_seed(3)
    mic = torch.randint(1, 5, (9, 200), generator=g)
    alpha = mac_alpha(mic, [[0, 1, 2], [3, 4], [5], [6, 7, 8]], 4)
    assert torch.allclose(alpha.sum(dim=0), torch.ones(200, dtype=D))
    assert bool((alpha > 0).all())


def test_fedsa_tensor_by_hand_excludes_unclustered_client():
    # col 0 agrees (cv 0); col 1 = 0,0,1,9: μ=2.5, s = 6.25,6.25,2.25,42.25
    #   -> min-max 0.1,0.1,0,1 -> C=4 categories 1,1,1,4; col 1 is the only high position
    # SIM: clients 0,1,2 identical (1), client 3 differs (0) -> cluster {0,1,2}, 3 unclustered
    # ŵ = [10, mean(0,0,1)] = [10, 1/3]  (FedAvg would give 2.5)
    w = t([[10, 0], [10, 0], [10, 1], [10, 9]])
    out = fedsa_tensor(w, cv_t=0.2, sim_t=0.2, c_mic=4, s_mac=4)
    assert out[0].item() == 10.0
    assert out[1].item() == pytest.approx(1 / 3)
    # with sim_t = -1 client 3 joins the cluster: the plain mean
    assert fedsa_tensor(w, sim_t=-1.0)[1].item() == pytest.approx(2.5)


def test_fedsa_tensor_matches_composed_steps():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(8, 300, generator=g, dtype=D) + 0.5
    mu, high = dispersion_split(w, 0.2, 1e-12)
    mic = mic_categories(w, mu, high, 4, 1e-12)
    clusters = mac_clusters(client_similarity(mic, high), 4, 0.2)
    assert clusters
    alpha = mac_alpha(mic[:, high], clusters, 4)
    means = torch.stack([w[c][:, high].mean(dim=0) for c in clusters])
    expected = mu.clone()
    expected[high] = (alpha * means).sum(dim=0)
    assert torch.allclose(fedsa_tensor(w), expected, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------- (7) convex result


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_output_is_within_client_range_and_finite(seed):
    # Holds by construction: ŵ_l is a mean, ŵ_h = Σ α_s w̄^s with α ≥ 0, Σα = 1 and each w̄^s a
    # mean of clients; unclustered clients only drop out; no cluster -> the mean.
    g = torch.Generator().manual_seed(seed)
    k, m = 7, 500
    w = torch.randn(k, m, generator=g) * torch.rand(m, generator=g) * 3
    w[:, :20] = w[:, :20] - w[:, :20].mean(dim=0)  # μ ≈ 0 columns (huge cv)
    w[:3, 20:40] += 5.0  # a skewed group
    for sim_t in (0.2, 0.9):
        out = fedsa_tensor(w.double(), sim_t=sim_t).float()
        assert bool(torch.isfinite(out).all())
        assert bool((out >= w.min(dim=0).values).all())
        assert bool((out <= w.max(dim=0).values).all())


# ---------------------------------------------------------------- (8) K = 1, states, weights


def test_single_client_returns_its_values():
    w = torch.tensor([[0.1, -2.0, 3.0]], dtype=torch.float32)
    out = fedsa_aggregate_states([{"w": w[0]}], [5], FedSAParams())
    assert torch.equal(out["w"], w[0])
    assert torch.equal(fedsa_tensor(w.double()), w[0].double())


def test_state_aggregation_with_int_buffer():
    g = torch.Generator().manual_seed(0)
    states = [
        {
            "lin.weight": torch.randn(3, 2, generator=g),
            "bn.num_batches_tracked": torch.tensor(n, dtype=torch.long),
            "half": torch.randn(4, generator=g).half(),
        }
        for n in (11, 22, 33)
    ]
    stats: dict = {}
    out = fedsa_aggregate_states(states, [3, 10, 5], FedSAParams(), stats)
    assert out["bn.num_batches_tracked"].item() == 22  # the largest weight's value
    assert out["bn.num_batches_tracked"].dtype == torch.long
    assert out["lin.weight"].shape == (3, 2) and out["lin.weight"].dtype == torch.float32
    assert out["half"].dtype == torch.float16
    assert 0.0 <= stats["high_fraction"] <= 1.0
    assert set(stats) == {"high_fraction", "clusters", "unclustered"}
    with pytest.raises(ValueError):
        fedsa_aggregate_states(states, [1, 2], FedSAParams())


def test_weighted_knob_changes_only_the_low_mean():
    # equal cv everywhere -> no high positions -> the (weighted) mean
    states = [{"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([3.0, 6.0])}]
    plain = fedsa_aggregate_states(states, [1, 3], FedSAParams())["w"]
    weighted = fedsa_aggregate_states(states, [1, 3], FedSAParams(weighted=True))["w"]
    assert plain.tolist() == [2.0, 4.0]
    assert weighted.tolist() == [2.5, 5.0]


def test_params_validation():
    assert validate_params("fedsa", {}) == {
        "fraction": 1.0,  # every centralized method's client fraction
        "cv_t": 0.2,
        "sim_t": 0.2,
        "c_mic": 4,
        "s_mac": 4,
        "eps": 1e-12,
        "weighted": False,
    }
    for bad in ({"c_mic": 0}, {"s_mac": 0}, {"eps": 0}, {"nope": 1}):
        with pytest.raises(ValueError):
            validate_params("fedsa", bad)


# ------------------------------------------------------------------ (9) the class end-to-end


@pytest.fixture
def make_node(make_method):
    """``make_node(node_id=..., seed=..., num_samples=...)``: FedSA on a 4-unit MLP whose
    initial weights come from ``seed`` (tests/conftest.py)."""
    return partial(make_method, FedSA, rng_seed=0)


def test_class_end_to_end(make_node):
    nodes = {
        f"n{i}": make_node(node_id=f"n{i}", seed=i, num_samples=10 * (i + 1)) for i in range(4)
    }
    uploads = {
        nid: Upload(n=alg.ctx.num_samples, state=alg.upload(), report={})
        for nid, alg in nodes.items()
    }
    agg = nodes["n0"].aggregate(uploads, {}, sorted(nodes), 1)
    glob = agg.common
    assert glob is not None
    assert set(agg.results) == set(nodes)
    assert all(r is glob for r in agg.results.values())
    assert set(glob) == set(nodes["n0"].model.state_dict())
    assert 0.0 <= agg.facts["high_fraction"] <= 1.0
    assert agg.facts["clusters"] >= 0
    for key, val in glob.items():
        stack = torch.stack([u.state[key] for u in uploads.values()])
        assert bool(torch.isfinite(val).all())
        assert bool((val >= stack.min(dim=0).values).all())
        assert bool((val <= stack.max(dim=0).values).all())
    late = make_node(node_id="late", seed=99, num_samples=5)
    assert late.apply(glob, {}) == {}
    for key, val in late.model.state_dict().items():
        assert torch.equal(val, glob[key])
    with pytest.raises(ValueError):  # checked before the strict load
        late.apply({k: v for k, v in glob.items() if not k.endswith("bias")}, {})


# ---------------------------------------------------------------------------- (10) registry


def test_registered():
    cls = get_algorithm("fedsa")
    assert cls is FedSA
    assert cls.kind == "centralized"
    assert cls.upload_part == "all"
    assert math.isclose(FedSAParams().cv_t, 0.2)
