"""Transfer digests: which one a node serves with, and what a signed swarm accepts
(docs/wire.md, "Digests")."""

from __future__ import annotations

import asyncio

import pytest
import torch

from p2pfl.wire.digest import AUTHENTICATING, new_hasher, transfer_digest
from p2pfl.wire.envelope import Envelope
from p2pfl.wire.transfers import (
    IncomingTransfers,
    PreparedState,
    TransferError,
    check_meta,
)
from p2pfl.wire.transport import Transport


def _meta(digest: str) -> dict:
    prepared = PreparedState.from_state({"w": torch.arange(6.0)}, digest)
    total = len(prepared.buf)
    return {
        "xfer": "x1",
        "total": total,
        "chunk": 1024,
        "nchunks": 1,
        "digest": digest,
        "hexdigest": prepared.hexdigest,
        "index": prepared.index,
    }, prepared


def test_signed_swarms_serve_blake3_and_unsigned_ones_xxh3():
    assert transfer_digest(signed=True) == "blake3" and "blake3" in AUTHENTICATING
    assert transfer_digest(signed=False) == "xxh3_128" and "xxh3_128" not in AUTHENTICATING
    assert Transport("s", "a", "127.0.0.1", 1).digest_name == "xxh3_128"
    h = new_hasher("xxh3_128")
    h.update(b"abc")
    assert len(h.hexdigest()) == 32


@pytest.mark.parametrize("digest", ["xxh3_128", "blake3", "sha256"])
def test_unsigned_receivers_accept_every_known_digest(digest):
    body, _ = _meta(digest)
    assert check_meta(body, 1 << 20, 1 << 20).digest_name == digest


def test_a_signed_receiver_refuses_a_digest_that_cannot_authenticate():
    body, _ = _meta("xxh3_128")
    with pytest.raises(TransferError, match="cannot vouch for a transfer in a signed swarm"):
        check_meta(body, 1 << 20, 1 << 20, signed=True)
    assert check_meta(_meta("blake3")[0], 1 << 20, 1 << 20, signed=True).digest_name == "blake3"


async def test_signed_incoming_transfer_fails_the_pull_on_xxh3_and_counts_it():
    drops: list[str] = []
    transfers = IncomingTransfers(
        "b",
        1 << 20,
        lambda reason, _detail: drops.append(reason),
        asyncio.ensure_future,
        signed=True,
    )
    fut = transfers.expect("x1", "a", 1 << 20)
    body, _ = _meta("xxh3_128")
    transfers.on_meta(Envelope("s", "a", 1, "xfer_meta", "m1", body))
    with pytest.raises(TransferError, match="cannot vouch"):
        await fut
    assert drops == ["bad_transfer"]


async def test_an_xxh3_transfer_reassembles_and_verifies():
    transfers = IncomingTransfers("b", 1 << 20, lambda *_: None, asyncio.ensure_future)
    fut = transfers.expect("x1", "a", 1 << 20)
    body, prepared = _meta("xxh3_128")
    transfers.on_meta(Envelope("s", "a", 1, "xfer_meta", "m1", body))
    data = memoryview(bytes(prepared.buf))
    transfers.on_chunk(Envelope("s", "a", 1, "xfer_chunk", "c1", {"xfer": "x1", "seq": 0}, data))
    state = await asyncio.wait_for(fut, 10)
    assert torch.equal(state["w"], torch.arange(6.0))
