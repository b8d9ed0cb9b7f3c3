"""McMahan's client fraction C for the centralized methods (docs/algorithms.md, "Client
fraction"): the draw itself (pure), its knob and its load-time check, and a swarm of
in-process nodes over a real Mosquitto where only the drawn members train and upload."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from pydantic import Field

from p2pfl.algorithms import get_algorithm, validate_params
from p2pfl.algorithms.base import (
    CentralizedAlgorithm,
    CentralizedParams,
    Params,
    draw_members,
    drawn_count,
)
from p2pfl.algorithms.fedavg import FedAvg
from p2pfl.check.load import load_topology
from p2pfl.check.preflight import check_defence
from p2pfl.errors import ConfigError
from p2pfl.node.daemon import Node, NodeOptions
from p2pfl.rounds.rotation.plans import announced_plan, draw_plan

CENTRALIZED = ("fedavg", "fedper", "criticalfl", "diversifed", "pfedc", "fedsa")
ROSTER = [f"n{i:02d}" for i in range(20)]


def test_drawn_count_is_max_1_round_half_up_capped_at_k():
    assert [drawn_count(0.1, k) for k in (0, 1, 4, 5, 14, 15, 20)] == [0, 1, 1, 1, 1, 2, 2]
    assert drawn_count(0.5, 5) == 3  # 2.5 rounds half-up, not to even
    assert drawn_count(1.0, 7) == 7 and drawn_count(0.999, 7) == 7
    assert drawn_count(1e-9, 1000) == 1


def test_draw_is_deterministic_right_sized_and_agreed():
    for fraction in (0.1, 0.25, 0.5, 0.9):
        for r in range(1, 30):
            a = draw_members(ROSTER, fraction, 7, r)
            # every node computes it from the roster it holds, in whatever order it lists it
            assert a == draw_members(list(reversed(ROSTER)), fraction, 7, r)
            assert a == sorted(set(a)) and set(a) <= set(ROSTER)
            assert len(a) == drawn_count(fraction, len(ROSTER))
    # the seed and the round change the draw; fraction 1 draws everyone without a generator
    draws = {tuple(draw_members(ROSTER, 0.25, 7, r)) for r in range(1, 30)}
    assert len(draws) > 20
    assert draw_members(ROSTER, 0.25, 7, 3) != draw_members(ROSTER, 0.25, 8, 3)
    assert draw_members(ROSTER, 1.0, 7, 3) == ROSTER


def test_every_member_draws_the_same_plan(make_method):
    """Each node builds its own method and plan: the drawn members and participants agree,
    and a plan carried by an announcement draws the same members again."""
    plans = []
    for i, me in enumerate(ROSTER[:5]):  # each node's own method, its own generator
        alg = make_method("fedavg", {"fraction": 0.3}, node_id=me, rng_seed=i)
        plans.append(draw_plan(alg, 11, 4, ROSTER, {}))
    assert all(p.drawn == plans[0].drawn for p in plans)
    assert plans[0].drawn == draw_members(ROSTER, 0.3, 11, 4) and len(plans[0].drawn) == 6
    assert plans[0].participants == plans[0].drawn
    body = {"roster": ROSTER, "participants": plans[0].drawn, "server": {}}
    assert announced_plan(alg, 11, 4, body).drawn == plans[0].drawn


def test_fraction_1_leaves_the_plan_as_before(make_method):
    for name in ("fedavg", "criticalfl"):
        alg = make_method(name)
        server = alg.initial_server_state(ROSTER)
        plan = draw_plan(alg, 3, 2, ROSTER, server)
        assert plan.drawn is None
        rng = np.random.default_rng([3, 2, 0x5E1EC7])  # the method's own draw, untouched
        assert plan.participants == alg.participants(server, ROSTER, 2, rng)


def test_criticalfl_draws_its_participants_among_the_drawn(make_method):
    alg = make_method("criticalfl", {"fraction": 0.5, "initial_fraction": 0.2})
    server = alg.initial_server_state(ROSTER)  # k0 = 4 of 20
    plan = draw_plan(alg, 5, 1, ROSTER, server)
    assert len(plan.drawn) == 10 and len(plan.participants) == 4
    assert set(plan.participants) <= set(plan.drawn)


def test_every_centralized_method_has_the_knob_once():
    for name in CENTRALIZED:
        cls = get_algorithm(name)
        assert issubclass(cls.Params, CentralizedParams), name
        assert validate_params(name, {})["fraction"] == 1.0
        assert validate_params(name, {"fraction": 0.25})["fraction"] == 0.25
        for bad in (0, -0.1, 1.5, "x"):
            with pytest.raises(ValueError, match="params.fraction"):
                validate_params(name, {"fraction": bad})
    assert "fraction" not in validate_params("uapdfl", {})


def test_a_plugin_method_gets_the_knob_mixed_into_its_params():
    class MineParams(Params):
        knob: int = Field(3, ge=0)

    class Mine(FedAvg):
        name = "mine-fraction-test"
        Params = MineParams

    class Bare(CentralizedAlgorithm):  # no Params of its own
        name = "bare-fraction-test"

        def aggregate(self, uploads, server, roster, round_no):
            raise NotImplementedError

        def apply(self, received, announcement):
            return {}

    assert Mine.Params.model_validate({"fraction": 0.5, "knob": 1}).model_dump() == {
        "knob": 1,
        "fraction": 0.5,
    }
    assert Mine.Params.__name__ == "MineParams"
    assert Bare.Params is CentralizedParams


def _topology(overrides):
    return load_topology(
        "topologies/synthetic.yaml", ["algorithm.name=fedavg", "algorithm.params={}", *overrides]
    )


def test_load_refuses_a_fraction_too_small_for_the_robust_rule():
    cfg = _topology(["nodes=10", "defence.rule=multikrum", "algorithm.params.fraction=0.3"])
    with pytest.raises(ConfigError) as err:
        check_defence(cfg, "swarm.yaml")
    msg = str(err.value)
    assert "swarm.yaml: algorithm.params.fraction:" in msg
    assert "draws 3 of the 10 nodes" in msg and "multikrum" in msg and "n = 3, f = 1" in msg
    check_defence(
        _topology(["nodes=10", "defence.rule=multikrum", "algorithm.params.fraction=0.5"])
    )
    check_defence(_topology(["nodes=10", "algorithm.params.fraction=0.1"]))  # clip: n >= 1
    # a rule that does not fit even every node is reported on the rule, as before
    cfg = _topology(["nodes=3", "defence.rule=bulyan", "algorithm.params.fraction=0.5"])
    with pytest.raises(ConfigError, match="defence.rule: bulyan"):
        check_defence(cfg)


# ----------------------------------------------------------------------------- the swarm


def _swarm_cfg(broker, ids, overrides=()):
    cfg = _topology(
        [
            "rounds=3",
            "dataset.synthetic_train=400",
            "dataset.synthetic_test=200",
            "timing.round_timeout_s=5",
            "timing.linger_s=5",
            *overrides,
        ]
    )
    return cfg.model_copy(
        update={
            "nodes": [n for n in cfg.nodes if n.id in ids],
            "broker": cfg.broker.model_copy(update={"host": broker.host, "port": broker.port}),
        }
    )


@pytest.mark.integration
@pytest.mark.one_broker
@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "audited"])
async def test_only_the_drawn_members_train_and_upload(broker, tmp_path, signed):
    """Fraction 0.5 of four members: each round two are drawn, the same two at every node;
    only they train and report, the aggregator pulls and aggregates their uploads only, and
    the other two record that they sat the round out yet receive and evaluate the global
    model. The run completes every round. Signed, every round is audited (the auditor may
    be a member that sat the round out) and every verdict is ``ok``."""
    ids = ["a", "b", "c", "d"]
    cfg = _swarm_cfg(broker, ids, ["algorithm.params.fraction=0.5"])
    if signed:
        from p2pfl.security.certs import make_swarm_certs

        make_swarm_certs(tmp_path / "certs", cfg.name, cfg.node_ids)
        security = cfg.security.model_copy(update={"sign": True, "certs": str(tmp_path / "certs")})
        cfg = cfg.model_copy(update={"security": security})
    nodes = {nid: Node(cfg, nid, NodeOptions(out_dir=tmp_path)) for nid in ids}
    results = await asyncio.wait_for(asyncio.gather(*(n.run() for n in nodes.values())), 120)
    records = dict(zip(nodes, results, strict=True))
    for r in range(1, cfg.rounds + 1):
        recs = {nid: next(x for x in rs if x["round"] == r) for nid, rs in records.items()}
        drawn = draw_members(ids, 0.5, cfg.seed, r)
        assert len(drawn) == 2
        for nid, rec in recs.items():
            assert rec["drawn"] == drawn, (nid, r)
            assert rec["sat_out"] is (nid not in drawn)
            assert rec["participated"] is (nid in drawn)
            assert (rec["train_loss"] is None) is (nid not in drawn)
            assert rec["aggregated"] == drawn  # only the drawn uploaded
            assert rec["received"] is True or nid == rec["aggregator"]
            assert 0.0 <= rec["test_acc"] <= 1.0
        agg = recs[recs["a"]["aggregator"]]
        assert not agg["upload_failed"]
        if signed:
            assert all(rec["audit"]["verdict"] == "ok" for rec in recs.values()), r
    assert all([x["round"] for x in rs] == [1, 2, 3] for rs in records.values())
