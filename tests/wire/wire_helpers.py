"""Helpers shared by the transport tests of both lanes."""

from __future__ import annotations

import asyncio

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
