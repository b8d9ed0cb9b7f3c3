"""Publishing status telemetry (docs/wire.md, "Status telemetry") never breaks or delays a
round: ``Ledger.publish_status`` swallows every failure, and the transport skips the
publish while it has no broker instead of waiting for one."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import torch

from p2pfl.check.load import load_topology
from p2pfl.services.ledger import Ledger
from p2pfl.wire.transport import Transport, TransportError


class _FailingTransport:
    """A transport whose every status publish fails, counting the tries."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, dict]] = []

    async def publish_status(self, round_no: int, body: dict) -> None:
        self.calls.append((round_no, body))
        raise TransportError("broker gone")


def _ledger(transport) -> Ledger:
    return Ledger(
        cfg=load_topology("topologies/synthetic.yaml"),
        node_id="a",
        transport=transport,
        robust=None,  # type: ignore[arg-type]  (telemetry never reads the round's facts)
        method=SimpleNamespace(model=torch.nn.Linear(2, 2)),  # type: ignore[arg-type]
        rng=None,  # type: ignore[arg-type]
    )


async def test_a_failing_publish_never_reaches_the_round(caplog):
    transport = _FailingTransport()
    svc = SimpleNamespace(ledger=_ledger(transport))
    with caplog.at_level(logging.DEBUG, logger="p2pfl.services.ledger"):
        svc.ledger.publish_status(
            1, "training"
        )  # returns at once: the publish runs in the background
        svc.ledger.publish_status(1, pull=("b", "g", 64))
        svc.ledger.publish_status(1, "sleeping")  # a caller's bug: logged, not raised
        svc.ledger.publish_status(1, pull=("x" * 100, "g", 1))  # an id too long for the body
        svc.ledger.publish_status(1)  # nothing to say
        for _ in range(5):
            await asyncio.sleep(0)
    assert transport.calls == [
        (1, {"event": "phase", "phase": "training"}),
        (1, {"event": "pull", "peer": "b", "part": "g", "bytes": 64}),
    ]
    assert not svc.ledger._status_tasks  # every task finished and was forgotten
    assert "broker gone" in caplog.text and "sleeping" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_an_unconnected_transport_skips_the_publish():
    transport = Transport("s", "a", "127.0.0.1", 1, connect_timeout=30)
    await asyncio.wait_for(transport.publish_status(1, {"event": "phase", "phase": "waiting"}), 1)
    assert transport.stats.messages_sent == 0
