"""Presence order bounded by time (docs/wire.md, "Presence order"): the rule
(:func:`p2pfl.security.presence_order.presence_verdict`), a node's use of it, and a signed
swarm on a real broker where a member forges a far-future session and where a member's
clock jumps ahead and back."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from waiting import wait_until

from p2pfl.security.certs import SwarmCerts, make_swarm_certs
from p2pfl.security.presence_order import REWIND_SLACK_S, parse_order, presence_verdict
from p2pfl.security.signing import MessageSecurity
from p2pfl.wire.envelope import Envelope
from p2pfl.wire.transport import Transport

SWARM = "sec"
MEMBERS = ["n0", "n1"]
NOW = 1_800_000_000.0
AGE = 300.0


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> SwarmCerts:
    return make_swarm_certs(tmp_path_factory.mktemp("certs"), SWARM, MEMBERS)


# ----------------------------------------------------------------------------- the rule


@pytest.mark.parametrize(
    "order",
    [None, [], [NOW], [NOW, 1, 2], ["x", 1], [NOW, 1.5], [True, 1], [NOW, False],
     [float("nan"), 1], [float("inf"), 1], {"s": NOW}],
)  # fmt: skip
def test_a_malformed_order_is_refused(order):
    assert parse_order(order) is None
    assert presence_verdict(order, None, NOW, NOW, AGE) == "malformed"


def test_a_session_beyond_max_age_in_the_future_is_refused_whatever_came_before():
    for last in (None, (NOW - 10, 3), (NOW + 100, 1)):
        assert presence_verdict([9e12, 1], last, NOW, NOW, AGE) == "future_session"
        assert presence_verdict([NOW + AGE + 1, 1], last, NOW, NOW, AGE) == "future_session"
    assert presence_verdict([NOW + AGE - 1, 1], None, NOW, NOW, AGE) == "accept"


def test_newer_same_and_older_orders():
    last = (NOW - 50, 4)
    assert presence_verdict([NOW - 50, 5], last, NOW, NOW, AGE) == "accept"
    assert presence_verdict([NOW - 10, 1], last, NOW, NOW, AGE) == "accept"  # a new session
    assert presence_verdict([NOW - 50, 4], last, NOW - 50, NOW, AGE) == "same"
    # older: the last session is credible (not ahead of this clock), so it is a replay,
    # fresh or not
    assert presence_verdict([NOW - 50, 3], last, NOW - 1, NOW, AGE) == "replayed"
    assert presence_verdict([NOW - 900, 9], last, NOW - 900, NOW, AGE) == "replayed"
    # a Will of an older session arriving late is no rewind either
    assert presence_verdict([NOW - 60, 1 << 30], last, NOW - 60, NOW, AGE) == "replayed"


def test_an_older_session_rewinds_only_when_the_last_is_ahead_and_it_is_fresh():
    ahead = (NOW + 120, 2)  # stored while the sender's clock ran 120 s ahead
    assert presence_verdict([NOW - 1, 1], ahead, NOW, NOW, AGE) == "rewind"
    assert presence_verdict([NOW - 1, 1], ahead, NOW + AGE, NOW, AGE) == "rewind"
    # made outside the replay window (by either clock): not fresh, so not a rewind
    assert presence_verdict([NOW - 900, 1], ahead, NOW - AGE - 1, NOW, AGE) == "replayed"
    assert presence_verdict([NOW - 1, 1], ahead, NOW + AGE + 1, NOW, AGE) == "replayed"
    # within the slack, the last session is still credible
    slight = (NOW + REWIND_SLACK_S / 2, 1)
    assert presence_verdict([NOW - 1, 1], slight, NOW, NOW, AGE) == "replayed"


# ----------------------------------------------------------------------------- one node


def _security(certs, node_id: str) -> MessageSecurity:
    return MessageSecurity.from_certs(certs.root, node_id, MEMBERS, max_age_s=AGE)


def test_a_refused_future_session_is_not_stored_and_later_presence_passes(certs):
    sec = _security(certs, "n0")
    assert sec.presence_order("n1", [NOW - 10, 1], "a", NOW - 10, NOW) is None
    assert sec.presence_order("n1", [9e12, 1], "b", NOW, NOW) == "future_session"
    assert sec.presence_order("n1", [NOW - 10, 2], "c", NOW, NOW) is None
    assert sec.presence_order("n1", [NOW - 10, 2], "c", NOW, NOW) == "same"


def test_a_rewind_or_a_fresh_presence_already_seen_is_replayed(certs):
    sec = _security(certs, "n0")
    # the sender's clock ran 100 s ahead for sessions S1 then S2; then it went back
    s1, s2 = NOW + 90, NOW + 100
    assert sec.presence_order("n1", [s1, 1], "s1-online", s1, NOW) is None
    assert sec.presence_order("n1", [s2, 1], "s2-online", s2, NOW) is None
    assert sec.presence_order("n1", [NOW, 1], "s3-online", NOW, NOW) is None  # rewound
    # a replay of S1's presence (fresh, newer than S3, but its id already seen) is refused,
    # and so is a rewind to it, and a replay of the rewinding presence itself
    assert sec.presence_order("n1", [s1, 1], "s1-online", s1, NOW + 1) == "replayed"
    assert sec.presence_order("n1", [NOW, 1], "s3-online", NOW, NOW + 1) == "same"
    assert sec.presence_order("n1", [NOW, 2], "s3-done", NOW + 1, NOW + 1) is None
    assert sec.presence_order("n1", [s2, 1], "s2-online", s2, NOW + 1) == "replayed"


def test_new_session_follows_a_clock_that_went_back(certs, monkeypatch):
    sec = _security(certs, "n1")
    clock = [NOW + 3600.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    sec.new_session()
    assert sec.session == NOW + 3600
    sec.new_session()  # a reconnection within the clock's resolution: still in order
    assert sec.session > NOW + 3600
    clock[0] = NOW  # the clock jumps back an hour
    sec.new_session()
    assert sec.session == NOW
    assert sec.next_presence() == [NOW, 1]


# ----------------------------------------------------------------------------- on a broker


def signed_transport(certs, node_id: str, port: int, max_age_s: float = AGE) -> Transport:
    security = MessageSecurity.from_certs(certs.root, node_id, MEMBERS, max_age_s=max_age_s)
    return Transport(SWARM, node_id, "127.0.0.1", port, security=security, connect_timeout=10)


WAIT_S = 15.0  # how long a condition may take to hold


@pytest.mark.integration
@pytest.mark.one_broker
async def test_a_forged_future_session_is_refused_and_genuine_presence_still_arrives(certs, broker):
    async with (
        signed_transport(certs, "n0", broker.port) as n0,
        signed_transport(certs, "n1", broker.port) as n1,
    ):
        await wait_until(lambda: n0.peers.get("n1", {}).get("status") == "online", WAIT_S)
        # a presence signed with n1's own key, its session in 285 000 years
        topic = n1.topic("presence", "n1")
        body = {
            "presence": {"status": "online", "note": "forged"},
            "order": [9e12, 1],
            "cert": n1.security.certificate_pem,
        }
        forged = Envelope(SWARM, "n1", 0, "presence", uuid.uuid4().hex[:16], body, ts=time.time())
        await n1.mqtt.publish(topic, forged.pack(n1._signer(topic)), 1, True)
        await wait_until(lambda: n0.dropped["future_session"] == 1, WAIT_S)
        assert "note" not in n0.peers["n1"]
        await n1.set_status("done")  # genuine, later
        await wait_until(lambda: n0.peers["n1"]["status"] == "done", WAIT_S)
        await n1.set_status("online", round=2)
        await wait_until(lambda: n0.peers["n1"].get("round") == 2, WAIT_S)
        assert n0.dropped["replayed"] == 0 and n0.dropped["future_session"] == 1


@pytest.mark.integration
@pytest.mark.one_broker
async def test_a_member_whose_clock_jumps_ahead_and_back_keeps_its_presence(certs, broker):
    """``n1`` restarts four times (a process whose clock is set per start), each start a new
    signed session: 120 s ahead, then right, then an hour ahead, then right again. ``n0``
    (max_age_s 300) follows it back from 120 s ahead, refuses the hour-ahead session as
    ``future_session``, and hears the right clock again after it."""
    script = Path(__file__).with_name("clock_node.py")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), str(certs.root), str(broker.port), str(AGE),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None

    async def start(offset: float) -> None:
        proc.stdin.write(f"{offset}\n".encode())
        await proc.stdin.drain()
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        assert line.split()[0] == b"up", line

    try:
        async with signed_transport(certs, "n0", broker.port) as n0:
            heard = lambda offset: (  # noqa: E731
                n0.peers.get("n1", {}).get("clock") == offset
                and n0.peers["n1"]["status"] == "online"
            )
            await start(120.0)
            await wait_until(lambda: heard(120.0), WAIT_S)
            await start(0.0)  # restarted, its clock right again: 120 s behind its last session
            await wait_until(lambda: heard(0.0), WAIT_S)
            await start(3600.0)  # an hour ahead: refused, the last presence (offline) stays
            await wait_until(lambda: n0.dropped["future_session"] >= 1, WAIT_S)
            assert n0.peers["n1"]["clock"] == 0.0
            await start(0.0)
            await wait_until(lambda: heard(0.0) and n0.peers["n1"]["status"] == "online", WAIT_S)
            assert n0.dropped["replayed"] == 0
    finally:
        if proc.returncode is None:
            proc.stdin.write(b"\n")
            await proc.stdin.drain()
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
