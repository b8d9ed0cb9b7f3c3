"""The rotating aggregator: deterministic, rotating, and with a defined succession."""

from __future__ import annotations

import pytest

from p2pfl.rounds.rotation.election import aggregator_for, succession


def test_same_answer_whatever_the_order_of_members():
    a = aggregator_for(7, ["c", "a", "b"])
    assert a == aggregator_for(7, ["b", "c", "a", "a"]) == "b"  # sorted [a,b,c][7 % 3]


def test_rotates_every_round():
    members = ["n0", "n1", "n2", "n3"]
    assert [aggregator_for(r, members) for r in range(6)] == ["n0", "n1", "n2", "n3", "n0", "n1"]


def test_next_attempt_is_the_next_member():
    members = ["a", "b", "c"]
    assert aggregator_for(1, members, attempt=1) == "c"
    assert succession(1, members) == ["b", "c", "a"]
    # when b has left, attempt 0 of the new membership is no longer b
    assert aggregator_for(1, ["a", "c"]) == "c"


def test_errors():
    with pytest.raises(ValueError, match="no live members"):
        aggregator_for(1, [])
    with pytest.raises(ValueError):
        aggregator_for(-1, ["a"])


def test_succession_is_every_attempt_in_one_sort():
    """``succession`` lists ``aggregator_for`` of every attempt (it sorts once: it runs on
    every message of a round, on rosters of a thousand members)."""
    members = [f"n{i}" for i in (17, 3, 250, 42, 8, 99, 5)]
    for r in range(0, 20):
        assert succession(r, members) == [
            aggregator_for(r, members, a) for a in range(len(members))
        ]
    assert succession(4, []) == []
