"""UA-PDFL math against hand-computed values (docs/algorithms.md, "UA-PDFL")."""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest
import torch

from p2pfl.algorithms.uapdfl import (
    decide,
    gossiped_drift,
    kl,
    relative_divergence,
    symmetric_kl,
    unit_tensor,
)
from p2pfl.learning.state import weighted_mean


def test_kl_and_symmetric_kl_hand_values():
    p = torch.tensor([0.5, 0.5])
    q = torch.tensor([0.25, 0.75])
    kl_pq = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    kl_qp = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert kl(p, q) == pytest.approx(kl_pq, abs=1e-9)
    assert kl(q, p) == pytest.approx(kl_qp, abs=1e-9)
    assert symmetric_kl(p, q) == pytest.approx(0.5 * kl_pq + 0.5 * kl_qp, abs=1e-9)
    assert symmetric_kl(p, q) == pytest.approx(0.1373268, abs=1e-6)
    assert symmetric_kl(p, p) == 0.0
    assert symmetric_kl(p, q) == symmetric_kl(q, p)


def test_kl_guards_zeros():
    p = torch.tensor([1.0, 0.0])
    q = torch.tensor([0.0, 1.0])
    d = symmetric_kl(p, q, eps=1e-8)
    assert math.isfinite(d)
    assert d == pytest.approx(math.log(1 / 1e-8), rel=1e-6)


def test_weighted_mean_own_first_hand_values():
    a = {"w": torch.tensor([1.0, 2.0]), "steps": torch.tensor(7)}
    b = {"w": torch.tensor([5.0, 6.0]), "steps": torch.tensor(9)}
    out = weighted_mean([a, b], [1, 3])  # as the merge calls it: the node's own first
    assert torch.allclose(out["w"], torch.tensor([4.0, 5.0]))
    assert int(out["steps"]) == 7  # non-float tensors: the node's own
    with pytest.raises(ValueError):
        weighted_mean([], [])


def test_decide_branches():
    rng = np.random.default_rng(0)
    peer, h = decide({"a": 0.05, "b": 0.08}, 0.1, rng)
    assert peer in ("a", "b") and h == []
    assert decide({"a": 0.1, "b": 0.1}, 0.1, rng)[0] is not None  # ≤ th_I: dropout
    assert decide({"a": 0.05, "b": 0.5}, 0.1, rng) == (None, ["a"])
    assert decide({"a": 0.1, "b": 0.2}, 0.1, rng) == (None, [])  # h needs Div < th_I
    assert decide({}, 0.1, rng) == (None, [])


@pytest.fixture
def make_alg(make_method):
    """UA-PDFL on a 4-unit MLP over 1×2×2 inputs, 2 samples (tests/conftest.py)."""
    return partial(make_method, "uapdfl", input_shape=(1, 2, 2), num_samples=2, node_id="me")


def const_state(like, value):
    return {k: torch.full_like(v, value) for k, v in like.items()}


def test_layerwise_personalization_weights_by_samples(make_alg):
    alg = make_alg({"divergence_rule": "fixed", "th_I": 0.5}, num_samples=2)
    own = {k: v.clone() for k, v in alg.model.state_dict().items()}
    I_me = alg.I
    close = torch.tensor(I_me.tolist())  # identical: Div 0
    far = torch.tensor([0.98, 0.01, 0.01]) if I_me[0] < 0.5 else torch.tensor([0.01, 0.01, 0.98])
    gossip = {
        "p": {"n": 2, "I": close, "A": alg.A + 1.0},
        "q": {"n": 4, "I": far, "A": alg.A + 4.0},
    }
    plan, facts = alg.plan(gossip)
    assert facts["dropout"] is False
    assert plan == {"p": "all", "q": "g"}
    assert facts["h_peers"] == ["p"]
    # A_avg = (A_i + A_p + A_q) / 3
    assert torch.allclose(alg.A_avg, alg.A + 5.0 / 3.0, atol=1e-6)
    sp = const_state(own, 1.0)
    sq = {k: v for k, v in const_state(own, 10.0).items() if k.startswith("g.")}
    alg.merge(gossip, {"p": sp, "q": sq})
    new = alg.model.state_dict()
    for k in own:
        if k.startswith("g."):  # (2·own + 2·1 + 4·10) / 8
            expect = (2 * own[k] + 2 * 1.0 + 4 * 10.0) / 8
        else:  # (2·own + 2·1) / 4 — q's h is not used
            expect = (2 * own[k] + 2 * 1.0) / 4
        assert torch.allclose(new[k], expect, atol=1e-6), k


def test_client_wise_dropout_adopts_whole_model(make_alg):
    alg = make_alg({"divergence_rule": "fixed", "th_I": 10.0})
    gossip = {
        "p": {"n": 5, "I": alg.I.clone(), "A": alg.A.clone()},
        "q": {"n": 5, "I": alg.I.clone(), "A": alg.A.clone()},
    }
    plan, facts = alg.plan(gossip)
    assert facts["dropout"] is True
    (peer,) = plan
    assert plan[peer] == "all" and facts["dropout_peer"] == peer
    theirs = const_state(alg.model.state_dict(), 3.0)
    info = alg.merge(gossip, {peer: theirs})
    assert info["merged_from"] == [peer]
    for k, v in alg.model.state_dict().items():
        assert torch.equal(v, theirs[k])


def test_dropout_with_failed_pull_keeps_own_model(make_alg):
    alg = make_alg({"th_I": 10.0})
    before = {k: v.clone() for k, v in alg.model.state_dict().items()}
    gossip = {"p": {"n": 5, "I": alg.I.clone(), "A": alg.A.clone()}}
    alg.plan(gossip)
    assert alg.merge(gossip, {}) == {"merged_from": []}
    for k, v in alg.model.state_dict().items():
        assert torch.equal(v, before[k])


def test_malformed_gossip_is_ignored(make_alg):
    alg = make_alg({"th_I": 0.1})
    gossip = {
        "bad_shape": {"n": 3, "I": torch.ones(5) / 5, "A": alg.A},
        "bad_n": {"n": -1, "I": alg.I, "A": alg.A},
        "nan": {"n": 3, "I": torch.full((3,), float("nan")), "A": alg.A},
        "missing": {"n": 3},
    }
    plan, facts = alg.plan(gossip)
    assert plan == {} and facts["divergence"] == {}
    assert alg.A_avg is None and alg.extra_loss() is None


def test_auxiliary_term_value_and_gradient(make_alg):
    alg = make_alg({"mu": 0.5, "th_I": 0.0})
    gossip = {"p": {"n": 2, "I": torch.tensor([1.0, 0, 0]), "A": alg.A + 2.0}}
    alg.plan(gossip)
    term = alg.extra_loss()
    assert term is not None
    x_unit = unit_tensor((1, 2, 2), 1.0)
    value = term(alg.model, None, None, None)
    expected = 0.5 * (alg.model.g(x_unit)[0] - alg.A_avg).pow(2).sum()
    assert float(value.detach()) == pytest.approx(float(expected.detach()))
    # A_avg = A + 1, and g(X_unit) = A before training: the term is μ·|A|·1² = 0.5·F
    assert float(value.detach()) == pytest.approx(0.5 * alg.A.numel(), rel=1e-5)
    value.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in alg.model.g.parameters())
    assert all(p.grad is None for p in alg.model.h.parameters())


def test_choose_peers_draws_com_neighbours(make_alg):
    alg = make_alg({"com": 2})
    picks = alg.choose_peers(["a", "b", "c", "d", "e"])
    assert len(picks) == 2 and set(picks) <= {"a", "b", "c", "d", "e"}
    assert alg.choose_peers(["a"]) == ["a"]


def test_auxiliary_term_mean_reduction_divides_by_feature_dim(make_alg):
    alg = make_alg({"mu": 0.5, "th_I": 0.0, "aux_reduction": "mean"})
    gossip = {"p": {"n": 2, "I": torch.tensor([1.0, 0, 0]), "A": alg.A + 2.0}}
    alg.plan(gossip)
    value = alg.extra_loss()(alg.model, None, None, None)
    assert float(value.detach()) == pytest.approx(0.5, rel=1e-5)  # μ · mean(1²)


def test_relative_divergence_hand_values():
    assert relative_divergence(0.3, 0.1, 0.2) == pytest.approx(2.0)  # 0.3 / 0.15
    assert relative_divergence(0.0, None, None) == 0.0  # identical representations
    assert relative_divergence(0.0, 0.0, 0.0) == 0.0
    assert relative_divergence(0.3, None, 0.2) == math.inf  # no drift known yet
    assert relative_divergence(0.3, 0.0, 0.0) == math.inf  # nobody moved, yet they differ
    # scale-free: Div and drift scaled alike give the same value
    assert relative_divergence(3e-4, 1e-4, 2e-4) == pytest.approx(2.0)


def test_gossiped_drift_rejects_malformed_values():
    assert gossiped_drift({"d": 0.25}) == 0.25
    assert gossiped_drift({"d": 0}) == 0.0
    for bad in (True, -0.1, math.nan, math.inf, "0.1", None, [0.1]):
        assert gossiped_drift({"d": bad}) is None, bad
    assert gossiped_drift({}) is None


def _near(rep: torch.Tensor, shift: float) -> torch.Tensor:
    """A distribution at a small, known divergence from ``rep``."""
    logits = rep.log() + torch.tensor([shift, 0.0, -shift])
    return torch.softmax(logits, dim=0)


def test_drift_is_measured_and_gossiped(make_alg):
    alg = make_alg({})
    assert "d" not in alg.gossip() and alg.drift is None
    alg.plan({})
    alg.merge({}, {})
    I_pre = alg.I.clone()
    with torch.no_grad():  # stands in for local training: the classifier moves
        alg.model.h.bias.add_(torch.tensor([0.5, 0.0, -0.5]))
    assert alg.after_train() == {}
    assert alg.drift == pytest.approx(symmetric_kl(I_pre, alg.I), rel=1e-9)
    assert alg.drift > 0
    assert alg.gossip()["d"] == alg.drift


def test_order_train_first_merges_after_training(make_alg):
    """``order: train_first`` (docs/algorithms.md, "UA-PDFL"): the driver trains first; the
    drift is then measured from the merge of the round before, none in round 1."""
    assert make_alg({}).exchange_after_training is False  # the paper's loop: merge first
    alg = make_alg({"order": "train_first"})
    assert alg.exchange_after_training is True
    with torch.no_grad():  # round 1's training, from the common initial model
        alg.model.h.bias.add_(torch.tensor([0.5, 0.0, -0.5]))
    alg.after_train()
    assert alg.drift is None and "d" not in alg.gossip()
    # round 1's merge: a peer that trained elsewhere is no twin (no drift known yet)
    peer = {"p": {"n": 2, "I": _near(alg.I, 0.5), "A": alg.A}}
    plan, facts = alg.plan(peer)
    assert facts["dropout"] is False and plan == {"p": "g"}
    alg.merge(peer, {})
    I_pre = alg.I.clone()
    with torch.no_grad():  # round 2's training
        alg.model.h.bias.add_(torch.tensor([-0.2, 0.1, 0.1]))
    alg.after_train()
    assert alg.drift == pytest.approx(symmetric_kl(I_pre, alg.I), rel=1e-9)


def test_relative_rule_compares_div_with_the_pairs_drift(make_alg):
    alg = make_alg({})
    assert (alg.params.divergence_rule, alg.params.kappa) == ("relative", 2.0)  # the defaults
    close, far = _near(alg.I, 0.05), _near(alg.I, 0.5)
    div_close, div_far = symmetric_kl(alg.I, close), symmetric_kl(alg.I, far)
    drift = 2 * div_close  # both peers and this node moved this much last round
    alg.drift = drift
    gossip = {
        "p": {"n": 2, "I": close, "A": alg.A, "d": drift},
        "q": {"n": 2, "I": far, "A": alg.A, "d": drift},
    }
    plan, facts = alg.plan(gossip)
    assert div_far / drift > 2 > div_close / drift
    assert facts["dropout"] is False and facts["h_peers"] == ["p"]
    assert plan == {"p": "all", "q": "g"}
    assert facts["relative"]["p"] == pytest.approx(0.5, abs=1e-3)
    assert facts["drift"] == pytest.approx(drift, rel=1e-4)
    # every peer within its drift: client-wise dropout
    alg.drift = gossip["q"]["d"] = 2 * div_far
    plan, facts = alg.plan(gossip)
    assert facts["dropout"] is True and len(plan) == 1
    # the same Div with a hundredth of the drift: nobody is similar any more
    alg.drift = drift / 100
    for g in gossip.values():
        g["d"] = drift / 100
    plan, facts = alg.plan(gossip)
    assert facts["dropout"] is False and facts["h_peers"] == []
    assert plan == {"p": "g", "q": "g"}


def test_relative_rule_without_drift_shares_only_identical_representations(make_alg):
    alg = make_alg({})
    gossip = {
        "same": {"n": 2, "I": alg.I.clone(), "A": alg.A},  # round 1: the common initial model
        "other": {"n": 2, "I": _near(alg.I, 0.01), "A": alg.A, "d": "bad"},
    }
    plan, facts = alg.plan(gossip)
    assert facts["h_peers"] == ["same"] and plan == {"same": "all", "other": "g"}
    assert facts["relative"] == {"same": 0.0, "other": None}


def test_fixed_rule_ignores_drift(make_alg):
    alg = make_alg({"divergence_rule": "fixed", "th_I": 0.1})
    close = _near(alg.I, 0.05)
    assert symmetric_kl(alg.I, close) < 0.1
    alg.drift = 1e-9
    gossip = {"p": {"n": 2, "I": close, "A": alg.A, "d": 1e-9}}
    plan, facts = alg.plan(gossip)
    assert facts["dropout"] is True and "relative" not in facts
