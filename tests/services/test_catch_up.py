"""Where a decentralized node about to run a round skips to (docs/wire.md, "Rounds and
catch-up"): :meth:`PeerView.catch_up_to` reads the neighbours' presence only."""

from __future__ import annotations

from collections import Counter

from p2pfl.services.peers import LAG_ROUNDS, PeerView

ROUNDS = 12


def _view(presence: dict) -> PeerView:
    return PeerView("a", presence, Counter())


def test_a_node_in_step_runs_its_round_and_one_lag_rounds_behind_catches_up():
    presence = {"b": {"status": "online", "round": 4}, "c": {"status": "online", "round": 5}}
    view = _view(presence)
    assert view.catch_up_to(5, ["b", "c"], ROUNDS) is None  # c is one round ahead
    # c finished round 5 + LAG_ROUNDS - 1: a is LAG_ROUNDS behind it
    presence["c"]["round"] = 5 + LAG_ROUNDS - 1
    assert view.catch_up_to(5, ["b", "c"], ROUNDS) == 5 + LAG_ROUNDS
    # a peer LAG_ROUNDS ahead and within LAG_ROUNDS - 1 of the end sends a to the end
    near_end = ROUNDS - LAG_ROUNDS + 1
    presence["c"]["round"] = near_end
    assert view.catch_up_to(near_end - LAG_ROUNDS + 1, ["b", "c"], ROUNDS) == ROUNDS
    presence["c"]["round"] = near_end - 1
    assert view.catch_up_to(near_end - LAG_ROUNDS, ["b", "c"], ROUNDS) == near_end
    # an offline peer, however far ahead, is not followed
    presence["c"]["status"] = "offline"
    assert view.catch_up_to(5, ["b", "c"], ROUNDS) is None


def test_done_neighbours_send_a_node_far_from_the_end_to_the_last_round():
    presence = {"b": {"status": "done", "round": ROUNDS}, "c": {"status": "online", "round": 1}}
    view = _view(presence)
    # while c is online a goes on with it, however slow
    assert view.catch_up_to(2, ["b", "c"], ROUNDS) is None
    presence["c"] = {"status": "offline", "round": 1}
    assert view.catch_up_to(2, ["b", "c"], ROUNDS) == ROUNDS
    last_skip = ROUNDS - LAG_ROUNDS + 1
    assert view.catch_up_to(last_skip, ["b", "c"], ROUNDS) == ROUNDS
    # closer to the end than that, the node runs its last rounds
    for r in range(last_skip + 1, ROUNDS + 1):
        assert view.catch_up_to(r, ["b", "c"], ROUNDS) is None
    # a done peer that is not this node's neighbour does not count
    assert view.catch_up_to(2, ["c"], ROUNDS) is None


def test_a_done_peers_round_claim_is_not_read():
    """The run's length is the node's own: a done peer claiming round 10**6, a bool or a
    string neither moves the node past its last round nor breaks the view."""
    for claim in (10**6, True, "12", None):
        presence = {"b": {"status": "done", "round": claim}}
        assert _view(presence).catch_up_to(1, ["b"], ROUNDS) == ROUNDS
    # an online peer's absurd claim is bounded by the run's length too
    presence = {"b": {"status": "online", "round": 10**6}}
    assert _view(presence).catch_up_to(1, ["b"], ROUNDS) is None
