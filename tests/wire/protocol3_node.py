"""A node of the previous release (protocol 3), for the rolling-upgrade test
(tests/wire/test_versions.py).
Not a test module.

Run with the older release's ``p2pfl`` package first on ``PYTHONPATH``:
``python protocol3_node.py HOST PORT`` runs that release's own ``Transport`` as node ``old``
of swarm ``s`` and talks to node ``new``, printing one line per step:

``runs <v>`` → ``heard new`` (``new``'s presence reached it) → ``gossip <json>`` (``new``'s
first gossip) → it gossips ``{"hello": <v>}`` → ``pulled <sum>`` (``new``'s round-1 state,
whose sum is printed) or ``pull failed <why>`` → ``dropped <json>`` (its drop counters).
It serves its own round-1 state (``torch.manual_seed(2)``, 32×32) to pulls, and leaves
(gracefully, ``offline``) on a line on stdin."""

from __future__ import annotations

import asyncio
import json
import sys

import torch

import p2pfl
from p2pfl.wire.transfers import PreparedState
from p2pfl.wire.transport import Transport


async def until(condition, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise TimeoutError("timed out")
        await asyncio.sleep(0.02)


async def main(host: str, port: int) -> None:
    print("runs", p2pfl.PROTOCOL_VERSION, flush=True)
    torch.manual_seed(2)
    state = {"g.w": torch.randn(32, 32)}
    gossip: list = []
    async with Transport(
        "s", "old", host, port, presence={"protocol": p2pfl.PROTOCOL_VERSION}, connect_timeout=10
    ) as t:

        async def serve(env):
            await t.send_state(env.sender, env.id, env.round, PreparedState.from_state(state))

        t.on_request = serve
        t.on_gossip = gossip.append
        await until(lambda: t.peers.get("new", {}).get("status") == "online")
        print("heard new", flush=True)
        await until(lambda: gossip)
        print("gossip", json.dumps(gossip[0].body), flush=True)
        await t.gossip(1, {"hello": p2pfl.PROTOCOL_VERSION})
        try:
            got = await t.pull("new", 1, "all", timeout=20)
            print("pulled", float(got["g.w"].sum()), flush=True)
        except Exception as exc:  # the test reads the reason
            print("pull failed", exc, flush=True)
        print("dropped", json.dumps(dict(t.dropped)), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
