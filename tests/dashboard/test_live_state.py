"""Status telemetry bodies (p2pfl/wire/status.py) and the dashboard's checks of every broker
message (p2pfl/dashboard/live.py): what is applied, and why the rest is dropped."""

from __future__ import annotations

import struct

import pytest

from p2pfl.dashboard.live import LiveState
from p2pfl.wire.envelope import SIGNED_MAGIC, Envelope
from p2pfl.wire.status import PHASES, check_status, phase_body, pull_body

SWARM = "s1"
IDS = ["a", "b", "c"]


def _env(sender: str, kind: str, body, *, swarm: str = SWARM, rnd: int = 1) -> bytes:
    return Envelope(swarm, sender, rnd, kind, "m" + sender + kind, body, ts=1.0).pack()


def _presence(sender: str, status: str, **info) -> bytes:
    return _env(sender, "presence", {"presence": {"node": sender, "status": status, **info}})


def _status(sender: str, body, **kw) -> bytes:
    return _env(sender, "status", body, **kw)


def _live() -> tuple[LiveState, list[float]]:
    clock = [100.0]
    return LiveState(SWARM, IDS, clock=lambda: clock[0]), clock


def test_status_bodies_round_trip_and_bad_ones_are_refused():
    for phase in PHASES:
        assert check_status(phase_body(phase)) == {"event": "phase", "phase": phase}
    assert pull_body("b", "g", 1234) == {"event": "pull", "peer": "b", "part": "g", "bytes": 1234}
    with pytest.raises(ValueError):
        phase_body("sleeping")
    bad = [
        None,
        [],
        "training",
        {},
        {"event": "phase"},
        {"event": "phase", "phase": "sleeping"},
        {"event": "phase", "phase": ["training"]},
        {"event": "pull", "peer": "b", "part": "g"},
        {"event": "pull", "peer": "b", "part": "g", "bytes": -1},
        {"event": "pull", "peer": "b", "part": "g", "bytes": True},
        {"event": "pull", "peer": "b", "part": "g", "bytes": 1.5},
        {"event": "pull", "peer": "", "part": "g", "bytes": 1},
        {"event": "pull", "peer": "x" * 65, "part": "g", "bytes": 1},
        {"event": "pull", "peer": "b", "part": "p" * 33, "bytes": 1},
        {"event": "explode"},
    ]
    for body in bad:
        with pytest.raises(ValueError):
            check_status(body)
    # unknown extra keys are not passed on
    assert check_status({"event": "phase", "phase": "waiting", "evil": 1}) == phase_body("waiting")


def test_live_state_applies_presence_phases_and_pulls():
    live, clock = _live()
    assert live.topics() == ["p2pfl/s1/presence/+", "p2pfl/s1/status/+"]
    assert live.handle("p2pfl/s1/presence/a", _presence("a", "online", round=2)) is None
    assert live.presence["a"].status == "online" and live.presence["a"].round == 2
    assert live.handle("p2pfl/s1/status/a", _status("a", phase_body("training"), rnd=3)) is None
    assert live.phases["a"].phase == "training" and live.phases["a"].round == 3
    assert live.handle("p2pfl/s1/status/a", _status("a", pull_body("b", "g", 10))) is None
    clock[0] += 5
    assert live.handle("p2pfl/s1/status/a", _status("a", pull_body("c", "all", 20))) is None
    assert [(p.src, p.dst, p.part, p.nbytes, p.seq) for p in live.pulls] == [
        ("b", "a", "g", 10, 1),
        ("c", "a", "all", 20, 2),
    ]
    assert [p.src for p in live.recent_pulls(2.0)] == ["c"]
    # a presence with a round that is not a round is kept, without the round
    assert live.handle("p2pfl/s1/presence/b", _presence("b", "done", round="x")) is None
    assert live.presence["b"].round is None
    assert live.accepted == 5 and not live.dropped


def test_live_state_drops_what_is_off_and_says_why():
    live, _ = _live()
    good = _status("a", phase_body("training"))
    signed_header = Envelope(SWARM, "a", 1, "status", "x1", phase_body("waiting")).pack()
    signed = SIGNED_MAGIC + struct.pack("<I", len(signed_header)) + signed_header + bytes(64)
    cases = [
        ("p2pfl/s1/status/a", "text", "not_bytes"),
        ("p2pfl/other/status/a", good, "foreign_topic"),
        ("p2pfl/s1/gossip/a", good, "foreign_topic"),
        ("p2pfl/s1/status/a/extra", good, "foreign_topic"),
        ("p2pfl/s1/status/zz", _status("zz", phase_body("training")), "unknown_node"),
        ("p2pfl/s1/status/a", good + b"x" * 5000, "oversized"),
        ("p2pfl/s1/presence/a", b"\x00" * (17 << 10), "oversized"),
        ("p2pfl/s1/status/a", b"\xc1garbage", "malformed"),
        ("p2pfl/s1/status/a", good + b"trailing", "malformed"),
        ("p2pfl/s1/status/a", _status("a", phase_body("training"), swarm="s2"), "foreign_swarm"),
        ("p2pfl/s1/status/a", _status("b", phase_body("training")), "sender_mismatch"),
        ("p2pfl/s1/status/a", _env("a", "gossip", phase_body("training")), "malformed"),
        ("p2pfl/s1/status/a", _status("a", {"event": "phase", "phase": "x"}), "malformed"),
        ("p2pfl/s1/status/a", _status("a", pull_body("zz", "g", 1)), "unknown_node"),
        ("p2pfl/s1/status/a", _status("a", pull_body("a", "g", 1)), "unknown_node"),
        ("p2pfl/s1/presence/a", _env("a", "status", {"presence": {}}), "malformed"),
        ("p2pfl/s1/presence/a", _presence("a", "asleep"), "malformed"),
        ("p2pfl/s1/presence/a", _env("a", "presence", {"presence": "online"}), "malformed"),
    ]
    for topic, payload, reason in cases:
        assert live.handle(topic, payload) == reason, (topic, reason)
    assert not live.presence and not live.phases and not live.pulls
    assert sum(live.dropped.values()) == len(cases)
    # a signed frame is read (its signature is not the dashboard's to check)
    assert live.handle("p2pfl/s1/status/a", signed) is None
    assert live.phases["a"].phase == "waiting"


def test_the_dashboard_reads_presence_and_status_without_torch(tmp_path):
    """The dashboard's process never imports torch: presence and status decode without
    it, and a tensor where none is expected is dropped (docs/architecture.md)."""
    import subprocess
    import sys

    import torch

    msgs = [_presence("a", "online", round=2), _status("a", phase_body("training"), rnd=3)]
    msgs.append(_status("b", {"event": "phase", "phase": torch.zeros(2)}))
    for i, payload in enumerate(msgs):
        (tmp_path / f"{i}.bin").write_bytes(payload)
    code = (
        "import sys, pathlib\n"
        "from p2pfl.dashboard.live import LiveState\n"
        "import p2pfl.dashboard.server\n"
        f"live = LiveState({SWARM!r}, {IDS!r})\n"
        f"kinds = ['presence', 'status', 'status']\n"
        "for i, kind in enumerate(kinds):\n"
        f"    payload = pathlib.Path({str(tmp_path)!r}, f'{{i}}.bin').read_bytes()\n"
        "    sender = 'a' if i < 2 else 'b'\n"
        f"    print(live.handle(f'p2pfl/{SWARM}/{{kind}}/{{sender}}', payload))\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split()
    assert lines[:2] == ["None", "None"]  # applied
    assert lines[2] != "None" and lines[-1] == "False", done.stdout  # dropped; no torch
