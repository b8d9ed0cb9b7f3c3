"""FedAvg, FedPer and CriticalFL server rules against hand-computed values
(docs/algorithms.md, "Centralized methods")."""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest
import torch

from p2pfl.algorithms import Upload, get_algorithm, validate_params
from p2pfl.algorithms.criticalfl import (
    choose_participants,
    count_cap,
    initial_count,
    is_critical,
    next_count,
)
from p2pfl.learning.train import TrainResult

# ----------------------------------------------------------------------------- helpers


@pytest.fixture
def make_alg(make_method):
    """``make_alg(name, params)``: a method on a 4-unit MLP, 2 samples (tests/conftest.py)."""
    return partial(make_method, num_samples=2, node_id="me")


def const_state(like, value):
    return {k: torch.full_like(v, value) for k, v in like.items()}


def upload(state, n, gradnorm=None):
    return Upload(n, state, {} if gradnorm is None else {"gradnorm": gradnorm})


# ----------------------------------------------------------------------------- FedAvg


def test_fedavg_aggregate_apply_round_trip(make_alg):
    alg = make_alg("fedavg")
    assert alg.kind == "centralized" and alg.upload_part == "all"
    up = alg.upload()
    assert set(up) == set(alg.model.state_dict())
    uploads = {"b": upload(const_state(up, 5.0), 3), "a": upload(const_state(up, 1.0), 1)}
    agg = alg.aggregate(uploads, {}, ["a", "b", "c"], 1)
    assert set(agg.results) == {"a", "b"}
    assert agg.results["a"] is agg.common and agg.results["b"] is agg.common  # packed once
    assert agg.facts == {"aggregated_n": 4}
    assert agg.server == {}
    for v in agg.common.values():
        assert torch.equal(v, torch.full_like(v, 4.0))  # (1·1 + 3·5) / 4
    assert alg.apply(agg.common, {}) == {}
    for v in alg.model.state_dict().values():
        assert torch.equal(v, torch.full_like(v, 4.0))
    # the installed model is a copy: changing the aggregate does not touch the model
    next(iter(agg.common.values())).fill_(-1.0)
    assert all(bool((v == 4.0).all()) for v in alg.model.state_dict().values())


def test_fedavg_apply_rejects_mismatched_state(make_alg):
    alg = make_alg("fedavg")
    before = {k: v.clone() for k, v in alg.model.state_dict().items()}
    full = alg.upload()
    missing = dict(full)
    missing.pop(next(iter(missing)))
    with pytest.raises(ValueError):
        alg.apply(missing, {})
    extra = dict(full, bogus=torch.zeros(1))
    with pytest.raises(ValueError):
        alg.apply(extra, {})
    wrong = dict(full)
    key = next(iter(wrong))
    wrong[key] = torch.zeros(7)
    with pytest.raises(ValueError):
        alg.apply(wrong, {})
    for k, v in alg.model.state_dict().items():
        assert torch.equal(v, before[k])


# ----------------------------------------------------------------------------- FedPer


def test_fedper_uploads_and_applies_only_g(make_alg):
    alg = make_alg("fedper")
    assert alg.upload_part == "g"
    own = {k: v.clone() for k, v in alg.model.state_dict().items()}
    up = alg.upload()
    assert up and all(k.startswith("g.") for k in up)
    assert set(up) == {k for k in own if k.startswith("g.")}
    uploads = {"a": upload(const_state(up, 2.0), 1), "b": upload(const_state(up, 6.0), 1)}
    agg = alg.aggregate(uploads, {}, ["a", "b"], 1)
    assert set(agg.common) == set(up)
    assert agg.results["a"] is agg.common and agg.facts == {"aggregated_n": 2}
    alg.apply(agg.common, {})
    after = alg.model.state_dict()
    for k, v in after.items():
        if k.startswith("g."):
            assert torch.equal(v, torch.full_like(v, 4.0))
        else:
            assert torch.equal(v, own[k])  # h untouched


def test_fedper_apply_rejects_h_or_unknown_keys(make_alg):
    alg = make_alg("fedper")
    own = {k: v.clone() for k, v in alg.model.state_dict().items()}
    g = alg.upload()
    h_key = next(k for k in own if k.startswith("h."))
    with pytest.raises(ValueError):
        alg.apply(dict(g, **{h_key: torch.zeros_like(own[h_key])}), {})
    with pytest.raises(ValueError):
        alg.apply(dict(g, **{"g.nope": torch.zeros(1)}), {})
    partial = dict(g)
    partial.pop(next(iter(partial)))
    with pytest.raises(ValueError):
        alg.apply(partial, {})
    for k, v in alg.model.state_dict().items():
        assert torch.equal(v, own[k])


# ----------------------------------------------------------------------------- CriticalFL rules


def test_is_critical_hand_values():
    # the first detections are critical whatever the values
    assert is_critical([1.0], 3, 0.01, 2)
    assert is_critical([1.0, 0.5], 3, 0.01, 2)
    # window 1: plain comparison of the last two values
    assert is_critical([1.0, 1.0, 1.02], 1, 0.01, 2)  # +2 % > 1 %
    assert not is_critical([1.0, 1.0, 1.005], 1, 0.01, 2)  # +0.5 %
    assert not is_critical([4.0, 4.0, 5.0], 1, 0.25, 2)  # exactly +25 % is not > 25 %
    assert not is_critical([1.0, 1.0, 0.5], 1, 0.01, 2)
    # window 2: mean(2, 4) = 3 vs mean(1, 2) = 1.5 → +100 %
    assert is_critical([1.0, 2.0, 4.0], 2, 0.01, 0)
    # window 3 over a short history: mean(1, 1, 1.1) vs mean(1, 1) → +3.3 %
    assert is_critical([1.0, 1.0, 1.1], 3, 0.01, 2)
    # window 3, full: mean(2, 2, 2) = 2 vs mean(2, 2, 2) = 2 → flat
    assert not is_critical([2.0, 2.0, 2.0, 2.0], 3, 0.01, 2)
    # window 3: mean(3, 3, 3.3) = 3.1 vs mean(3, 3, 3) = 3 → +3.3 %
    assert is_critical([3.0, 3.0, 3.0, 3.3], 3, 0.01, 2)
    # falling
    assert not is_critical([4.0, 3.0, 2.0, 1.0], 3, 0.01, 2)
    # a rise from zero is critical; zero to zero is not
    assert is_critical([0.0, 0.0, 1.0], 1, 0.01, 0)
    assert not is_critical([0.0, 0.0, 0.0], 1, 0.01, 0)
    # with no earlier value to compare with, the start counts as critical
    assert is_critical([5.0], 3, 0.01, 0)


def test_next_count_doubles_to_cap_and_halves_to_k0():
    k0, cap = 2, 7
    seq = [k0]
    for _ in range(4):
        seq.append(next_count(seq[-1], k0, True, cap))
    assert seq == [2, 4, 7, 7, 7]
    for _ in range(4):
        seq.append(next_count(seq[-1], k0, False, cap))
    assert seq[-4:] == [4, 2, 2, 2]  # ⌈7/2⌉ = 4, then 2, never below k0
    assert next_count(3, 1, False, 10) == 2  # rounded up
    assert next_count(1, 1, False, 10) == 1
    assert initial_count(0.2, 10) == 2
    assert initial_count(0.2, 3) == 1  # 0.6 → 1
    assert initial_count(0.2, 2) == 1  # 0.4 → max(1, 0)
    assert initial_count(0.25, 10) == 3  # 2.5 → 3 (half-up)
    assert count_cap(2, 0.75, 10) == 7
    assert count_cap(3, 0.1, 10) == 3  # never below k0


def test_choose_participants_deterministic():
    roster = [f"n{i}" for i in range(10)]
    a = choose_participants(list(reversed(roster)), 4, np.random.default_rng(7))
    b = choose_participants(roster, 4, np.random.default_rng(7))
    assert a == b and len(a) == 4 and a == sorted(a) and set(a) <= set(roster)
    assert choose_participants(roster, 20, np.random.default_rng(0)) == roster
    assert choose_participants(roster, 0, np.random.default_rng(0)) == []
    assert choose_participants([], 3, np.random.default_rng(0)) == []


# ----------------------------------------------------------------------------- CriticalFL method


def _plain(x):
    """True if ``x`` is made only of plain ints, floats, strings, bools, lists and str-keyed
    maps (msgpack-able without extensions)."""
    if isinstance(x, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in x.items())
    if isinstance(x, list):
        return all(_plain(v) for v in x)
    return x is None or type(x) in (int, float, str, bool)


def test_criticalfl_rounds_follow_the_signal(make_alg):
    roster = [f"n{i}" for i in range(10)]
    alg = make_alg("criticalfl", {"window": 1, "delta": 0.01, "initial_detections": 2})
    server = alg.initial_server_state(roster)
    assert server == {"k0": 2, "k": 2, "K": 10, "history": []}
    like = alg.upload()
    # gradnorm means per round; the first two are critical by the initial detections
    means = [1.0, 0.5, 0.6, 0.6, 0.3, 0.3, 0.3]
    expected_k = [4, 7, 7, 4, 2, 2, 2]  # 2→4→7(cap) ; +20 % → 7 ; flat → 4, 2, 2
    expected_crit = [True, True, True, False, False, False, False]
    for r, (m, k, crit) in enumerate(zip(means, expected_k, expected_crit, strict=True), 1):
        parts = alg.participants(server, roster, r, np.random.default_rng(r))
        assert len(parts) == server["k"]
        uploads = {
            p: upload(const_state(like, 1.0), 1, gradnorm=m + (0.1 if i == 0 else -0.1))
            for i, p in enumerate(parts[:2])
        }
        agg = alg.aggregate(uploads, server, roster, r)
        assert agg.facts["critical"] is crit, r
        assert agg.facts["k_next"] == k, r
        assert agg.facts["gradnorm_mean"] == pytest.approx(m)
        assert agg.facts["aggregated_n"] == 2
        assert set(agg.results) == set(uploads)
        assert _plain(agg.server)
        assert len(agg.server["history"]) <= 3  # max(window + 1, initial_detections + 1)
        server = agg.server
    assert server["k"] == 2 and server["k0"] == 2 and server["K"] == 10


def test_criticalfl_participants_deterministic_and_bounded(make_alg):
    roster = [f"n{i}" for i in range(10)]
    alg = make_alg("criticalfl")
    server = {"k0": 2, "k": 5, "K": 10, "history": [0.1]}
    a = alg.participants(server, roster, 3, np.random.default_rng(42))
    b = alg.participants(server, list(reversed(roster)), 3, np.random.default_rng(42))
    assert a == b and len(a) == 5 and a == sorted(a)
    small = ["x", "y"]
    assert alg.participants(server, small, 3, np.random.default_rng(0)) == small


def test_criticalfl_report_and_check_report(make_alg):
    alg = make_alg("criticalfl")
    res = TrainResult(loss=1.0, ce_loss=1.0, steps=4, seconds=0.1, grad_sq_sum=10.0)
    assert alg.report(res, 0.1) == {"gradnorm": pytest.approx(1.0)}
    alg.local_epochs = 2  # set by the driver from training.epochs
    assert alg.report(res, 0.1) == {"gradnorm": pytest.approx(0.5)}
    cls = type(alg)
    assert cls.check_report({"gradnorm": 0.5}) == {"gradnorm": 0.5}
    assert cls.check_report({"gradnorm": 3}) == {"gradnorm": 3.0}
    assert cls.check_report({"gradnorm": 0.0, "other": 1}) == {"gradnorm": 0.0}
    for bad in (
        None,
        [0.5],
        {},
        {"gradnorm": True},
        {"gradnorm": "0.5"},
        {"gradnorm": math.nan},
        {"gradnorm": math.inf},
        {"gradnorm": -1.0},
        {"gradnorm": None},
        {"gradnorm": 10**400},
    ):
        with pytest.raises(ValueError):
            cls.check_report(bad)


@pytest.mark.parametrize(
    "server",
    [
        None,
        {},
        [],
        "state",
        {"k0": 2, "k": "5", "K": 10, "history": []},
        {"k0": 2, "k": True, "K": 10, "history": []},
        {"k0": 2, "k": 0, "K": 10, "history": []},
        {"k0": 2, "k": -3, "K": 10, "history": []},
        {"k0": 2, "k": 5, "K": 10, "history": "abc"},
        {"k0": 2, "k": 5, "K": 10, "history": [math.nan]},
        {"k0": 2, "k": 5, "K": 10, "history": [1.0, -2.0]},
        {"k0": 2, "k": 5, "K": 10.5, "history": []},
        {"k0": 2, "k": 10**12, "K": 10, "history": []},
    ],
)
def test_criticalfl_tolerates_malformed_server_state(make_alg, server):
    roster = [f"n{i}" for i in range(10)]
    alg = make_alg("criticalfl")
    parts = alg.participants(server, roster, 1, np.random.default_rng(0))
    assert len(parts) == 2  # re-derived: k0 = round(0.2 · 10)
    like = alg.upload()
    agg = alg.aggregate({"n0": upload(const_state(like, 1.0), 1, 0.5)}, server, roster, 1)
    assert agg.facts["server_state_reset"] is True
    assert agg.server == {"k0": 2, "k": 4, "K": 10, "history": [0.5]}
    assert _plain(agg.server)


def test_criticalfl_ignores_uploads_without_a_valid_report(make_alg):
    roster = ["a", "b", "c"]
    alg = make_alg("criticalfl")
    like = alg.upload()
    server = alg.initial_server_state(roster)
    uploads = {
        "a": upload(const_state(like, 2.0), 1, 0.4),
        "b": upload(const_state(like, 100.0), 1, math.nan),
    }
    agg = alg.aggregate(uploads, server, roster, 1)
    assert agg.facts["gradnorm_mean"] == pytest.approx(0.4)
    assert agg.facts["aggregated_n"] == 1
    assert set(agg.results) == {"a", "b"}
    assert all(bool((v == 2.0).all()) for v in agg.common.values())
    # no valid report at all: FedAvg over everything, the count stays
    agg = alg.aggregate({"b": upload(const_state(like, 3.0), 1)}, server, roster, 1)
    assert agg.facts["critical"] is False and agg.facts["gradnorm_mean"] is None
    assert agg.server == server


def test_criticalfl_needs_result(make_alg):
    alg = make_alg("criticalfl")
    assert alg.needs_result(True, False, False)
    assert alg.needs_result(False, True, False)
    assert alg.needs_result(False, False, True)
    assert not alg.needs_result(False, False, False)


# ----------------------------------------------------------------------------- registry


def test_registration_and_params():
    for name in ("fedavg", "fedper", "criticalfl"):
        cls = get_algorithm(name)
        assert cls.name == name and cls.kind == "centralized"
    assert get_algorithm("fedper").upload_part == "g"
    assert get_algorithm("criticalfl").upload_part == "all"
    # every centralized method's fraction, and FedProx's mu (FedAvg's and FedPer's)
    assert validate_params("fedavg", {}) == {"fraction": 1.0, "mu": 0.0}
    assert validate_params("criticalfl", {}) == {
        "fraction": 1.0,
        "initial_fraction": 0.2,
        "delta": 0.01,
        "window": 3,
        "max_fraction": 0.75,
        "initial_detections": 2,
    }
    with pytest.raises(ValueError):
        validate_params("criticalfl", {"bogus": 1})
    with pytest.raises(ValueError):
        validate_params("fedavg", {"bogus": 1})
    with pytest.raises(ValueError):
        validate_params("criticalfl", {"window": 0})


# ----------------------------------------------------------------------------- server optimizers


def test_fedavg_server_opt_steps_every_member_alike_and_resumes(make_alg):
    """With ``server_opt`` the aggregate is the plain mean and counts its step (``opt_t``);
    every member takes the same step from it, as a central server would (server_opt.py's
    maths, checked against Flower's in tests/learning/test_server_opt.py), and a restored
    member goes on with the same moments."""
    from p2pfl.learning.server_opt import ServerOptSettings, ServerOptState, server_step

    params = {"server_opt": "adam", "server_lr": 0.5}
    a, b = make_alg("fedavg", params), make_alg("fedavg", params)
    x0 = a.upload()
    uploads = {"a": upload(const_state(x0, 1.0), 1), "b": upload(const_state(x0, 3.0), 1)}
    agg = a.aggregate(uploads, {}, ["a", "b"], 1)
    assert agg.server == {"opt_t": 1}
    assert all(torch.equal(v, torch.full_like(v, 2.0)) for v in agg.common.values())
    announcement = {"server": agg.server}
    a.apply(agg.common, announcement)
    b.apply(agg.common, announcement)
    want, _ = server_step(ServerOptSettings.of("adam", lr=0.5), x0, agg.common, ServerOptState(), 1)
    for k, v in a.model.state_dict().items():
        assert torch.equal(v, want[k]) and torch.equal(v, b.model.state_dict()[k])
    ckpt = a.checkpoint()
    fresh = make_alg("fedavg", params)
    fresh.restore(ckpt)
    agg2 = a.aggregate(uploads, agg.server, ["a", "b"], 2)
    assert agg2.server == {"opt_t": 2}
    a.apply(agg2.common, {"server": agg2.server})
    fresh.apply(agg2.common, {"server": agg2.server})
    for k, v in a.model.state_dict().items():
        assert torch.equal(v, fresh.model.state_dict()[k])
    with pytest.raises(ValueError, match="opt_t"):
        fresh.apply(agg2.common, {"server": {}})  # an announcement without the step
    with pytest.raises(ValueError, match="server_x"):
        make_alg("fedavg", params).restore({**ckpt, "extra": {**ckpt["extra"], "server_x": {}}})


def test_server_opt_knobs_are_recorded_only_when_set():
    assert "server_opt" not in validate_params("fedavg", {})
    got = validate_params("fedper", {"server_opt": "yogi", "tau": 0.001})
    assert got["server_opt"] == "yogi" and got["tau"] == 0.001 and "server_lr" not in got
    with pytest.raises(ValueError, match="server_opt"):
        validate_params("fedavg", {"server_opt": "sgd"})
