"""The adaptive server optimizers (p2pfl/learning/server_opt.py) against Flower's strategy
maths: FedAdam, FedYogi and FedAdagrad as flwr 1.28's ``aggregate_fit`` computes them over
numpy arrays, written out here step by step, over several rounds."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from p2pfl.learning.server_opt import ServerOptSettings, ServerOptState, server_step


def flower_steps(kind, x0, means, eta, beta_1, beta_2, tau):
    """Flower's FedOpt family over lists of arrays: ``current_weights``, ``m_t``, ``v_t``
    updated per server round (numbered from 1) from the FedAvg aggregate of the round."""
    current = [a.copy() for a in x0]
    m_t = v_t = None
    out = []
    for server_round, fedavg in enumerate(means, start=1):
        delta_t = [x - y for x, y in zip(fedavg, current, strict=True)]
        if m_t is None:
            m_t = [np.zeros_like(x) for x in delta_t]
        m_t = [np.multiply(beta_1, x) + (1 - beta_1) * y for x, y in zip(m_t, delta_t, strict=True)]
        if v_t is None:
            v_t = [np.zeros_like(x) for x in delta_t]
        if kind == "adam":
            v_t = [
                beta_2 * x + (1 - beta_2) * np.multiply(y, y)
                for x, y in zip(v_t, delta_t, strict=True)
            ]
            rate = (
                eta
                * np.sqrt(1 - np.power(beta_2, server_round + 1.0))
                / (1 - np.power(beta_1, server_round + 1.0))
            )
        elif kind == "yogi":
            sq = [np.multiply(y, y) for y in delta_t]
            v_t = [x - (1.0 - beta_2) * z * np.sign(x - z) for x, z in zip(v_t, sq, strict=True)]
            rate = eta
        else:  # adagrad
            v_t = [x + np.multiply(y, y) for x, y in zip(v_t, delta_t, strict=True)]
            rate = eta
        current = [
            x + rate * y / (np.sqrt(z) + tau) for x, y, z in zip(current, m_t, v_t, strict=True)
        ]
        out.append([a.copy() for a in current])
    return out


@pytest.mark.parametrize(
    ("kind", "knobs"),
    [
        ("adam", {}),
        ("adam", {"lr": 0.1, "beta1": 0.9, "beta2": 0.999, "tau": 1e-8}),  # FLamby's
        ("yogi", {}),
        ("yogi", {"lr": 0.1, "tau": 1e-8}),
        ("adagrad", {}),
    ],
)
def test_server_steps_are_flowers(kind, knobs):
    rng = np.random.default_rng(7)
    x0 = {"a": rng.normal(size=(3, 4)), "b": rng.normal(size=5)}
    means = [{k: v + rng.normal(scale=0.3, size=v.shape) for k, v in x0.items()} for _ in range(6)]
    settings = ServerOptSettings.of(kind, **knobs)
    expected = flower_steps(
        kind,
        [x0["a"], x0["b"]],
        [[m["a"], m["b"]] for m in means],
        settings.lr,
        settings.beta1,
        settings.beta2,
        settings.tau,
    )
    x = {k: torch.tensor(v, dtype=torch.float64) for k, v in x0.items()}
    state = ServerOptState()
    for t, (mean, want) in enumerate(zip(means, expected, strict=True), start=1):
        target = {k: torch.tensor(v, dtype=torch.float64) for k, v in mean.items()}
        x, state = server_step(settings, x, target, state, t)
        np.testing.assert_allclose(x["a"].numpy(), want[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(x["b"].numpy(), want[1], rtol=1e-12, atol=1e-12)


def test_defaults_are_flowers_and_unknown_kinds_are_refused():
    assert ServerOptSettings.of("adam") == ServerOptSettings("adam", 0.1, 0.9, 0.99, 1e-9)
    assert ServerOptSettings.of("yogi") == ServerOptSettings("yogi", 0.01, 0.9, 0.99, 1e-3)
    assert ServerOptSettings.of("adagrad").beta1 == 0.0
    assert ServerOptSettings.of("adam", lr=None, tau=1e-8).tau == 1e-8
    with pytest.raises(ValueError, match="unknown"):
        ServerOptSettings.of("sgd")


def test_a_step_keeps_dtypes_and_counters_and_leaves_its_inputs_alone():
    settings = ServerOptSettings.of("adam")
    x = {"w": torch.zeros(2, dtype=torch.float32), "n": torch.tensor(3)}
    mean = {"w": torch.tensor([1.0, -1.0]), "n": torch.tensor(9)}
    state = ServerOptState()
    new_x, new_state = server_step(settings, x, mean, state, 1)
    assert new_x["w"].dtype == torch.float32 and int(new_x["n"]) == 9
    assert state.m == {} and torch.equal(x["w"], torch.zeros(2))
    # step 1 from zero moments: m = 0.1·Δ, v = 0.01·Δ², so m/√v = sign(Δ)
    rate = 0.1 * math.sqrt(1 - 0.99**2) / (1 - 0.9**2)
    assert torch.allclose(new_x["w"], torch.tensor([rate, -rate]))
    assert new_state.m["w"].dtype == torch.float64
    with pytest.raises(ValueError, match="step 0"):
        server_step(settings, x, mean, state, 0)
    with pytest.raises(ValueError, match="tensors"):
        server_step(settings, x, {"w": mean["w"]}, state, 1)
