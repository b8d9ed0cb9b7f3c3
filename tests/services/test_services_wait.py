"""``PeerView.wait_for``: a predicate re-checked at each notify, bounded by a deadline,
and ended by a cancellation (on the services' handlers, with a real, unconnected
transport)."""

from __future__ import annotations

import asyncio
import time

import pytest
from services_helpers import offline_services

from p2pfl.check.load import load_topology

TIMEOUT_S = 60.0  # what a lost cancellation would cost: the test never waits this long


def _services():
    return offline_services(load_topology("topologies/synthetic.yaml"))


async def test_a_wait_ends_when_a_notify_makes_its_predicate_true():
    svc = _services()
    state = {"ready": False}
    wait = asyncio.ensure_future(svc.peers.wait_for(lambda: state["ready"], time.monotonic() + 60))
    await asyncio.sleep(0.01)
    assert not wait.done()
    state["ready"] = True
    svc.peers.notify()
    assert await asyncio.wait_for(wait, 10) is True


async def test_a_wait_returns_false_at_its_deadline():
    svc = _services()
    assert await svc.peers.wait_for(lambda: False, time.monotonic() + 0.05) is False


async def test_a_cancelled_wait_ends_even_as_a_notify_wakes_it():
    """The wait is woken and cancelled in the same turn of the loop: the cancellation wins
    (``asyncio.wait_for`` before Python 3.12 returned normally, and the wait went on)."""
    svc = _services()
    wait = asyncio.ensure_future(svc.peers.wait_for(lambda: False, time.monotonic() + TIMEOUT_S))
    await asyncio.sleep(0.01)  # waiting on the event
    svc.peers.notify()
    wait.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(wait, TIMEOUT_S / 2)
