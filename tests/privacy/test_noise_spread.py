"""The DP noise spread of one round (p2pfl/privacy/noise_spread.py), against PyTorch's own
optimizers driven by pure Gaussian gradients, as Opacus's DPOptimizer adds them."""

from __future__ import annotations

import math

import pytest
import torch

from p2pfl.learning.robust import noise_slack
from p2pfl.privacy.noise_spread import dp_sgd_spread, update_spread


def _simulated_spread(optimizer: str, lr: float, momentum: float, std: float, steps: int) -> float:
    """The per-coordinate standard deviation of where ``steps`` steps of ``optimizer`` take a
    zero-initialised parameter whose every gradient is ``N(0, std²)``: the noise a DP round
    leaves when the data's gradient is left out."""
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.zeros(200_000, dtype=torch.float64))
    if optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam([w], lr=lr)
    else:
        opt = torch.optim.SGD([w], lr=lr, momentum=momentum)
    for _ in range(steps):
        w.grad = torch.randn(w.shape, generator=gen, dtype=torch.float64) * std
        opt.step()
    return float(w.detach().std())


@pytest.mark.parametrize(("momentum", "steps"), [(0.0, 1), (0.0, 6), (0.5, 6), (0.9, 20)])
def test_the_sgd_spread_is_what_torch_sgd_does_with_pure_noise(momentum, steps):
    lr, sigma, clip, batch = 0.05, 1.4, 5.0, 50
    want = dp_sgd_spread(
        lr=lr,
        noise_multiplier=sigma,
        max_grad_norm=clip,
        batch_size=batch,
        steps=steps,
        momentum=momentum,
    )
    got = _simulated_spread("sgd", lr, momentum, sigma * clip / batch, steps)
    assert got == pytest.approx(want, rel=0.01)


@pytest.mark.parametrize("steps", [1, 6, 20])
def test_the_adam_spread_is_what_torch_adam_does_with_pure_noise(steps):
    want = dp_sgd_spread(
        lr=0.01,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        batch_size=32,
        steps=steps,
        optimizer="adam",
    )
    got = _simulated_spread("adam", 0.01, 0.0, 1.0 / 32, steps)
    assert got == pytest.approx(want, rel=0.05)


def test_no_noise_or_no_steps_is_no_spread():
    common = dict(lr=0.1, max_grad_norm=1.0, batch_size=10)
    assert dp_sgd_spread(noise_multiplier=0.0, steps=5, **common) == 0.0
    assert dp_sgd_spread(noise_multiplier=1.0, steps=0, **common) == 0.0
    assert noise_slack(0.0, 1000, 1.5) == 0.0
    assert noise_slack(0.1, 0, 1.5) == 0.0


def test_the_update_spread_is_sigma_c_and_the_slack_is_two_noises_apart():
    assert update_spread(noise_multiplier=2.0, max_update_norm=0.5) == 1.0
    assert noise_slack(0.02, 10_000, 1.5) == pytest.approx(1.5 * math.sqrt(2) * 0.02 * 100)


@pytest.mark.parametrize(
    "kw",
    [
        {"lr": -0.1},
        {"batch_size": 0},
        {"momentum": 1.0},
        {"momentum": -0.1},
        {"steps": -1},
    ],
)
def test_bad_inputs_are_refused(kw):
    args = dict(lr=0.1, noise_multiplier=1.0, max_grad_norm=1.0, batch_size=10, steps=2)
    with pytest.raises(ValueError):
        dp_sgd_spread(**{**args, **kw})
