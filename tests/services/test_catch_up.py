"""Where a decentralized node about to run a round skips to (docs/wire.md, "Rounds and
catch-up"): :meth:`PeerView.catch_up_to` reads the neighbours' presence only; and the pace
of the round it catches up to: the neighbours' rounds during its previous one divide its
training steps (``timing.catch_up_training: paced``), on a node's real round driver."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
from test_robust_services import services

from p2pfl.learning.train import paced_steps
from p2pfl.rounds.gossip.asynchronous import AsyncDecentralizedRounds
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


def test_progress_is_the_furthest_neighbour_and_a_done_one_is_at_the_end():
    presence = {"b": {"status": "online", "round": 4}, "c": {"status": "offline", "round": 9}}
    view = _view(presence)
    assert view.progress(["b", "c"], ROUNDS) == 4  # an offline peer's round is not read
    assert view.progress([], ROUNDS) == 0
    presence["b"]["round"] = 10**6  # an absurd claim is bounded by the run's length
    assert view.progress(["b"], ROUNDS) == ROUNDS
    presence["b"] = {"status": "done", "round": 1}  # a done peer's claim is not read
    assert view.progress(["b", "c"], ROUNDS) == ROUNDS


def test_paced_steps_divide_a_round_by_the_swarms_rounds():
    assert paced_steps(60, 1) == paced_steps(60, 0) == 60
    assert paced_steps(60, 7) == 9  # ⌈60 / 7⌉
    assert paced_steps(3, 50) == 1  # never no training at all


def _swarm_moves(svc, during: dict[int, dict[str, Any]]) -> list[tuple[int, int]]:
    """Make the node's neighbours' presence jump to ``during[r]`` while it trains round
    ``r``; return ``(round, steps trained)`` of every training."""
    trained: list[tuple[int, int]] = []
    train = svc.training.train

    async def moving(round_no: int, **kw: Any):
        out = await train(round_no, **kw)
        trained.append((round_no, out.result.steps))
        for peer in svc.neighbours:
            if round_no in during:
                svc.exchange.transport.peers[peer] = dict(during[round_no])
        return out

    async def no_broker(*_args: Any, **_kw: Any) -> None:  # gossip and presence go nowhere
        return None

    svc.training.train = moving  # type: ignore[method-assign]
    transport = svc.exchange.transport
    transport.gossip = transport.set_status = no_broker  # type: ignore[method-assign]
    for peer in svc.neighbours:
        svc.exchange.transport.peers[peer] = {"status": "online", "round": 0}
    return trained


@pytest.mark.parametrize("mode", ["paced", "full"])
async def test_a_node_catches_up_at_its_neighbours_pace(mode):
    """Node a runs round 1 while its neighbours run five rounds: it catches up to round 6
    and trains a fifth of a round; it runs round 7 whole (they did not move); then they
    finish the run while it runs round 7, and it goes to round 12 (seven of their rounds
    since its round 7 began) at a seventh of a round. ``full``: whole rounds throughout."""
    svc = services(["timing.mode=async", f"rounds={ROUNDS}", f"timing.catch_up_training={mode}"])
    during = {1: {"status": "online", "round": 5}, 7: {"status": "done", "round": ROUNDS}}
    trained = _swarm_moves(svc, during)
    await AsyncDecentralizedRounds(svc).run()

    full = svc.training.round_steps()
    assert full >= 8  # so that a fifth and a seventh are fewer steps
    records = {r["round"]: r for r in svc.ledger.records}
    assert sorted(records) == [1, 6, 7, ROUNDS]
    assert records[6]["caught_up_from"] == 2 and records[ROUNDS]["caught_up_from"] == 8
    if mode == "full":
        assert trained == [(1, full), (6, full), (7, full), (ROUNDS, full)]
        assert not any("catch_up_pace" in r for r in records.values())
        return
    fifth, seventh = math.ceil(full / 5), math.ceil(full / 7)
    assert trained == [(1, full), (6, fifth), (7, full), (ROUNDS, seventh)]
    assert records[6]["catch_up_pace"] == {"swarm_rounds": 5, "steps": fifth, "of": full}
    assert records[ROUNDS]["catch_up_pace"] == {"swarm_rounds": 7, "steps": seventh, "of": full}
    assert "catch_up_pace" not in records[1] and "catch_up_pace" not in records[7]
    assert all(math.isfinite(r["train_loss"]) for r in records.values())
