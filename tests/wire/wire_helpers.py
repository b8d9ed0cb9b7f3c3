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
# the last commit of the protocol 3 release (the next ones sent announcements by difference
# and the kinds of protocol 4: p2pfl.wire.versions.NEW_IN_4)
PROTOCOL_3_COMMIT = "53ed8d3c87ae1b80f0e2ac0b71085f9425ed7d68"


def protocol_3_release(into: Path) -> Path:
    """This repository's ``p2pfl`` package as released with protocol 3, extracted under
    ``into``; skips where the clone lacks that history (a shallow clone)."""
    try:
        tar = subprocess.run(
            ["git", "-C", str(ROOT), "archive", PROTOCOL_3_COMMIT, "p2pfl"],
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"commit {PROTOCOL_3_COMMIT[:8]} (protocol 3) is not in this clone")
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(into, filter="data")
    return into
