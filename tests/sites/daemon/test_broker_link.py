"""A site daemon's link tells what the broker held for its subscription from what is
published live (the MQTT retain flag), and a run's commit turn waits for the retained
messages, not for a spec heard live after them (p2pfl/sites/consent/run_agreement.py)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import aiomqtt
import pytest

from p2pfl.sites.consent.run_agreement import SETTLE_S, RunAgreement
from p2pfl.sites.daemon import broker_link
from p2pfl.sites.daemon.broker_link import BrokerLink


@pytest.mark.integration
async def test_retained_at_moves_on_retained_messages_only(broker, monkeypatch):
    ticks = iter(range(1, 1000))  # the link's clock: each reading one tick later
    monkeypatch.setattr(broker_link, "time", SimpleNamespace(monotonic=lambda: next(ticks)))
    host, port = broker.address.rsplit(":", 1)
    async with aiomqtt.Client(host, int(port)) as other:
        await other.publish("p2pfl/fed/sites/spec/held", b"held", qos=1, retain=True)
        link = BrokerLink("fed", "s1", broker.address, None, None)
        heard: asyncio.Queue[tuple[str, float, bool]] = asyncio.Queue()
        runs = asyncio.ensure_future(
            link.run(lambda t, _: heard.put_nowait((t, link.retained_at, link.retained)))
        )
        try:
            # read at the link's creation (1), its subscription (2), the held message (3)
            topic, at, retained = await asyncio.wait_for(heard.get(), 30)
            assert topic.endswith("/held") and at == 3 and retained
            await other.publish("p2pfl/fed/sites/spec/live", b"live", qos=1, retain=True)
            topic, at, retained = await asyncio.wait_for(heard.get(), 30)
            assert topic.endswith("/live") and at == 3 and not retained  # published now
        finally:
            runs.cancel()
            await asyncio.gather(runs, return_exceptions=True)
            for name in ("held", "live"):
                await other.publish(f"p2pfl/fed/sites/spec/{name}", b"", qos=1, retain=True)


def test_a_spec_heard_live_after_the_retained_messages_is_settled_at_once():
    now = time.monotonic()
    link = SimpleNamespace(retained_at=now)
    agreement = RunAgreement(SimpleNamespace(name="s1", link=link), None, None, None)
    spec_now = SimpleNamespace(heard_at=now)
    # the broker sent retained messages just now: one of them may be this run's commit
    assert not agreement._settled(spec_now)
    assert agreement._settled(SimpleNamespace(heard_at=now - SETTLE_S - 0.1))
    # none for SETTLE_S: a spec heard now came live, after every retained one
    link.retained_at = now - SETTLE_S - 0.1
    assert agreement._settled(spec_now)
