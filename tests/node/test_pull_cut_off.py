"""A pull whose peer is found cut off while it runs is abandoned then, not after its
timeout (docs/wire.md, "Partitions"); on the services' handlers, with a real, unconnected
transport whose transfers stand for a link that went silent."""

from __future__ import annotations

import asyncio
import time

import pytest
from services_helpers import offline_services

from p2pfl.config.load import load_topology
from p2pfl.wire.transport import TransportError

TIMEOUT_S = 60.0  # what a silent link would cost: the test never waits this long


def _services():
    svc = offline_services(load_topology("topologies/synthetic.yaml"))
    reference = svc.method.model_state()
    started: dict[str, asyncio.Event] = {p: asyncio.Event() for p in ("b", "c", "d")}
    cancelled: list[str] = []

    async def pull(peer, round_no, part, timeout, attempt=0, max_bytes=None):
        started[peer].set()
        if peer == "c":  # across a live link: it arrives
            return dict(reference)
        try:  # across a link that went silent: nothing ever comes back
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(peer)
            raise

    svc.transport.pull = pull
    return svc, started, cancelled


async def test_pull_many_gives_up_on_a_peer_cut_off_mid_pull():
    svc, started, cancelled = _services()
    verdicts: dict[str, str | None] = {}

    async def cut_b_once_pulling() -> None:
        await started["b"].wait()
        verdicts["b"] = "unreachable"
        svc.notify()

    t0 = time.monotonic()
    cutter = asyncio.ensure_future(cut_b_once_pulling())
    pulled, failed = await asyncio.wait_for(
        svc.pull_many(
            {"b": "model", "c": "model"}, 1, TIMEOUT_S, cut_off=lambda p: verdicts.get(p)
        ),
        TIMEOUT_S / 2,
    )
    await cutter
    assert sorted(pulled) == ["c"]
    assert "b is cut off (unreachable)" in failed["b"]
    assert cancelled == ["b"]  # the transfer itself was stopped, not left running
    assert time.monotonic() - t0 < TIMEOUT_S / 2


async def test_without_a_verdict_the_pull_runs_its_course():
    svc, started, cancelled = _services()
    state = await svc.unless_cut_off("c", svc.transport.pull("c", 1, "model", 1.0), None, 1.0)
    assert state.keys() == svc.method.model_state().keys()
    # a peer never cut off: what the transfer gives (here: its own failure)
    svc.transport.pull = _failing
    with pytest.raises(TransportError, match="timed out"):
        await svc.unless_cut_off("b", svc.transport.pull("b", 1, "model", 0.1), lambda p: None, 0.1)
    assert cancelled == []


async def test_a_peer_already_cut_off_fails_at_once():
    svc, started, cancelled = _services()
    pull = svc.transport.pull("d", 1, "model", TIMEOUT_S)
    with pytest.raises(TransportError, match="d is cut off \\(offline\\)"):
        await asyncio.wait_for(
            svc.unless_cut_off("d", pull, lambda p: "offline", TIMEOUT_S), TIMEOUT_S / 2
        )
    assert cancelled == ["d"]


async def _failing(peer, round_no, part, timeout, attempt=0, max_bytes=None):
    await asyncio.sleep(timeout)
    raise TransportError(f"pull of {part!r} from {peer} timed out")


async def test_a_cancelled_wait_ends_even_as_a_notify_wakes_it():
    """The race that would keep the watch of a finished pull alive: the wait is woken and
    cancelled in the same turn of the loop. The cancellation wins."""
    svc, _started, _cancelled = _services()
    wait = asyncio.ensure_future(svc.wait_for(lambda: False, time.monotonic() + TIMEOUT_S))
    await asyncio.sleep(0.01)  # waiting on the event
    svc.notify()
    wait.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(wait, TIMEOUT_S / 2)
