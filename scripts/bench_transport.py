#!/usr/bin/env python
"""Transfer benchmark: raw MQTT throughput vs a p2pfl weight pull, on one private broker.

1. raw: a publisher process sends ``--raw-mb`` MiB as 1 MiB QoS-1 publishes (a window of
   them in flight), a subscriber in this process times first byte to last byte;
2. p2pfl: a serving node process holds a ResNet18-sized state (~45 MB); this process pulls
   it with :meth:`p2pfl.transport.Transport.pull` (request, metadata, 1 MiB chunks,
   reassembly, digest check, tensors) and times it end to end.

Prints a table and writes ``raw_MBps``, ``p2pfl_MBps`` and ``ratio`` (plus details) to
``--json``. Target: p2pfl ≥ 50% of raw.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import socket
import statistics
import sys
import time
from pathlib import Path

import aiomqtt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pfl.broker import MosquittoBroker  # noqa: E402

MiB = 1 << 20
WINDOW = 16
NODELAY = (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as p2pfl.transport sets it


def _run(coro):
    from p2pfl.sysopt import tune_malloc

    tune_malloc()  # the daemon's own setting, for raw and p2pfl processes alike
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


# ----------------------------------------------------------------------------- raw MQTT


async def _raw_publisher(host: str, port: int, total_mb: int, go: mp.Event) -> None:
    payload = b"\x5a" * MiB
    async with aiomqtt.Client(
        host, port, max_inflight_messages=WINDOW * 2, socket_options=[NODELAY]
    ) as client:
        client.pending_calls_threshold = WINDOW * 4
        go.wait()
        pending: set[asyncio.Task] = set()
        for _ in range(total_mb):
            pending.add(asyncio.create_task(client.publish("bench/raw", payload, qos=1)))
            if len(pending) >= WINDOW:
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.gather(*pending)


def raw_publisher_main(host, port, total_mb, go):
    _run(_raw_publisher(host, port, total_mb, go))


async def raw_once(host: str, port: int, total_mb: int) -> float:
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    proc = ctx.Process(target=raw_publisher_main, args=(host, port, total_mb, go))
    async with aiomqtt.Client(host, port, socket_options=[NODELAY]) as sub:
        await sub.subscribe("bench/raw", qos=1)
        proc.start()
        await asyncio.sleep(1.0)  # let the publisher connect
        got = 0
        go.set()
        t0 = None
        async for msg in sub.messages:
            if t0 is None:
                t0 = time.perf_counter()
            got += len(msg.payload)
            if got >= total_mb * MiB:
                break
        dt = time.perf_counter() - t0
    proc.join()
    # the first message's own transfer is not inside [t0, end]: count one fewer
    return (got - MiB) / dt / 1e6


# ----------------------------------------------------------------------------- p2pfl pull


def resnet18_state():
    import torch

    from p2pfl.config import ModelConfig
    from p2pfl.models import build_model

    torch.manual_seed(0)
    return build_model(ModelConfig(name="resnet18"), 10, (3, 32, 32)).state_dict()


async def _server(host: str, port: int, ready: mp.Event, stop: mp.Event) -> None:
    from p2pfl.transport import PreparedState, Transport

    state = resnet18_state()
    prepared = PreparedState.from_state(state)
    async with Transport("bench", "server", host, port) as t:

        async def serve(env):
            await t.send_state(env.sender, env.id, env.round, prepared)

        t.on_request = serve
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.1)


def server_main(host, port, ready, stop):
    _run(_server(host, port, ready, stop))


async def p2pfl_pulls(host: str, port: int, repeats: int) -> tuple[list[float], int]:
    from p2pfl.codec import state_nbytes
    from p2pfl.transport import Transport

    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=server_main, args=(host, port, ready, stop))
    proc.start()
    try:
        while not ready.is_set():
            await asyncio.sleep(0.1)
        speeds = []
        nbytes = 0
        async with Transport("bench", "client", host, port) as t:
            for i in range(repeats):
                t0 = time.perf_counter()
                state = await t.pull("server", i, "all", timeout=120)
                dt = time.perf_counter() - t0
                nbytes = state_nbytes(state)
                speeds.append(nbytes / dt / 1e6)
    finally:
        stop.set()
        proc.join(10)
    return speeds, nbytes


async def bench(repeats: int, raw_mb: int) -> dict:
    with MosquittoBroker(max_packet_mb=8) as broker:
        # one warm-up run of each (discarded), so neither side pays first-touch costs
        raw = [await raw_once(broker.host, broker.port, raw_mb) for _ in range(repeats + 1)][1:]
        pulls, nbytes = await p2pfl_pulls(broker.host, broker.port, repeats + 1)
        pulls = pulls[1:]
    raw_mbps = statistics.median(raw)
    p2p_mbps = statistics.median(pulls)
    return {
        "raw_MBps": raw_mbps,
        "p2pfl_MBps": p2p_mbps,
        "ratio": p2p_mbps / raw_mbps,
        "raw_runs_MBps": raw,
        "p2pfl_runs_MBps": pulls,
        "state_bytes": nbytes,
        "raw_bytes": raw_mb * MiB,
        "repeats": repeats,
        "warmup_runs_discarded": 1,
    }


def main(argv: list[str] | None = None) -> int:
    from p2pfl.sysopt import tune_malloc

    tune_malloc()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--raw-mb", type=int, default=128, help="MiB sent in the raw test")
    args = ap.parse_args(argv)
    res = _run(bench(args.repeats, args.raw_mb))
    from rich.console import Console
    from rich.table import Table

    t = Table(title="transfer throughput (median of runs, MB/s = 1e6 B/s)")
    t.add_column("path")
    t.add_column("MB/s", justify="right")
    t.add_column("runs")
    t.add_row(
        f"raw MQTT, 1 MiB QoS-1 publishes ({args.raw_mb} MiB)",
        f"{res['raw_MBps']:.0f}",
        ", ".join(f"{x:.0f}" for x in res["raw_runs_MBps"]),
    )
    t.add_row(
        f"p2pfl pull, ResNet18 state ({res['state_bytes'] / 1e6:.1f} MB)",
        f"{res['p2pfl_MBps']:.0f}",
        ", ".join(f"{x:.0f}" for x in res["p2pfl_runs_MBps"]),
    )
    t.add_row("ratio p2pfl / raw", f"{res['ratio']:.2f}", "target ≥ 0.50")
    Console().print(t)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
