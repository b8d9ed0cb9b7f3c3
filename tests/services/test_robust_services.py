"""The node's robustness services on a real method and a real (unconnected) transport: a
training that turns non-finite rolls back to the last finite model and names the peers it
merged; sample claims are capped; refused peers earn a growing distrust; the defence's
inputs are one value the port hands over and the audit rebuilds."""

from __future__ import annotations

import math
from collections import Counter

import torch
from services_helpers import offline_services

from p2pfl.check.load import load_topology
from p2pfl.learning.defence import Defence
from p2pfl.rounds.rotation.audit import announced_inputs
from p2pfl.services.bundle import NodeServices
from p2pfl.services.robust import Robustness


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


class _Spread:
    """A privacy level whose noise spread is known: 0.01 × the round."""

    def noise_spread(self, round_no: int, training: object) -> float:
        return 0.01 * round_no


def test_the_port_hands_the_defence_one_value_the_audit_rebuilds_from_the_announcement():
    cfg = load_topology("topologies/synthetic.yaml", ["defence.rule=clip"])
    defence = Defence(cfg.defence, cfg.rounds)
    robust = Robustness(cfg, "a", defence, 100, Counter(), privacy=_Spread())  # type: ignore[arg-type]
    robust.begin_round(3)
    defence.combine([{"w": torch.ones(2)}, {"w": -torch.ones(2)}], [1, 1], who=["a", "b"])
    assert list(defence.rejected) == ["b"]
    reference = {"w": torch.ones(2)}
    inputs = robust.measure_with(reference=reference)  # as the aggregator does
    assert defence.inputs is inputs and list(defence.rejected) == ["b"]  # refusals stand
    assert (inputs.round, inputs.reference, inputs.noise_spread) == (3, reference, 0.03)
    body = {"noise_spread": inputs.noise_spread}  # the announcement carries it when > 0
    rebuilt = announced_inputs(3, body, reference)
    fields = lambda i: (i.round, i.reference, i.noise_spread, dict(i.staleness))  # noqa: E731
    assert fields(rebuilt) == fields(inputs)
    assert announced_inputs(3, {}, None).noise_spread == 0.0  # no DP: absent, 0
    robust.measure_with(staleness={"b": 0.5})  # as the asynchronous driver does
    assert defence.inputs.reference is reference and dict(defence.inputs.staleness) == {"b": 0.5}
    robust.begin_round(4)
    assert defence.rejected == {} and defence.inputs.reference is None
    assert defence.inputs.staleness == {} and defence.inputs.noise_spread == 0.04
