"""DFedAvgM's delta rule against hand-computed values (docs/algorithms.md, "DFedAvgM")."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from pydantic import ValidationError

from p2pfl.algorithms import get_algorithm
from p2pfl.algorithms.dfedavgm import (
    DFedAvgM,
    apply_delta,
    average_deltas,
    check_peer_delta,
    model_delta,
)

# ----------------------------------------------------------------------------- pure math


def test_model_delta_hand_values_and_int_buffers():
    before = {"w": torch.tensor([1.0, 2.0]), "steps": torch.tensor(3)}
    after = {"w": torch.tensor([1.5, 1.0]), "steps": torch.tensor(8)}
    d = model_delta(after, before, fp16=False)
    assert torch.equal(d["w"], torch.tensor([0.5, -1.0]))
    assert d["w"].dtype == torch.float32
    assert d["steps"].dtype == torch.int64 and int(d["steps"]) == 8  # after's value, no delta
    with pytest.raises(ValueError):
        model_delta({"w": torch.zeros(2)}, {"v": torch.zeros(2)}, fp16=False)
    with pytest.raises(ValueError):
        model_delta({"w": torch.zeros(2)}, {"w": torch.zeros(3)}, fp16=False)


def test_model_delta_fp16_round_trip_error_bounded():
    g = torch.Generator().manual_seed(0)
    before = {"w": torch.randn(1000, generator=g), "steps": torch.tensor(1)}
    after = {"w": before["w"] + 0.01 * torch.randn(1000, generator=g), "steps": torch.tensor(2)}
    exact = model_delta(after, before, fp16=False)["w"]
    half = model_delta(after, before, fp16=True)
    assert half["w"].dtype == torch.float16
    assert half["steps"].dtype == torch.int64 and int(half["steps"]) == 2
    back = half["w"].float()
    # 11 significant bits: relative error ≤ 2^-11 (plus the subnormal floor 2^-25)
    assert bool(((back - exact).abs() <= exact.abs() * 2**-11 + 2**-25).all())
    assert float((back - exact).abs().max()) > 0  # it really was rounded


def test_model_delta_fp16_clamps_instead_of_inf():
    d = model_delta({"w": torch.tensor([1e6, -1e6])}, {"w": torch.zeros(2)}, fp16=True)
    assert torch.isfinite(d["w"]).all()
    assert d["w"].float().tolist() == [65504.0, -65504.0]


def test_average_deltas_two_nodes_weights_1_and_3():
    a = {"w": torch.tensor([1.0, 2.0]), "steps": torch.tensor(7)}
    b = {"w": torch.tensor([5.0, 6.0]), "steps": torch.tensor(9)}
    out = average_deltas([a, b], [1.0, 3.0])
    assert torch.allclose(out["w"], torch.tensor([4.0, 5.0]))  # (1·1 + 3·5)/4, (2 + 18)/4
    assert out["w"].dtype == torch.float32
    assert int(out["steps"]) == 7  # non-float: the first (own) delta's value


def test_average_deltas_casts_fp16_to_float32():
    a = {"w": torch.tensor([1.0, 2.0])}
    b = {"w": torch.tensor([3.0, 4.0], dtype=torch.float16)}
    out = average_deltas([a, b], [1.0, 1.0])
    assert out["w"].dtype == torch.float32
    assert torch.equal(out["w"], torch.tensor([2.0, 3.0]))
    out16 = average_deltas([b], [2.0])  # an fp16 first delta still comes back as float32
    assert out16["w"].dtype == torch.float32


def test_average_deltas_errors():
    a = {"w": torch.zeros(2)}
    with pytest.raises(ValueError):
        average_deltas([], [])
    with pytest.raises(ValueError):
        average_deltas([a], [1.0, 2.0])
    with pytest.raises(ValueError):
        average_deltas([a, {"v": torch.zeros(2)}], [1.0, 1.0])
    with pytest.raises(ValueError):
        average_deltas([a, {"w": torch.zeros(3)}], [1.0, 1.0])
    with pytest.raises(ValueError):
        average_deltas([a, a], [0.0, 0.0])
    with pytest.raises(ValueError):
        average_deltas([a, a], [2.0, -1.0])


def test_apply_delta_casts_to_base_dtype():
    base = {"w": torch.tensor([1.0, 2.0], dtype=torch.float64), "steps": torch.tensor(3)}
    delta = {"w": torch.tensor([0.5, -0.25], dtype=torch.float16), "steps": torch.tensor(8)}
    out = apply_delta(base, delta)
    assert out["w"].dtype == torch.float64
    assert out["w"].tolist() == [1.5, 1.75]
    assert out["steps"].dtype == torch.int64 and int(out["steps"]) == 8
    with pytest.raises(ValueError):
        apply_delta(base, {"w": delta["w"]})


def test_check_peer_delta():
    own = {"w": torch.zeros(2), "steps": torch.tensor(1)}
    assert check_peer_delta(own, {"w": torch.zeros(2), "steps": torch.tensor(5)}) is None
    half = {"w": torch.zeros(2, dtype=torch.float16), "steps": torch.tensor(5)}
    assert check_peer_delta(own, half) is None
    assert check_peer_delta(own, {"w": torch.zeros(2)}) is not None  # missing key
    assert check_peer_delta(own, {"w": torch.zeros(3), "steps": torch.tensor(1)}) is not None
    f64 = {"w": torch.zeros(2, dtype=torch.float64), "steps": torch.tensor(1)}
    assert check_peer_delta(own, f64) is not None
    nan = {"w": torch.tensor([0.0, float("nan")]), "steps": torch.tensor(1)}
    assert check_peer_delta(own, nan) is not None
    assert check_peer_delta(own, {"w": [0.0, 0.0], "steps": torch.tensor(1)}) is not None
    assert check_peer_delta(own, "junk") is not None  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- the class


@pytest.fixture
def make_alg(make_method):
    """``make_alg(params)``: DFedAvgM on a 4-unit MLP, 1 sample (tests/conftest.py)."""
    return partial(make_method, DFedAvgM, num_samples=1, node_id="a")


def state_of(alg) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in alg.model.state_dict().items()}


DELTAS = {"mixing": "deltas"}


def fake_train(alg, seed=1, scale=0.1):
    """Stand-in for local training: perturb every floating tensor of the model."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in alg.model.state_dict().values():
            if p.is_floating_point():
                p.add_(scale * torch.randn(p.shape, generator=g))


def test_registered():
    cls = get_algorithm("dfedavgm")
    assert cls is DFedAvgM
    assert cls.exchange_after_training is True
    defaults = {"mixing": "models", "fp16_deltas": False, "weighted": True, "peers": None}
    assert cls.Params.model_validate({}).model_dump() == defaults


def test_snapshot_is_the_delta_of_training(make_alg):
    alg = make_alg(DELTAS)
    x0 = state_of(alg)
    fake_train(alg)
    z = state_of(alg)
    snap = alg.snapshot()
    assert set(snap) == set(x0)
    for k in x0:
        assert snap[k].device.type == "cpu"
        assert torch.allclose(snap[k], z[k] - x0[k])
    assert alg.select(snap, "all").keys() == snap.keys()


def test_snapshot_fp16(make_alg):
    alg = make_alg({"fp16_deltas": True, "mixing": "deltas"})
    x0 = state_of(alg)
    fake_train(alg)
    z = state_of(alg)
    snap = alg.snapshot()
    for k in x0:
        assert snap[k].dtype == torch.float16
        assert torch.allclose(snap[k].float(), z[k] - x0[k], atol=1e-3)


def test_plan_and_merge_with_one_peer_weights_1_and_3(make_alg):
    alg = make_alg(DELTAS, num_samples=1)
    x0 = state_of(alg)
    fake_train(alg, seed=1)
    own = alg.snapshot()
    g = torch.Generator().manual_seed(2)
    peer = {k: 0.1 * torch.randn(v.shape, generator=g) for k, v in own.items()}
    gossip = {"b": {"n": 3}}
    assert alg.gossip() == {"n": 1}
    plan, facts = alg.plan(gossip)
    assert plan == {"b": "all"} and facts == {}
    out = alg.merge(gossip, {"b": peer})
    assert out["merged_from"] == ["b"]
    new = state_of(alg)
    expected = {k: x0[k] + (1 * own[k] + 3 * peer[k]) / 4 for k in x0}
    sq = 0.0
    for k in x0:
        assert torch.allclose(new[k], expected[k], atol=1e-6)
        assert torch.allclose(alg.x[k], new[k])  # x_i is the merged model
        sq += float(((own[k] + 3 * peer[k]) / 4).double().pow(2).sum())
    assert out["delta_norm"] == pytest.approx(sq**0.5, rel=1e-5)
    # the next round's delta is measured from the merged model
    fake_train(alg, seed=3)
    nxt = alg.snapshot()
    z2 = state_of(alg)
    for k in x0:
        assert torch.allclose(nxt[k], z2[k] - new[k], atol=1e-6)


def test_merge_uniform_and_fp16_peer(make_alg):
    alg = make_alg({"weighted": False, "mixing": "deltas"}, num_samples=1)
    x0 = state_of(alg)
    fake_train(alg)
    own = alg.snapshot()
    peer = {k: (0.5 * v).to(torch.float16) for k, v in own.items()}
    plan, _ = alg.plan({"b": {"n": 100}})
    assert plan == {"b": "all"}
    alg.merge({"b": {"n": 100}}, {"b": peer})
    new = state_of(alg)
    for k in x0:  # uniform: (Δ + Δ_b)/2, whatever the sample counts
        expected = x0[k] + (own[k] + peer[k].float()) / 2
        assert new[k].dtype == torch.float32
        assert torch.allclose(new[k], expected, atol=1e-6)


def test_merge_ignores_malformed_peer_and_failed_pull(make_alg):
    alg = make_alg(DELTAS, num_samples=2)
    x0 = state_of(alg)
    fake_train(alg)
    own = alg.snapshot()
    good = {k: torch.ones_like(v) for k, v in own.items()}
    bad_key = dict(good)
    bad_key.pop(next(iter(bad_key)))
    bad_shape = {k: torch.ones(7) for k in own}
    bad_nan = {k: torch.full_like(v, float("nan")) for k, v in own.items()}
    gossip = {p: {"n": 2} for p in ("b", "c", "d", "e", "f")}
    plan, _ = alg.plan(gossip)
    assert plan == {p: "all" for p in gossip}
    # "f"'s pull failed: absent from pulled
    out = alg.merge(gossip, {"b": good, "c": bad_key, "d": bad_shape, "e": bad_nan})
    assert out["merged_from"] == ["b"]
    assert sorted(out["rejected"]) == ["c", "d", "e"]
    new = state_of(alg)
    for k in x0:
        assert torch.allclose(new[k], x0[k] + (own[k] + 1.0) / 2, atol=1e-6)


def test_merge_alone_keeps_the_trained_model(make_alg):
    alg = make_alg(DELTAS)
    fake_train(alg)
    z = state_of(alg)
    alg.snapshot()
    out = alg.merge({}, {})
    assert out["merged_from"] == []
    for k, v in state_of(alg).items():
        assert torch.allclose(v, z[k], atol=1e-6)
        assert torch.allclose(alg.x[k], z[k], atol=1e-6)


def test_plan_skips_peers_without_sample_count(make_alg):
    alg = make_alg()
    plan, facts = alg.plan({"b": {"n": 3}, "c": {}, "d": {"n": True}, "e": {"n": -1}})
    assert plan == {"b": "all"}
    assert facts == {"bad_gossip": ["c", "d", "e"]}
    uniform = make_alg({"weighted": False})
    assert uniform.plan({"c": {}})[0] == {"c": "all"}


def test_params_reject_unknown(make_alg):
    with pytest.raises(ValidationError):
        make_alg({"nope": 1})


def test_choose_peers_all_or_a_random_few(make_alg):
    assert make_alg().choose_peers(["c", "a", "b"]) == ["a", "b", "c"]
    few = make_alg({"peers": 2}).choose_peers(["d", "c", "b", "a"])
    assert len(few) == 2 and set(few) <= {"a", "b", "c", "d"}


# ----------------------------------------------------------------------------- model mixing


def test_models_mixing_snapshot_is_the_trained_model(make_alg):
    alg = make_alg()
    fake_train(alg)
    z = state_of(alg)
    snap = alg.snapshot()
    for k in z:
        assert torch.equal(snap[k], z[k]) and snap[k].device.type == "cpu"
    half = make_alg({"fp16_deltas": True})
    fake_train(half)
    z = state_of(half)
    for k, v in half.snapshot().items():
        assert v.dtype == torch.float16 and torch.allclose(v.float(), z[k], atol=1e-2)


def test_models_mixing_weights_1_and_3_reaches_consensus(make_alg):
    alg = make_alg(num_samples=1)
    x0 = state_of(alg)
    fake_train(alg, seed=1)
    z = state_of(alg)
    alg.snapshot()
    g = torch.Generator().manual_seed(2)
    peer = {k: torch.randn(v.shape, generator=g) for k, v in z.items()}  # a far-away model
    out = alg.merge({"b": {"n": 3}}, {"b": peer})
    assert out["merged_from"] == ["b"]
    new = state_of(alg)
    sq = 0.0
    for k in z:  # x_i ← (1·z_i + 3·z_b) / 4: the peer's model, not its update, is mixed in
        expected = (z[k] + 3 * peer[k]) / 4
        assert torch.allclose(new[k], expected, atol=1e-6)
        assert torch.allclose(alg.x[k], expected, atol=1e-6)
        sq += float((expected - x0[k]).double().pow(2).sum())
    assert out["delta_norm"] == pytest.approx(sq**0.5, rel=1e-5)
    # two nodes that mix with each other (equal weights) hold the same model afterwards
    a, b = make_alg(num_samples=2), make_alg(num_samples=2)
    fake_train(a, seed=4)
    fake_train(b, seed=5)
    sa, sb = a.snapshot(), b.snapshot()
    a.merge({"b": {"n": 2}}, {"b": sb})
    b.merge({"a": {"n": 2}}, {"a": sa})
    for k, v in state_of(a).items():
        assert torch.allclose(v, state_of(b)[k], atol=1e-6)


def test_models_mixing_rejects_malformed_peer(make_alg):
    alg = make_alg(num_samples=2)
    fake_train(alg)
    z = state_of(alg)
    own = alg.snapshot()
    bad_nan = {k: torch.full_like(v, float("nan")) for k, v in own.items()}
    out = alg.merge({"b": {"n": 2}}, {"b": bad_nan})
    assert out["merged_from"] == [] and "b" in out["rejected"]
    for k, v in state_of(alg).items():
        assert torch.allclose(v, z[k])
