"""Where a decentralized node about to run a round skips to (docs/wire.md, "Rounds and
catch-up"): :meth:`PeerView.catch_up_to` reads the neighbours' presence only; and the pace
of the round it catches up to (``timing.catch_up_training: paced``): it trains for its
previous round's time divided by the rounds its neighbours ran meanwhile, on a node's real
round driver."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
from test_robust_services import services

from p2pfl.learning.train import catch_up_budget_s
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


def test_the_budget_is_one_of_the_swarms_rounds():
    assert catch_up_budget_s(30.0, 10) == 3.0
    assert catch_up_budget_s(30.0, 1) is None  # not slower than its neighbours: whole
    assert catch_up_budget_s(30.0, 0) is None and catch_up_budget_s(30.0, -2) is None


STEP_S = 0.1  # each training step of the test's node lasts at least this long


def _slow_steps(svc) -> None:
    """Every optimizer step of ``svc``'s node takes at least :data:`STEP_S` (a slow device
    whose time is real, not emulated)."""
    import time

    method, hook = svc.method, svc.method.step_hook()

    def slow(model):
        time.sleep(STEP_S)
        if hook is not None:
            hook(model)

    method.step_hook = lambda: slow  # type: ignore[method-assign]


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
    """Node a runs round 1 while its neighbours run the whole run (ten times its pace, at
    least: they report round 10, then done): it catches up to the last round and trains
    it for a twelfth of its round 1's time, a few of its steps. ``full``: the whole round."""
    svc = services(["timing.mode=async", f"rounds={ROUNDS}", f"timing.catch_up_training={mode}"])
    _slow_steps(svc)
    trained = _swarm_moves(svc, {1: {"status": "done", "round": ROUNDS}})
    await AsyncDecentralizedRounds(svc).run()

    full = svc.training.round_steps()
    records = {r["round"]: r for r in svc.ledger.records}
    assert sorted(records) == [1, ROUNDS] and records[ROUNDS]["caught_up_from"] == 2
    assert trained[0] == (1, full) and full >= 10
    if mode == "full":
        assert trained == [(1, full), (ROUNDS, full)]
        assert not any("catch_up_pace" in r for r in records.values())
        return
    pace = records[ROUNDS]["catch_up_pace"]
    # one of the neighbours' rounds as a saw them: round 1's time (and its record) / 12
    assert pace["swarm_rounds"] == ROUNDS and pace["of"] == full
    assert records[1]["round_s"] / ROUNDS <= pace["budget_s"] + 1e-3 < records[1]["round_s"] / 2
    # round 1's steps took at least full × STEP_S: a twelfth of round 1 is fewer steps
    # unless the rest of round 1 took eleven times as long as its training
    (_, steps), *_ = [t for t in trained if t[0] == ROUNDS]
    assert pace["steps"] == steps and 1 <= steps < full, (pace, full, records[1]["round_s"])
    assert "catch_up_pace" not in records[1]
    assert all(math.isfinite(r["train_loss"]) for r in records.values())
