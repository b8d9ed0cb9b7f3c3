"""Helpers shared by the transport tests of both lanes."""

from __future__ import annotations

import asyncio
import io
import subprocess
import tarfile
from pathlib import Path

import pytest

from p2pfl.wire.envelope import Envelope
from p2pfl.wire.transfers import PreparedState
from p2pfl.wire.transport import Transport


def serve_from(state_by_round, gate: asyncio.Event | None = None):
    """An ``on_request`` body ``handler(t, env)`` that answers pulls from a dict of states
    (the requested part of the round's state), refusing unknown rounds with ``none``;
    with ``gate``, it answers only once the gate is set."""

    async def handler(t: Transport, env: Envelope):
        if gate is not None:
            await gate.wait()
        state = state_by_round.get(env.round)
        if state is None:
            await t.send(env.sender, "pull_error", env.round, {"xfer": env.id, "reason": "none"})
            return
        part = env.body["part"]
        chosen = {k: v for k, v in state.items() if part == "all" or k.startswith(part + ".")}
        await t.send_state(env.sender, env.id, env.round, PreparedState.from_state(chosen))

    return handler


ROOT = Path(__file__).resolve().parents[2]
# the last commit of the protocol 2 release (the next one made XXH3 digests protocol 3)
PROTOCOL_2_COMMIT = "380eaa639afe6a7e6f5d7775140a10ebd5a7f427"


def protocol_2_release(into: Path) -> Path:
    """This repository's ``p2pfl`` package as released with protocol 2, extracted under
    ``into``; skips where the clone lacks that history (a shallow clone)."""
    try:
        tar = subprocess.run(
            ["git", "-C", str(ROOT), "archive", PROTOCOL_2_COMMIT, "p2pfl"],
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"commit {PROTOCOL_2_COMMIT[:8]} (protocol 2) is not in this clone")
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(into, filter="data")
    return into
