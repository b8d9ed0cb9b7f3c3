"""The lanes (p2pfl.wire.lane): the transport pulls over the first of its ordered lanes
that reaches the peer and answers on the one the pull came by; and the wire form of
``transfer.compress`` it owns, both ways. No broker: the lanes here are stand-ins."""

from __future__ import annotations

import asyncio

import pytest
import torch

from p2pfl.wire.codec import decode
from p2pfl.wire.compress import Spec, decode_state, encode_state
from p2pfl.wire.direct import DirectLane
from p2pfl.wire.envelope import Envelope
from p2pfl.wire.lane import Answer, Lane, Pull
from p2pfl.wire.transfers import PreparedState
from p2pfl.wire.transport import Transport, TransportError

STATE = {"g.w": torch.randn(40, 30), "g.n": torch.arange(5)}


class Stand:
    """A lane that answers each call with what it was given: a value, or an exception to
    raise; ``None`` for a pull means it cannot reach the peer."""

    def __init__(self, name: str, pulled=None, answers: bool = True):
        self.name = name
        self.pulled = pulled
        self.answers = answers
        self.calls: list[tuple[str, object]] = []

    async def pull(self, pull: Pull):
        self.calls.append(("pull", pull))
        if isinstance(self.pulled, BaseException):
            raise self.pulled
        if self.pulled == "wait":  # until the pull's future settles (the peer went offline)
            return await pull.arrived
        return self.pulled

    async def answer(self, answer: Answer) -> bool:
        self.calls.append(("answer", answer))
        return self.answers

    async def refuse(self, to: str, xfer: str, payload: bytes) -> bool:
        self.calls.append(("refuse", (to, xfer, payload)))
        return self.answers


def transport(*lanes: Stand, **kw) -> Transport:
    t = Transport("s", "a", "127.0.0.1", 1, connect_timeout=0.1, **kw)
    if lanes:
        t.lanes = list(lanes)
    return t


def test_a_transport_holds_the_direct_lane_first_when_it_has_one():
    plain = transport()
    assert plain.lanes == [plain.mqtt] and plain.mqtt.name == "mqtt"
    both = transport(direct_lane=DirectLane())
    assert both.lanes == [both.direct, both.mqtt] and both.direct.name == "direct"
    assert all(isinstance(lane, Lane) for lane in both.lanes)
    assert isinstance(Stand("x"), Lane)


async def test_a_pull_falls_back_to_the_next_lane_when_one_cannot_reach_the_peer():
    first, second, third = Stand("first"), Stand("second", STATE), Stand("third", {})
    t = transport(first, second, third)
    state = await t.pull("b", 3, "g", 5.0, attempt=2)
    assert state is STATE
    assert [c[0] for c in first.calls] == ["pull"] and [c[0] for c in second.calls] == ["pull"]
    assert third.calls == []  # never tried: the second one reached the peer
    asked, again = first.calls[0][1], second.calls[0][1]
    assert asked.xfer == again.xfer and asked.peer == "b"  # one pull, the same transfer
    env = Envelope.unpack(asked.request(), 1 << 20)
    assert (env.kind, env.id, env.round, env.attempt) == ("pull", asked.xfer, 3, 2)
    assert env.body == {"part": "g"}
    assert list(t.pull_lanes) == [("b", "second")] and t.pulls == 1
    assert t.transfers.pending() == []  # forgotten once done


async def test_a_lane_that_reached_the_peer_and_failed_ends_the_pull():
    failing, after = Stand("first", TransportError("b refused the pull: no")), Stand("x", STATE)
    t = transport(failing, after)
    with pytest.raises(TransportError, match="refused"):
        await t.pull("b", 1, "g", 5.0)
    assert after.calls == [] and t.pulls == 0 and t.transfers.pending() == []


async def test_a_pull_past_its_deadline_or_from_a_peer_gone_offline_fails():
    t = transport(Stand("slow", asyncio.TimeoutError()))
    with pytest.raises(TransportError, match="timed out after 5.0 s"):
        await t.pull("b", 1, "g", 5.0)
    waiting = Stand("waiting", "wait")
    t = transport(waiting)
    pull = asyncio.create_task(t.pull("b", 1, "g", 5.0))
    while not waiting.calls:
        await asyncio.sleep(0)
    t.transfers.fail_peer("b", "b went offline")  # what its Last Will does, on any lane
    with pytest.raises(TransportError, match="went offline"):
        await pull
    t.peers["b"] = {"status": "offline"}
    with pytest.raises(TransportError, match="is offline"):  # no lane is even tried
        await t.pull("b", 1, "g", 5.0)
    assert len(waiting.calls) == 1


async def test_an_answer_goes_back_on_the_first_lane_that_takes_it():
    elsewhere, taken, last = Stand("direct", answers=False), Stand("mqtt"), Stand("z")
    t = transport(elsewhere, taken, last, chunk_bytes=1024)
    prepared = PreparedState.from_state(STATE)
    await t.send_state("b", "x1", 4, prepared)
    assert [c[0] for c in elsewhere.calls] == ["answer"] and last.calls == []
    answer = taken.calls[0][1]
    assert (answer.to, answer.xfer, answer.round_no, answer.chunk) == ("b", "x1", 4, 1024)
    meta = answer.meta()
    assert meta["total"] == len(prepared.buf) and meta["nchunks"] == -(-len(prepared.buf) // 1024)
    assert (meta["digest"], meta["hexdigest"]) == (prepared.digest_name, prepared.hexdigest)
    await t.send("b", "pull_error", 4, {"xfer": "x2", "reason": "no"})
    to, xfer, payload = taken.calls[-1][1]
    env = Envelope.unpack(payload, 1 << 20)
    assert (to, xfer, env.kind, env.body["reason"]) == ("b", "x2", "pull_error", "no")


# ----------------------------------------------------------------------------- compression


def test_compress_is_parsed_once_and_prepares_the_wire_form():
    assert transport().compress == Spec("none") and transport().served is None
    for spec in ("none", "fp16", "int8"):
        t = transport(compress=spec)
        assert t.compress == Spec(spec) and t.served is None and t.streams is None
        got = t.prepare(STATE)
        want = PreparedState.from_state(STATE, t.digest_name, spec)
        assert (bytes(got.buf), got.index, got.hexdigest) == (
            bytes(want.buf),
            want.index,
            want.hexdigest,
        )
    t = transport(compress="topk(0.25)")
    assert t.compress == Spec("topk", 0.25)
    assert t.served is not None and t.served.rho == 0.25 and t.streams is not None
    outside = t.prepare(STATE, "blake3")  # a state outside its stream travels as it is
    plain = PreparedState.from_state(STATE, "blake3")
    assert bytes(outside.buf) == bytes(plain.buf) and outside.hexdigest == plain.hexdigest
    with pytest.raises(ValueError, match="transfer.compress"):
        transport(compress="gzip")


async def test_a_pulled_state_is_decoded_by_the_transport():
    wire = dict(encode_state(STATE, "int8"))
    t = transport(Stand("lane", wire))
    assert await t.pull("b", 1, "g", 5.0) is wire  # as it travelled
    decoded = await t.decoded("b", await t.pull("b", 1, "g", 5.0), max_bytes=1 << 20)
    want = decode_state(wire, max_bytes=1 << 20)
    assert decoded.keys() == want.keys()
    assert all(torch.equal(decoded[k], want[k]) for k in want)
    assert await t.decoded("b", STATE, max_bytes=1) is STATE  # not compressed: as it is
    with pytest.raises(TransportError, match="does not decode"):  # over the limit
        await t.decoded("b", await t.pull("b", 1, "g", 5.0), max_bytes=100)
    assert t.dropped["bad_transfer"] == 1


async def test_a_malformed_compressed_state_is_dropped_and_fails_its_pull():
    wire = dict(encode_state(STATE, "fp16"))
    header = decode(memoryview(wire["@compress"].numpy()), 1 << 20)
    assert header["codec"] == "fp16"
    wire["@compress"] = torch.frombuffer(bytearray(b"\x81\xa1v\x07"), dtype=torch.uint8)
    t = transport()
    with pytest.raises(TransportError, match="state from b does not decode"):
        await t.decoded("b", wire, max_bytes=1 << 20)
    assert t.dropped["bad_transfer"] == 1
