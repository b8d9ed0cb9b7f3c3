"""A fixed training budget (docs/wire.md, "Rounds and catch-up"), on a real swarm (node
processes, a real broker on loopback, synthetic data). Node ``c`` is made to lag by
construction: it is frozen (SIGSTOP) as soon as it is ready, until both its neighbours have
finished round 8 (the others' devices are emulated four times slower than this machine, so
they are still under way when it resumes). A freeze past the broker's keep-alive leaves c
reconnecting while it runs its first rounds alone, four times faster than they do: its
neighbours are LAG_ROUNDS + 5 rounds ahead, not LAG_ROUNDS, so that c still finds itself
behind when it hears them. A Local node never skips a round however far behind its
neighbours it runs; a method that keeps in step skips ahead, and the run's summary says so.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from rich.console import Console
from swarm_helpers import start_nodes, wait_round

from p2pfl.algorithms import get_algorithm
from p2pfl.config.topology import neighbours
from p2pfl.launch.swarm import finish_run, stop_workers, summary_table
from p2pfl.metrics import read_run, skipped_note
from p2pfl.services.peers import LAG_ROUNDS

pytestmark = [pytest.mark.integration, pytest.mark.one_broker]

ROUNDS = 20
SLOW = "c"  # on the ring a-b-c-d-a
FAST = ["a", "b", "d"]


def _run(tmp_path, broker, method_overrides: list[str]):
    """Start every node; freeze c from its ``ready`` until b and d have finished round 8;
    wait for all to exit; return the config, every node's records, the summary and the
    summary's console text."""
    overrides = [
        *method_overrides,
        f"rounds={ROUNDS}",
        "timing.linger_s=2",
        # b and d run well past c's freeze: rounds of a few tenths of a second at least
        "dataset.synthetic_train=2400",
        f"devices=[{{nodes: [{', '.join(FAST)}], speed: 0.25}}]",
    ]
    cfg, out, workers = start_nodes(tmp_path, broker, overrides)
    slow = workers[SLOW]
    try:
        deadline = time.monotonic() + 120
        while f"{SLOW}: ready after" not in slow.log_path.read_text(errors="replace"):
            assert time.monotonic() < deadline and slow.proc.poll() is None, "c never ready"
            time.sleep(0.05)
        os.killpg(slow.proc.pid, signal.SIGSTOP)
        try:
            for peer in neighbours(cfg, SLOW):
                wait_round(out, peer, LAG_ROUNDS + 5, 120)
        finally:
            os.killpg(slow.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 300
        for w in workers.values():
            w.proc.wait(max(1.0, deadline - time.monotonic()))
    finally:
        stop_workers(list(workers.values()), grace=2)
    logs = "".join(p.read_text() for p in (out / "logs").glob("*.log"))
    assert all(w.proc.returncode == 0 for w in workers.values()), logs[-3000:]
    assert "Traceback" not in logs
    console = Console(record=True, width=300)
    summary = finish_run(cfg, out, None, console)
    console.print(summary_table(summary))
    return cfg, read_run(out), summary, console.export_text()


def _lagged(cfg, records: dict[str, list[dict]]) -> list[tuple[int, str, int]]:
    """The rounds ``r`` the slow node began while a neighbour still under way had already
    finished round ``r + LAG_ROUNDS - 1`` or later: where a node that keeps in step joins
    late or catches up (:meth:`~p2pfl.services.peers.PeerView.behind`). ``(r, neighbour, its round)`` each."""
    out = []
    for rec in records[SLOW]:
        start = rec["t"] - rec["round_s"]
        for peer in neighbours(cfg, SLOW):
            done = [p["round"] for p in records[peer] if p["t"] <= start]
            still_running = records[peer][-1]["t"] > start
            if done and still_running and max(done) >= rec["round"] + LAG_ROUNDS - 1:
                out.append((rec["round"], peer, max(done)))
    return out


def test_local_never_skips_a_round_under_a_forced_lag(tmp_path, broker):
    assert get_algorithm("local").keeps_in_step is False
    cfg, records, summary, console = _run(
        tmp_path, broker, ["algorithm.name=local", "algorithm.params={}"]
    )
    for nid, recs in records.items():  # every node trained every one of its rounds
        assert [r["round"] for r in recs] == list(range(1, ROUNDS + 1)), nid
        assert not any("caught_up_from" in r for r in recs), nid
        assert all(r["train_s"] > 0 for r in recs), nid
    # the lag was real: the slow node began rounds while a running neighbour was
    # LAG_ROUNDS or more ahead, where a method that keeps in step skips ahead
    lagged = _lagged(cfg, records)
    assert lagged and lagged[0][0] <= 2, [(r["round"], r["t"]) for r in records[SLOW]]
    assert summary["nodes_completed"] == 4
    assert summary["rounds_skipped"] == {"total": 0, "per_node": {}}
    assert skipped_note(summary) is None
    assert "node-rounds skipped" in console


def test_a_method_that_skips_says_so_in_its_summary(tmp_path, broker):
    # UA-PDFL in asynchronous rounds keeps in step (and its fast nodes do not wait for c):
    # c catches up whenever it falls LAG_ROUNDS behind
    assert get_algorithm("uapdfl").keeps_in_step is True
    cfg, records, summary, _ = _run(
        tmp_path, broker, ["algorithm.name=uapdfl", "algorithm.params={}", "timing.mode=async"]
    )
    slow = [r["round"] for r in records[SLOW]]
    # c skipped: it caught up, or, frozen before its first round began (a node makes its
    # first optimizer's imports between ready and round 1), it joined late
    skipped = slow[0] > 1 or any("caught_up_from" in r for r in records[SLOW])
    assert slow[-1] == ROUNDS and skipped, slow
    # every node that skipped (c, and any other that fell behind under the machine's load)
    # is counted, with the rounds it has no record of
    gaps = {nid: ROUNDS - len(recs) for nid, recs in records.items() if len(recs) < ROUNDS}
    assert all(recs[-1]["round"] == ROUNDS for recs in records.values())
    assert gaps[SLOW] == ROUNDS - len(slow) > 0
    assert summary["rounds_skipped"] == {"total": sum(gaps.values()), "per_node": gaps}
    note = skipped_note(summary)
    assert note is not None
    assert f"{sum(gaps.values())} of {4 * ROUNDS} node-rounds skipped" in note
    assert f"{SLOW} {gaps[SLOW]}" in note
