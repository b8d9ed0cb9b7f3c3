"""p2pfl.wire.streams: top-k wired into the pull protocol (docs/wire.md, "Compression").
A served stream publishes each state once and answers each pull from the base it names
(a delta when it can, else dense); a pull names the base its receiver holds and decodes
the answer with it, on both lanes of a real broker; hostile bases and answers are refused
cleanly."""

from __future__ import annotations

import asyncio

import pytest
import torch

from p2pfl.wire.codec import buffer_to_state, state_nbytes
from p2pfl.wire.compress import (
    CompressError,
    TopKReceiver,
    TopKSender,
    codec_of,
    encode_state,
    parse_base,
)
from p2pfl.wire.direct import DirectLane
from p2pfl.wire.envelope import Envelope
from p2pfl.wire.streams import ReceivedStreams, ServedStreams
from p2pfl.wire.transfers import PreparedState
from p2pfl.wire.transport import Transport, TransportError

LIMIT = 1 << 24


def walk(steps: int, seed: int = 0):
    """A state drifting a little every step, as a model does round after round."""
    g = torch.Generator().manual_seed(seed)
    x = {"g.w": torch.randn(64, 64, generator=g), "g.n": torch.tensor(0)}
    for t in range(steps):
        yield {k: v.clone() for k, v in x.items()}
        x["g.w"] = x["g.w"] + 0.05 * torch.randn(64, 64, generator=g)
        x["g.n"] = torch.tensor(t + 1)


def arrived(prepared: PreparedState) -> dict[str, torch.Tensor]:
    """What the puller's transport hands back for ``prepared`` (both lanes alike)."""
    return buffer_to_state(prepared.index, bytearray(prepared.buf))


def same(a, b) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- the base


@pytest.mark.parametrize(
    "value",
    [
        "abc",
        b"ab",
        7,
        {"epoch": "e", "seq": 1},
        [],
        ["e"],
        ["e", 1, 2],
        [1, 2],
        ["", 1],
        ["e" * 65, 1],
        ["e", -1],
        ["e", 1 << 63],
        ["e", (1 << 64) - 1],
        ["e", 1.0],
        ["e", True],
        ["e", None],
        [None, None],
    ],
)
def test_a_malformed_base_is_refused(value):
    with pytest.raises(CompressError, match="base"):
        parse_base(value)


def test_a_well_formed_base_parses():
    assert parse_base(None) is None
    assert parse_base(["e" * 64, 0]) == ("e" * 64, 0)
    assert parse_base(("abc", (1 << 63) - 1)) == ("abc", (1 << 63) - 1)


# ----------------------------------------------------------------------------- serving


async def test_each_state_is_published_once_and_answered_from_the_base_named():
    served, rx = ServedStreams(0.1, "xxh3_128"), ReceivedStreams()
    states = list(walk(5))
    dense = state_nbytes(states[0])
    calls = []

    def make(x):
        def state():
            calls.append(1)
            return x

        return state

    for r, x in enumerate(states, 1):
        base = rx.base("b", "all")
        first = await served.prepared("all", r, make(x), base)
        again = await served.prepared("all", r, make(x), base)  # another puller, same base
        assert again is first
        got = rx.decode("b", "all", arrived(first), max_bytes=LIMIT)
        sender = served.sender("all")
        assert same(got, sender.estimate)  # the published estimate, bit for bit
        assert rx.base("b", "all") == (sender.epoch, r)
        if r == 1:
            assert base is None and len(first.buf) >= dense
        else:
            assert len(first.buf) < 0.3 * dense  # a delta: ~10 % of values and positions
    assert len(calls) == len(states)  # one publish per state, whoever pulls


async def test_a_stale_unknown_or_foreign_base_gets_a_dense_answer():
    served = ServedStreams(0.1, "xxh3_128", window=2)
    states = list(walk(6))
    rx = TopKReceiver()
    rx.apply(arrived(await served.prepared("g", 1, lambda: states[0], None)), max_bytes=LIMIT)
    held = rx.base
    for r in range(2, 6):  # four publishes later: beyond the window of 2
        await served.prepared("g", r, lambda r=r: states[r - 1], None)
    epoch = served.sender("g").epoch
    dense = state_nbytes(states[0])
    for base in (held, (epoch, 10**12), (epoch, (1 << 63) - 1), ("someone-else", 5), None):
        answer = await served.prepared("g", 5, lambda: states[4], base)
        assert len(answer.buf) >= dense, base
        got = TopKReceiver().apply(arrived(answer), max_bytes=LIMIT)  # needs no base
        assert same(got, served.sender("g").estimate)
    # the base of the latest publish: an empty delta
    assert len((await served.prepared("g", 5, lambda: states[4], (epoch, 5))).buf) < 1000


async def test_an_old_state_no_longer_in_its_stream_is_not_answered_from_it():
    served = ServedStreams(0.1, "xxh3_128", keep=2)
    states = list(walk(4))
    for r in (1, 3, 4):
        assert await served.prepared("h", r, lambda r=r: states[r - 1], None) is not None
    assert await served.prepared("h", 2, lambda: states[1], None) is None  # never published
    assert await served.prepared("h", 1, lambda: states[0], None) is None  # let go
    assert await served.prepared("h", 3, lambda: states[2], None) is not None  # kept
    assert served.sender("h").seq == 3


async def test_the_digest_covers_the_bytes_that_travel():
    from p2pfl.wire.digest import hexdigest

    served = ServedStreams(0.5, "blake3")
    answer = await served.prepared("all", 1, lambda: next(walk(1)), None)
    assert codec_of(arrived(answer)) == "topk"
    assert answer.digest_name == "blake3"
    assert answer.hexdigest == hexdigest(answer.buf, "blake3")


# ----------------------------------------------------------------------------- pulling


def test_a_delta_against_a_base_not_held_fails_and_keeps_the_held_base():
    sender, other = TopKSender(0.1), TopKSender(0.1)
    states = list(walk(3))
    rx = ReceivedStreams()
    sender.publish(states[0])
    rx.decode("b", "all", arrived(PreparedState.from_state(sender.message(None))), max_bytes=LIMIT)
    held = rx.base("b", "all")
    other.publish(states[0])
    other.publish(states[1])
    foreign = other.message((other.epoch, 1))  # a delta from a base this node never held
    with pytest.raises(CompressError, match="delta against base"):
        rx.decode("b", "all", foreign, max_bytes=LIMIT)
    with pytest.raises(CompressError, match="delta against base"):
        rx.decode("c", "all", foreign, max_bytes=LIMIT)  # nothing held of c's stream
    assert rx.base("b", "all") == held and rx.base("c", "all") is None
    # what is not top-k comes back as it came (another codec: the services decode it)
    plain = {"g.w": torch.zeros(3)}
    assert rx.decode("b", "all", plain, max_bytes=LIMIT) is plain
    int8 = encode_state(states[0], "int8")
    assert rx.decode("b", "all", int8, max_bytes=LIMIT) is int8
    assert rx.base("b", "all") == held


# ----------------------------------------------------------------------------- on the wire


async def started(broker, node_id: str, direct: bool) -> Transport:
    lane = DirectLane() if direct else None
    t = Transport("s", node_id, broker.host, broker.port, chunk_bytes=16 * 1024, direct_lane=lane)
    await t.__aenter__()
    return t


@pytest.mark.integration
@pytest.mark.parametrize("direct", [False, True], ids=["mqtt", "direct"])
async def test_pulls_name_their_base_and_get_deltas_on_either_lane(broker, direct):
    a, b = await started(broker, "a", direct), await started(broker, "b", direct)
    heard = asyncio.Event()
    a.on_presence = lambda peer, info: heard.set() if peer == "b" else None
    served, states = ServedStreams(0.1, b.digest_name), list(walk(4))
    bodies: list[dict] = []
    forge: list = []  # an answer to send instead of the stream's, once

    async def serve(env: Envelope) -> None:
        bodies.append(dict(env.body))
        if forge:
            prepared = PreparedState.from_state(forge.pop())
        else:
            base = parse_base(env.body.get("base"))
            prepared = await served.prepared("all", env.round, lambda: states[env.round - 1], base)
        await b.send_state(env.sender, env.id, env.round, prepared)

    b.on_request = serve
    a.streams = ReceivedStreams()
    try:
        if "b" not in a.peers:
            await asyncio.wait_for(heard.wait(), 10)
        sizes = []
        for r in (1, 2, 3):
            before = a.stats.bytes_recv
            got = await a.pull("b", r, "all", timeout=10)
            sizes.append(a.stats.bytes_recv - before)
            assert same(got, served.sender("all").estimate)
        assert bodies[0] == {"part": "all"}
        epoch = served.sender("all").epoch
        assert bodies[1:] == [
            {"part": "all", "base": [epoch, 1]},
            {"part": "all", "base": [epoch, 2]},
        ]
        assert max(sizes[1:]) < 0.3 * sizes[0], sizes
        assert {lane for _, lane in a.pull_lanes} == {"direct" if direct else "mqtt"}
        # a hostile server: a delta against a base this node does not hold fails the pull
        other = TopKSender(0.1)
        other.publish(states[0])
        other.publish(states[3])
        forge.append(other.message((other.epoch, 1)))
        with pytest.raises(TransportError, match="does not decode"):
            await a.pull("b", 4, "all", timeout=10)
        assert a.dropped["bad_transfer"] == 1
        assert a.streams.base("b", "all") == (epoch, 3)  # held as it was
        got = await a.pull("b", 4, "all", timeout=10)  # and the stream goes on
        assert same(got, served.sender("all").estimate)
    finally:
        await a.close()
        await b.close()


@pytest.mark.integration
async def test_without_streams_a_pull_body_is_only_its_part(broker):
    a, b = await started(broker, "a", False), await started(broker, "b", False)
    bodies: list = []

    async def serve(env: Envelope) -> None:
        bodies.append(env.body)
        await b.send_state(env.sender, env.id, env.round, PreparedState.from_state(next(walk(1))))

    b.on_request = serve
    try:
        await a.pull("b", 1, "all", timeout=10)
        await a.pull("b", 2, "all", timeout=10)
        assert bodies == [{"part": "all"}, {"part": "all"}]
    finally:
        await a.close()
        await b.close()
