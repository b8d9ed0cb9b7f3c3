"""A site's policy over the runs proposed to it (:mod:`p2pfl.sites.policy.rules`): each rule
refuses with its reason code, the defaults admit every run, DP the site requires is the
site's own ε whatever the run asks, and the digest names the policy, however written."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from p2pfl.algorithms import SHARE_KINDS, get_algorithm, known_algorithms
from p2pfl.sites.policy.rules import REASON_CODES, Policy, RunFacts, decide, policy_digest

RUN = RunFacts(
    proposer="hospital-a",
    method="fedavg",
    shares=frozenset({"whole_weights"}),
    data="ward",
    rounds=20,
    min_accept=2,
    members=("hospital-a", "hospital-b", "hospital-c"),
)
BINDINGS = frozenset({"ward", "icu"})


def _decide(policy: dict, **change):
    return decide(
        dataclasses.replace(RUN, **change),
        Policy.model_validate(policy),
        bindings=BINDINGS,
    )


def test_the_default_policy_admits_a_run():
    d = _decide({})
    assert (d.vote, d.reasons, d.dp_epsilon) == ("accept", (), None)
    assert d.policy == policy_digest(Policy())


@pytest.mark.parametrize(
    "policy, change, code",
    [
        ({"proposers": ["hospital-c"]}, {}, "proposer_not_allowed"),
        ({"methods": {"allow": ["uapdfl"]}}, {}, "method_not_allowed"),
        ({"code": {"plugins": "deny"}}, {"plugins": True}, "plugins_denied"),
        ({}, {"data": "genomes"}, "unknown_binding"),
        ({"data": {"icu": {}}}, {}, "data_not_allowed"),
        ({"data": {"ward": {"methods": ["fedper"]}}}, {}, "data_not_allowed"),
        ({"share": ["shared_part"]}, {}, "share_not_allowed"),
        (
            {"share": ["whole_weights"]},
            {"shares": frozenset({"representations"})},
            "share_not_allowed",
        ),
        ({"privacy": {"require_secagg": True}}, {}, "secagg_required"),
        ({"privacy": {"min_members": 4}}, {}, "too_few_members"),
        ({"privacy": {"min_members": 3}}, {"members": None}, "too_few_members"),  # any: min_accept
        ({"peers": {"deny": ["hospital-c"]}}, {}, "denied_peer"),
        ({"resources": {"max_rounds": 10}}, {}, "too_many_rounds"),
    ],
)
def test_each_rule_refuses_with_its_reason(policy, change, code):
    d = _decide(policy, **change)
    assert d.vote == "reject" and [r.code for r in d.reasons] == [code]
    assert code in REASON_CODES and d.reasons[0].detail


def test_every_failing_rule_is_a_reason():
    d = _decide({"methods": {"allow": ["local"]}, "resources": {"max_rounds": 5}})
    assert [r.code for r in d.reasons] == ["method_not_allowed", "too_many_rounds"]


def test_whole_weights_include_the_shared_part():
    d = _decide({"share": ["whole_weights"]}, method="fedper", shares=frozenset({"shared_part"}))
    assert d.vote == "accept"
    assert _decide({"share": []}, method="local", shares=frozenset()).vote == "accept"


def test_a_site_requiring_dp_trains_under_its_own_bound_whatever_the_run_asks():
    rule = {"privacy": {"require_dp": True, "max_epsilon": 8}}
    assert _decide(rule).dp_epsilon == 8  # the run asked for no DP
    assert _decide(rule, dp_epsilon=20.0).dp_epsilon == 8  # it asked for more
    assert _decide(rule, dp_epsilon=2.0).dp_epsilon == 2.0  # less is kept
    assert _decide(rule).vote == "accept"
    with pytest.raises(ValidationError, match="require_dp needs max_epsilon"):
        Policy.model_validate({"privacy": {"require_dp": True}})


def test_manual_approval_holds_a_passing_run_at_the_vote_only():
    d = _decide({"approve": "manual"})
    assert d.vote == "pending" and [r.code for r in d.reasons] == ["manual_approval"]
    assert _decide({"approve": "manual", "resources": {"max_rounds": 1}}).vote == "reject"
    policy = Policy(approve="manual")
    assert decide(RUN, policy, bindings=BINDINGS, stage="commit").vote == "accept"


def test_hours_are_checked_every_round():
    policy = Policy.model_validate({"resources": {"max_hours": 2}})
    ok = decide(RUN, policy, bindings=BINDINGS, stage="round", hours_trained=1.5)
    over = decide(RUN, policy, bindings=BINDINGS, stage="round", hours_trained=2.5)
    assert ok.vote == "accept" and [r.code for r in over.reasons] == ["over_time"]


def test_the_digest_names_the_policy_however_written():
    a = Policy.model_validate({"methods": {"allow": ["fedavg"]}})
    b = Policy.model_validate(
        {"methods": {"allow": ["fedavg"]}, "approve": "auto", "share": list(SHARE_KINDS)}
    )
    assert policy_digest(a) == policy_digest(b) != policy_digest(Policy())
    assert len(policy_digest(a)) == 32


def test_a_typo_in_a_policy_is_an_error():
    with pytest.raises(ValidationError):
        Policy.model_validate({"method": {"allow": ["fedavg"]}})
    with pytest.raises(ValidationError):
        Policy.model_validate({"share": ["everything"]})


def test_the_decision_as_a_record():
    rec = _decide({"peers": {"deny": ["hospital-a"]}}).as_record()
    assert rec["vote"] == "reject" and rec["reasons"][0]["code"] == "denied_peer"
    assert set(rec) == {"vote", "reasons", "policy", "dp_epsilon"}


def test_every_method_declares_what_it_shares():
    """``share`` is checked against a method's declaration: every built-in method makes
    one of the kinds a policy names, and a centralized method that uploads only g declares
    the shared part alone."""
    assert Policy().share == list(SHARE_KINDS)  # the default lets every kind leave
    for name in known_algorithms():
        cls = get_algorithm(name)
        assert cls.shares <= set(SHARE_KINDS), name
        part = getattr(cls, "upload_part", None)
        if part == "g":
            assert cls.shares == {"shared_part"}, name
        elif part == "all":
            assert "whole_weights" in cls.shares, name
    assert get_algorithm("local").shares == frozenset()
    assert "representations" in get_algorithm("uapdfl").shares
