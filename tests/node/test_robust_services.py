"""The node's robustness services on a real method and a real (unconnected) transport: a
training that turns non-finite rolls back to the last finite model and names the peers it
merged; sample claims are capped; refused peers earn a growing distrust."""

from __future__ import annotations

import math

import torch
from services_helpers import offline_services

from p2pfl.check.load import load_topology
from p2pfl.services.bundle import NodeServices


def services(overrides: list[str] | None = None, node_id: str = "a") -> NodeServices:
    return offline_services(load_topology("topologies/synthetic.yaml", overrides or []), node_id)


def weights(svc: NodeServices) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in svc.method.model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


async def test_a_diverging_training_rolls_back_to_the_last_finite_model():
    svc = services(["training.optimizer=sgd", "training.lr=0.05"])
    initial = weights(svc)
    svc.training.merged(["b", "d"])
    svc.cfg.training.lr = 1e30  # the loss overflows in the first steps
    out = await svc.training.train(1)
    assert not math.isfinite(out.result.loss)
    assert out.diverged == {"merged_from": ["b", "d"], "rolled_back_to": 0}
    assert same(weights(svc), initial)  # nothing trained on NaN survives

    svc.cfg.training.lr = 0.05
    good = await svc.training.train(2)
    assert good.diverged is None and math.isfinite(good.result.loss)
    after_two = weights(svc)
    svc.cfg.training.lr = 1e30
    out = await svc.training.train(3)
    assert out.diverged == {"merged_from": ["b", "d"], "rolled_back_to": 2}
    assert same(weights(svc), after_two)
    assert all(bool(torch.isfinite(v).all()) for v in weights(svc).values())


def test_claims_are_capped_and_recorded():
    svc = services()
    own = len(svc.data.train_y)
    capped = svc.robust.cap_claims({"b": own, "c": own, "d": 10**9})  # median: own
    assert capped["d"] == 10 * own and capped["b"] == own
    assert svc.robust.capped == {"d": 10**9}


def test_refused_peers_sit_out_a_growing_number_of_rounds():
    svc = services()
    svc.robust.begin_round(1)
    svc.robust.reject("d", "non-finite values in 'g.w'", 1)
    facts = svc.robust.facts(1)
    assert facts["rejected"] == {"d": "non-finite values in 'g.w'"}
    assert facts["distrusted"] == {"d": 4}  # rounds 2 and 3 without d (distrust_rounds 2)
    assert (
        not svc.robust.trusted("d", 3) and svc.robust.trusted("d", 4) and svc.robust.trusted("b", 2)
    )
    svc.robust.begin_round(4)
    svc.robust.reject("d", "norm 1e+03 > 10 x own 5", 4)
    assert svc.robust.facts(4)["distrusted"] == {"d": 9}  # doubled: rounds 5 to 8
    svc.robust.begin_round(5)
    assert svc.robust.facts(5)["rejected"] == {}
    assert svc.exchange.transport.dropped["rejected_state"] == 2
