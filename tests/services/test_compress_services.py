"""Compression in the node's services (docs/wire.md, "Compression"): what a node serves is
packed and digested in its compressed form, and every state it pulls is decoded, whatever
codec the peer used, before admission sees it; a state that does not decode fails its
pull cleanly."""

from __future__ import annotations

import pytest
import torch
from services_helpers import offline_services

from p2pfl.check.load import load_topology
from p2pfl.rounds.gossip.decentralized import DecentralizedRounds
from p2pfl.services.bundle import NodeServices
from p2pfl.wire.codec import buffer_to_state, encode, state_nbytes
from p2pfl.wire.compress import HEADER, TopKReceiver, encode_state, is_compressed
from p2pfl.wire.digest import hexdigest
from p2pfl.wire.envelope import Envelope
from p2pfl.wire.transfers import PreparedState

LIMIT = 1 << 26


def same(a, b) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def services(compress: str, node_id: str = "a") -> NodeServices:
    cfg = load_topology("topologies/synthetic.yaml", [f"transfer.compress={compress}"])
    return offline_services(cfg, node_id)


def own_state(svc: NodeServices) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in svc.method.model.state_dict().items()}


def arrived(prepared: PreparedState) -> dict[str, torch.Tensor]:
    """What the puller's transport hands back for ``prepared`` (both lanes alike)."""
    return buffer_to_state(prepared.index, bytearray(prepared.buf))


async def test_what_is_served_is_the_compressed_form_and_its_digest():
    state = own_state(services("none"))
    plain = await services("none").exchange.prepare(state)
    packed = await services("int8").exchange.prepare(state)
    assert plain.buf == PreparedState.from_state(state, plain.digest_name).buf
    assert not is_compressed(arrived(plain))
    assert is_compressed(arrived(packed))
    assert len(packed.buf) < 0.5 * len(plain.buf)
    assert packed.hexdigest == hexdigest(packed.buf, packed.digest_name)


async def test_pulled_states_are_decoded_before_admission_whatever_the_codec():
    svc = services("none")  # its own setting does not matter for what it decodes
    mine = own_state(svc)
    g = torch.Generator().manual_seed(0)
    near = {
        k: (v + 0.01 * torch.randn(v.shape, generator=g)) if v.is_floating_point() else v
        for k, v in mine.items()
    }
    poisoned = {k: v.clone() for k, v in near.items()}
    first = next(k for k, v in poisoned.items() if v.is_floating_point())
    poisoned[first].view(-1)[0] = float("nan")
    unknown = dict(encode_state(near, "int8"))
    unknown[HEADER] = torch.frombuffer(
        bytearray(encode({"v": 1, "codec": "zstd", "tensors": []})), dtype=torch.uint8
    )
    served = {
        "b": PreparedState.from_state(encode_state(near, "int8")),
        "c": PreparedState.from_state(encode_state(near, "fp16")),
        "d": PreparedState.from_state(encode_state(poisoned, "int8")),
        "e": PreparedState.from_state(unknown),
    }

    async def pull(peer, round_no, part, timeout, *, attempt=0, max_bytes=None):
        return arrived(served[peer])

    svc.exchange.transport.pull = pull
    svc.robust.begin_round(1)
    pulled, failed = await svc.exchange.pull_many(
        dict.fromkeys(served, "all"), 1, 5.0, reference=lambda _part: mine
    )
    assert sorted(pulled) == ["b", "c"]
    for peer in ("b", "c"):
        assert list(pulled[peer]) == list(mine)
        for k, v in mine.items():
            assert pulled[peer][k].dtype == v.dtype and pulled[peer][k].shape == v.shape
            assert float((pulled[peer][k].double() - near[k].double()).abs().max()) < 0.02
    assert "non-finite" in svc.robust.rejected["d"]  # admission saw the decoded NaN
    assert "unknown codec 'zstd'" in failed["e"] and "e" not in svc.robust.rejected
    assert svc.exchange.transport.dropped["bad_transfer"] == 1


async def test_a_decoded_state_over_the_pull_limit_fails_its_pull():
    svc = services("int8")
    svc.exchange.pull_limit = 1000  # far below the synthetic CNN's decoded size
    wire = PreparedState.from_state(encode_state(own_state(svc), "int8"))

    async def pull(peer, round_no, part, timeout, *, attempt=0, max_bytes=None):
        return arrived(wire)

    svc.exchange.transport.pull = pull
    pulled, failed = await svc.exchange.pull_many({"b": "all"}, 1, 5.0)
    assert pulled == {} and "exceeds the limit of 1000" in failed["b"]


# ----------------------------------------------------------------------------- top-k


class Wire:
    """What a node's transport sent: each answer (``send_state``) and refusal (``send``)."""

    def __init__(self, svc: NodeServices):
        self.states: list[PreparedState] = []
        self.refusals: list[dict] = []

        async def send_state(to, xfer, round_no, prepared):
            self.states.append(prepared)

        async def send(to, kind, round_no, body, mid=None, *, attempt=0):
            assert kind == "pull_error"
            self.refusals.append(body)

        svc.exchange.transport.send_state = send_state
        svc.exchange.transport.send = send


def pull_env(sender: str, round_no: int, body: dict, attempt: int = 0) -> Envelope:
    return Envelope(
        "s", sender, round_no, "pull", f"x{len(str(body))}{round_no}", body, attempt=attempt
    )


def drift(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        k: (v + 0.01 * torch.randn(v.shape, generator=g)) if v.is_floating_point() else v
        for k, v in state.items()
    }


async def test_topk_snapshots_are_served_from_the_base_the_pull_names():
    svc = services("topk(0.1)")
    wire = Wire(svc)
    rounds = DecentralizedRounds(svc)
    own = own_state(svc)
    rx = TopKReceiver()
    dense = state_nbytes(own)
    for r in (1, 2, 3):
        rounds._keep_snapshot(r, drift(own, r) if r > 1 else own)
        base = None if rx.base is None else list(rx.base)
        await rounds.serve_pull(
            pull_env("b", r, {"part": "all", **({"base": base} if base else {})})
        )
        got = rx.apply(arrived(wire.states[-1]), max_bytes=LIMIT)
        assert list(got) == list(own)
        assert (
            len(wire.states[-1].buf) >= dense if r == 1 else len(wire.states[-1].buf) < 0.3 * dense
        )
    # a stale or unknown base (another epoch, a seq the stream never reached): dense
    epoch = rx.base[0]
    for base in ([epoch, 1 << 40], ["not-its-epoch", 2], [epoch, 0]):
        await rounds.serve_pull(pull_env("c", 3, {"part": "all", "base": base}))
        assert len(wire.states[-1].buf) >= dense, base
        assert same(TopKReceiver().apply(arrived(wire.states[-1]), max_bytes=LIMIT), got)
    assert wire.refusals == [] and sum(svc.exchange.transport.dropped.values()) == 0


@pytest.mark.parametrize(
    "base",
    [
        "epoch",
        3,
        [1, 2],
        ["e"],
        ["e", -1],
        ["e", 1 << 63],
        ["e", (1 << 64) - 1],
        ["e", "1"],
        ["e" * 100, 1],
        {"epoch": "e", "seq": 1},
        [["e"], 1],
    ],
)
async def test_a_hostile_base_is_dropped_and_refused_never_raised(base):
    svc = services("topk(0.1)")
    wire = Wire(svc)
    rounds = DecentralizedRounds(svc)
    rounds._keep_snapshot(1, own_state(svc))
    await rounds.serve_pull(pull_env("b", 1, {"part": "g", "base": base}))
    assert wire.states == [] and len(wire.refusals) == 1
    assert "malformed base" in wire.refusals[0]["reason"]
    assert svc.exchange.transport.dropped["malformed"] == 1
    # the stream is untouched: an honest pull right after gets its dense first answer
    await rounds.serve_pull(pull_env("c", 1, {"part": "g"}))
    assert len(wire.states) == 1 and svc.exchange.streams.sender("g").seq == 1


async def test_topk_uploads_and_results_are_streams_of_the_aggregator_role():
    from p2pfl.algorithms.base import Aggregate
    from p2pfl.rounds.rotation.aggregator import AggregatorRole
    from p2pfl.rounds.rotation.rotation import Rotation

    cfg = load_topology(
        "topologies/synthetic.yaml",
        ["algorithm.name=fedavg", "algorithm.params={}", "transfer.compress=topk(0.1)"],
    )
    svc = offline_services(cfg, "a")
    wire = Wire(svc)
    rotation = Rotation(svc)
    rotation.rosters.update({1: ["b"], 2: ["b"]})  # b aggregates both rounds
    role = AggregatorRole(svc, rotation)
    own = own_state(svc)
    for r in (1, 2):
        role.keep_upload(r, drift(own, r))
    await role.serve_pull(pull_env("b", 1, {"part": "upload"}))
    rx = TopKReceiver()
    rx.apply(arrived(wire.states[-1]), max_bytes=LIMIT)
    await role.serve_pull(pull_env("b", 2, {"part": "upload", "base": list(rx.base)}))
    assert len(wire.states[-1].buf) < 0.3 * len(wire.states[0].buf)
    assert same(
        rx.apply(arrived(wire.states[-1]), max_bytes=LIMIT),
        svc.exchange.streams.sender(("upload",)).estimate,
    )
    # results: the common one is a stream, a member's own result another
    role._results[(1, 0)] = Aggregate(results={"c": drift(own, 7)}, common=drift(own, 8))
    await role.serve_pull(pull_env("c", 1, {"part": "result"}))
    await role.serve_pull(pull_env("d", 1, {"part": "result"}))
    assert (
        svc.exchange.streams.sender(("result", "c")).epoch
        != svc.exchange.streams.sender(("result", "")).epoch
    )
    assert wire.refusals == []
