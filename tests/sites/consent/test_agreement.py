"""The pure rules of propose, vote, commit (:mod:`p2pfl.sites.consent.agreement`)."""

from __future__ import annotations

import pytest

from p2pfl.sites.consent.agreement import (
    commit_grace_s,
    committers,
    decided,
    out_of_reach,
    rank,
    tally,
    winning_commit,
)


def test_a_run_commits_with_every_accepting_site():
    votes = {"a": "accept", "b": "reject", "c": "accept", "d": "pending"}
    assert tally(votes, 2).members == ("a", "c") and tally(votes, 2).aborted is None
    assert tally(votes, 1, members=["a", "b"]).members == ("a",)  # c is not asked


def test_too_few_accepting_sites_abort_the_run_with_the_reason():
    t = tally({"a": "accept", "b": "reject", "d": "pending"}, 2)
    assert t.members == () and t.aborted == "1 of the 2 accepting sites needed (1 still pending: d)"


def test_every_site_names_the_same_fallback_committer():
    order = committers("r1", "a", ["c", "b", "a", "d"])
    assert order[0] == "a" and sorted(order) == ["a", "b", "c", "d"]
    assert order == committers("r1", "a", ["d", "a", "b", "c"])  # whatever the order heard
    assert [rank("r1", s) for s in order[1:]] == sorted(rank("r1", s) for s in order[1:])
    other = committers("r2", "a", ["b", "c", "d"])
    assert set(other) == set(order)  # another run, another order (in general)


def test_of_two_commits_the_first_ranked_committers_stands():
    order = committers("r1", "a", ["a", "b", "c", "d"])
    both = {order[2]: ("b", "c"), order[1]: ("a", "b")}
    assert winning_commit("r1", "a", both) == order[1]
    assert winning_commit("r1", "a", {**both, "a": ("a",)}) == "a"  # the proposer's first
    with pytest.raises(ValueError):
        winning_commit("r1", "a", {})


def test_an_abort_names_the_sites_that_did_not_vote_in_time():
    named = tally({"a": "accept"}, 2, members=["a", "b", "c"])
    assert named.aborted == "1 of the 2 accepting sites needed; no vote in time from b, c"
    heard = tally({"a": "accept", "b": "reject"}, 2, expected={"a", "b", "z"})
    assert heard.aborted is not None and heard.aborted.endswith("no vote in time from z")
    assert tally({"a": "accept", "b": "accept"}, 2, expected={"z"}).aborted is None


def test_a_run_out_of_reach_is_known_before_its_deadline():
    named = ["a", "b", "c"]
    assert out_of_reach({"a": "accept", "b": "reject"}, 2, named) is None  # c may accept
    assert out_of_reach({"b": "reject", "c": "pending"}, 2, named) is None  # c may still
    why = out_of_reach({"a": "accept", "b": "reject", "c": "reject"}, 2, named)
    assert why == "2 of the 3 sites asked rejected it (b, c): at most 1 may accept, 2 needed"
    assert out_of_reach({"b": "reject", "z": "reject"}, 3, named) is not None  # z not asked
    assert out_of_reach({"b": "reject", "z": "reject"}, 2, named) is None
    # open to any site: one not heard yet may accept, however many rejected
    assert out_of_reach({"a": "reject", "b": "reject", "c": "reject"}, 2, None) is None


def test_a_run_is_decided_before_its_deadline_once_every_site_it_names_has_voted():
    named = ["a", "b", "c"]
    assert not decided({"a": "accept", "b": "accept"}, 2, named)  # c may still accept
    assert not decided({"a": "accept", "b": "accept", "c": "pending"}, 2, named)  # its operator
    assert decided({"a": "accept", "b": "accept", "c": "reject"}, 2, named)
    assert decided({"a": "accept", "b": "reject", "c": "reject", "x": "accept"}, 1, named)
    # open to any site: its quorum of accepts decides it (the proposer then waits a grace)
    assert not decided({"a": "accept", "b": "reject"}, 2, None)
    assert decided({"a": "accept", "b": "accept"}, 2, None)
    # its proposer waits a grace for the sites it heard from that have not voted
    assert (commit_grace_s(3), commit_grace_s(20), commit_grace_s(600)) == (2.0, 5.0, 10.0)
