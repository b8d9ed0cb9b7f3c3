"""FedProx as FedAvg's ``mu`` (and FedPer's, on its shared part): each node's loss gains
``(μ/2)·‖w − w_t‖²`` around the model it received, as Flower's FedProx clients add
``(proximal_mu / 2) · ‖w − w_global‖²``; at ``mu = 0`` nothing is added."""

from __future__ import annotations

import pytest
import torch

from p2pfl.config.schema import TrainingConfig
from p2pfl.learning.train import train_local


def test_no_mu_is_plain_fedavg(make_method):
    assert make_method("fedavg").extra_loss() is None
    assert make_method("criticalfl").extra_loss() is None  # derives FedAvg, has no such knob


def test_the_term_and_its_gradient_are_flowers(make_method):
    alg = make_method("fedavg", {"mu": 0.3})
    prox = alg.extra_loss()  # anchored at the model as the round begins
    model = alg.model
    w_global = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    x = torch.zeros(1, 1, 4, 4)
    term = prox(model, x, torch.zeros(1, dtype=torch.long), model(x))
    # Flower: proximal_term = Σ ||w - w_global||²; loss += (proximal_mu / 2) * proximal_term
    flower = sum((p - w_global[n]).norm(2) ** 2 for n, p in model.named_parameters())
    assert term.item() == pytest.approx(0.3 / 2 * flower.item(), rel=1e-6)
    term.backward()
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, 0.3 * (p.detach() - w_global[n]), atol=1e-7)


def test_fedper_pulls_only_its_shared_part_back(make_method):
    alg = make_method("fedper", {"mu": 1.0})
    prox = alg.extra_loss()
    model = alg.model
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    x = torch.zeros(1, 1, 4, 4)
    prox(model, x, torch.zeros(1, dtype=torch.long), model(x)).backward()
    for n, p in model.named_parameters():
        assert (p.grad is not None) == n.startswith("g."), n


def test_a_large_mu_keeps_the_trained_model_near_the_received_one(make_method):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 1, 4, 4, generator=g), torch.randint(0, 3, (40,), generator=g)
    cfg = TrainingConfig(steps=30, batch_size=8, lr=0.1)
    moved = {}
    for mu in (0.0, 10.0):
        alg = make_method("fedavg", {"mu": mu})
        start = [p.detach().clone() for p in alg.model.parameters()]
        train_local(alg.model, x, y, cfg, cfg.lr, extra_loss=alg.extra_loss())
        moved[mu] = sum(
            (p - s).norm() ** 2 for p, s in zip(alg.model.parameters(), start, strict=True)
        )
    assert moved[10.0] < 0.5 * moved[0.0]
