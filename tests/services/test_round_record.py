"""A round's record (docs/architecture.md, "Round records"): ``Ledger.round_record``
fills the fields both drivers share, the driver's own go beside them, and whatever a method
returns lands under ``method``: a method's fact named like a record's field (``test_acc``,
``round``, ``rejected``, ``t``) never changes that field."""

from __future__ import annotations

import math
from typing import Any

import pytest
from test_robust_services import services

from p2pfl.learning.train import TrainResult, round_lr
from p2pfl.metrics import ROUND_FIELDS, method_facts
from p2pfl.rounds.gossip.decentralized import DecentralizedRounds
from p2pfl.services.ledger import RECORD_FIELDS
from p2pfl.services.training import TrainOutcome

# what a careless (or hostile) method could return: the names of the record's own fields
IMPOSTOR = {
    "round": 99,
    "test_acc": 2.0,
    "test_loss": -1.0,
    "peers": ["zz"],
    "dropped_total": -5,
    "diverged": {"merged_from": ["zz"]},
    "t": -1.0,
    "method": "not a map",
}


async def test_a_method_cannot_change_the_drivers_fields_of_a_decentralized_round():
    svc = services()
    alg = svc.method
    calls: list[str] = []

    async def no_broker(*_args: Any, **_kw: Any) -> None:  # gossip goes nowhere: no peer
        calls.append("gossip")

    async def refused(parts, round_no, timeout, **_kw):  # admission refuses c's state
        calls.append(f"pull {sorted(parts)}")
        svc.robust.reject("c", "non-finite values", round_no)
        return {}, {}

    svc.exchange.transport.gossip = no_broker  # type: ignore[method-assign]
    svc.exchange.pull_many = refused  # type: ignore[method-assign]

    def plan(gossip):
        facts = {**IMPOSTOR, "rejected": {"zz": "a plan fact"}, "dropout": True, "seen": 1}
        return {"c": "all"}, facts

    def merge(gossip, pulled):
        # the states this merge left out: robustness facts, they join ``rejected``
        return {"test_acc": 3.0, "rejected": {"b": "the method left it out"}, "merged_from": []}

    def after_train():
        return {"round": 77, "lr": 123.0, "regrown": 4}

    alg.plan, alg.merge, alg.after_train = plan, merge, after_train  # type: ignore[method-assign]
    rec = await DecentralizedRounds(svc).run_round(1)

    assert calls == ["gossip", "pull ['c']"]
    assert rec["round"] == 1 and 0.0 <= rec["test_acc"] <= 1.0 and rec["test_loss"] >= 0
    assert rec["peers"] == [] and rec["chosen"] == [] and rec["pulled"] == {}
    assert rec["diverged"] is None and rec["dropped_total"] >= 1 and rec["t"] > 1e9
    assert rec["lr"] == round_lr(svc.cfg.training, 1) and math.isfinite(rec["train_loss"])
    # the method's own refusals joined the round's, admission's kept
    assert rec["rejected"] == {"c": "non-finite values", "b": "the method left it out"}
    assert rec["distrusted"] == {"b": 4, "c": 4}
    assert rec["dropout"] is True  # UA-PDFL's fact, copied to the top level by the driver
    for key in ROUND_FIELDS:
        assert key in rec, key
    # everything the method said is under "method", later facts replacing earlier ones
    assert rec["method"] == {
        **IMPOSTOR,
        "rejected": {"zz": "a plan fact"},  # the plan's: not a robustness fact
        "dropout": True,
        "seen": 1,
        "test_acc": 3.0,  # merge's, after the plan's
        "merged_from": [],
        "round": 77,  # after_train's, last
        "lr": 123.0,
        "regrown": 4,
    }
    assert method_facts(rec) is rec["method"]
    assert not (set(rec) - RECORD_FIELDS - {"chosen", "missing", "pulled", "pull_failed"})


def test_a_centralized_round_record_nests_server_rule_and_apply_facts():
    svc = services()
    svc.robust.begin_round(3)
    meter = svc.ledger.meter()
    rec = svc.ledger.round_record(
        3,
        meter=meter,
        evaluated=(0.75, 0.5),
        lr=0.01,
        trained=None,  # an observer, or a member that was not drawn: it did not train
        comm_s=1.23456,
        peers=["b", "c"],
        driver={"aggregator": "a", "attempt": 0, "aggregate_error": None},
        method=({"agg_test_acc": 0.0, "agg_rejected": {"b": "x"}}, {**IMPOSTOR, "prox_dist": 1.5}),
    )
    assert (rec["round"], rec["test_acc"], rec["test_loss"], rec["lr"]) == (3, 0.75, 0.5, 0.01)
    assert rec["train_loss"] is None and rec["train_ce"] is None and rec["train_s"] == 0.0
    assert rec["comm_s"] == 1.2346 and rec["peers"] == ["b", "c"] and rec["diverged"] is None
    assert rec["rejected"] == {} and rec["dropout"] is False  # the method said nothing of it
    assert rec["aggregator"] == "a" and rec["attempt"] == 0
    assert rec["method"] == {
        "agg_test_acc": 0.0,
        "agg_rejected": {"b": "x"},
        **IMPOSTOR,
        "prox_dist": 1.5,
    }


def test_trained_facts_come_last_and_a_rollback_is_the_drivers():
    svc = services()
    svc.robust.begin_round(2)
    nan = float("nan")
    result = TrainResult(loss=nan, ce_loss=nan, steps=1, seconds=0.123456, grad_sq_sum=nan)
    trained = TrainOutcome(
        result, 0.05, {"dropout": "yes", "x": 2}, {"merged_from": ["b"], "rolled_back_to": 1}
    )
    rec = svc.ledger.round_record(
        2,
        meter=svc.ledger.meter(),
        evaluated=(0.5, 1.0),
        lr=trained.lr,
        trained=trained,
        comm_s=0.0,
        peers=[],
        method=({"x": 1}, None, "not a map"),  # what is not a map is no fact
    )
    assert rec["method"] == {"x": 2, "dropout": "yes"}
    assert rec["dropout"] is False  # only a True dropout is one
    assert rec["diverged"] == {"merged_from": ["b"], "rolled_back_to": 1}
    assert rec["train_s"] == 0.1235 and math.isnan(rec["train_loss"])


def test_a_driver_field_may_not_be_a_shared_one():
    svc = services()
    with pytest.raises(ValueError, match=r"\['test_acc'\]"):
        svc.ledger.round_record(
            1,
            meter=svc.ledger.meter(),
            evaluated=(0.5, 1.0),
            lr=0.1,
            trained=None,
            comm_s=0.0,
            peers=[],
            driver={"test_acc": 1.0, "chosen": []},
        )


def test_method_facts_reads_this_layout_and_an_older_runs():
    assert method_facts({"round": 1, "method": {"h_peers": ["a"]}}) == {"h_peers": ["a"]}
    old = {"round": 1, "h_peers": ["b"], "dropout": True}  # facts at the top level then
    assert method_facts(old) is old
