"""Compression in the node's services (docs/wire.md, "Compression"): what a node serves is
packed and digested in its compressed form, and every state it pulls is decoded, whatever
codec the peer used, before admission sees it; a state that does not decode fails its
pull cleanly."""

from __future__ import annotations

import torch
from services_helpers import offline_services

from p2pfl.config.load import load_topology
from p2pfl.node.services import NodeServices
from p2pfl.wire.codec import buffer_to_state, encode
from p2pfl.wire.compress import HEADER, encode_state, is_compressed
from p2pfl.wire.digest import hexdigest
from p2pfl.wire.transfers import PreparedState


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
    plain = await services("none").prepare(state)
    packed = await services("int8").prepare(state)
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

    svc.transport.pull = pull
    svc.begin_round(1)
    pulled, failed = await svc.pull_many(
        dict.fromkeys(served, "all"), 1, 5.0, reference=lambda _part: mine
    )
    assert sorted(pulled) == ["b", "c"]
    for peer in ("b", "c"):
        assert list(pulled[peer]) == list(mine)
        for k, v in mine.items():
            assert pulled[peer][k].dtype == v.dtype and pulled[peer][k].shape == v.shape
            assert float((pulled[peer][k].double() - near[k].double()).abs().max()) < 0.02
    assert "non-finite" in svc.rejected["d"]  # admission saw the decoded NaN
    assert "unknown codec 'zstd'" in failed["e"] and "e" not in svc.rejected
    assert svc.transport.dropped["bad_transfer"] == 1


async def test_a_decoded_state_over_the_pull_limit_fails_its_pull():
    svc = services("int8")
    svc.pull_limit = 1000  # far below the synthetic CNN's decoded size
    wire = PreparedState.from_state(encode_state(own_state(svc), "int8"))

    async def pull(peer, round_no, part, timeout, *, attempt=0, max_bytes=None):
        return arrived(wire)

    svc.transport.pull = pull
    pulled, failed = await svc.pull_many({"b": "all"}, 1, 5.0)
    assert pulled == {} and "exceeds the limit of 1000" in failed["b"]
