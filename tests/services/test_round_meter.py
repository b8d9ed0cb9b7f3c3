"""A round's record reads the lanes of its own pulls from the transport's bounded log."""

from __future__ import annotations

from p2pfl.services.ledger import RoundMeter
from p2pfl.wire import transport as transport_mod
from p2pfl.wire.transport import Transport


def test_round_lanes_come_from_a_bounded_log(monkeypatch):
    monkeypatch.setattr(transport_mod, "PULL_LANES_KEPT", 4)
    t = Transport("s", "a", "127.0.0.1", 1)  # never connected: only its counters are used
    for i in range(6):  # an earlier round, beyond what the log keeps
        t._pulled(f"p{i}", "mqtt")
    assert len(t.pull_lanes) == 4 and t.pulls == 6
    meter = RoundMeter(t)
    assert meter.fields()["lanes"] == {}
    t._pulled("b", "direct")
    t._pulled("c", "mqtt")
    assert meter.fields()["lanes"] == {"b": "direct", "c": "mqtt"}
    for i in range(5):  # more pulls this round than the log holds: the latest are kept
        t._pulled(f"q{i}", "direct")
    assert meter.fields()["lanes"] == {f"q{i}": "direct" for i in range(1, 5)}
