#!/usr/bin/env python
"""Memory under hostile traffic: a node's transport on a private broker takes ``--messages``
fuzzed messages from a peer process; how much does its resident memory grow?

The node (this process) keeps one pull open towards the attacker, as a node pulling from a
neighbour would. The attacker publishes a mix, in equal shares, of: random bytes; truncated
envelopes; envelopes of another swarm; gossip with garbage bodies; ``xfer_meta`` announcing
a 2 GiB transfer for unknown transfer ids; ``xfer_meta`` announcing 2 GiB for the node's
open pull (the one thing the node asked for); ``pull`` requests (refused, answered with
``pull_error``). A clean baseline sends the same number of well-formed gossip messages.

Each run reports the growth of VmRSS from after a warm-up to after the last message is
handled (``gc.collect()`` first). Prints a table (median of ``--runs``) and writes ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pfl.launch.broker import MosquittoBroker  # noqa: E402
from p2pfl.wire.envelope import Envelope  # noqa: E402
from p2pfl.wire.transport import Transport, TransportError  # noqa: E402

SWARM = "fuzz"
KINDS = ("random", "truncated", "foreign", "gossip", "meta_unknown", "meta_open", "pull")


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _attack(host: str, port: int, n: int, clean: bool, open_xfer: str) -> None:
    import random

    import paho.mqtt.client as mqtt

    rnd = random.Random(0)
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"attacker-{uuid.uuid4().hex}")
    c.connect(host, port)
    c.loop_start()
    inbox, gossip = f"p2pfl/{SWARM}/inbox/a", f"p2pfl/{SWARM}/gossip/m"

    def env(kind, body, swarm=SWARM, data=None):
        e = Envelope(swarm, "m", 1, kind, uuid.uuid4().hex[:16], body, data, ts=time.time())
        return e.pack(None)

    for i in range(n):
        kind = "clean" if clean else KINDS[i % len(KINDS)]
        if kind == "clean":
            topic, payload = gossip, env("gossip", {"n": 10, "I": [0.1] * 16})
        elif kind == "random":
            topic, payload = inbox, rnd.randbytes(rnd.randint(1, 4000))
        elif kind == "truncated":
            full = env("gossip", {"x": "y" * 500})
            topic, payload = gossip, full[: rnd.randint(1, len(full) - 1)]
        elif kind == "foreign":
            topic, payload = gossip, env("gossip", {"n": 1}, swarm="other")
        elif kind == "gossip":
            topic, payload = gossip, env("gossip", {"junk": rnd.randbytes(200)})
        elif kind in ("meta_unknown", "meta_open"):
            xfer = open_xfer if kind == "meta_open" else uuid.uuid4().hex[:16]
            meta = {"xfer": xfer, "total": 2**31, "chunk": 1 << 20, "nchunks": 2048}
            meta |= {"digest": "blake3", "hexdigest": "0" * 64, "index": []}
            topic, payload = inbox, env("xfer_meta", meta)
        else:
            topic, payload = inbox, env("pull", {"part": "all"})
        c.publish(topic, payload, qos=0)
        if i % 200 == 0:
            time.sleep(0.01)  # let the broker keep up: QoS 0 floods are otherwise dropped
    c.publish(gossip, env("gossip", {"last": True}), qos=1).wait_for_publish()
    c.loop_stop()
    c.disconnect()


async def one_run(broker: MosquittoBroker, n: int, clean: bool) -> dict:
    node = Transport(SWARM, "a", broker.host, broker.port)
    done = asyncio.Event()
    node.on_gossip = lambda e: done.set() if e.body.get("last") else None

    async def refuse(e):
        await node.send(e.sender, "pull_error", e.round, {"xfer": e.id, "reason": "no"})

    node.on_request = refuse
    async with node:
        # the node's open pull towards the attacker: only its metadata may allocate memory
        xfer = uuid.uuid4().hex[:16]
        fut = node.transfers.expect(xfer, "m", 4 << 20)  # what NodeServices.pull_limit gives
        for _ in range(3):
            gc.collect()
        before = rss_mb()
        t0 = time.monotonic()
        proc = mp.get_context("spawn").Process(
            target=_attack, args=(broker.host, broker.port, n, clean, xfer)
        )
        proc.start()
        await asyncio.wait_for(done.wait(), 300)
        took = time.monotonic() - t0
        await asyncio.to_thread(proc.join)
        for _ in range(3):
            gc.collect()
        after = rss_mb()
        refused = fut.done() and fut.exception() is not None
        node.transfers.forget(xfer)
        return {
            "rss_growth_mb": round(after - before, 2),
            "received": node.stats.messages_recv,
            "dropped": dict(node.dropped),
            "open_pull_rejected": refused,
            "seconds": round(took, 2),
        }


async def main_async(args) -> dict:
    out: dict = {"messages": args.messages, "runs": args.runs, "fuzz": [], "clean": []}
    with MosquittoBroker() as broker:
        for _ in range(args.runs):  # interleaved: fuzz, clean, fuzz, clean, ...
            out["fuzz"].append(await one_run(broker, args.messages, clean=False))
            out["clean"].append(await one_run(broker, args.messages, clean=True))
    for key in ("fuzz", "clean"):
        out[f"{key}_median_mb"] = statistics.median(r["rss_growth_mb"] for r in out[key])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=10_000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", default="results/bench_fuzz.json")
    args = p.parse_args()
    import logging

    logging.basicConfig(level=logging.ERROR)  # the node logs its drops: thousands of lines
    try:
        out = asyncio.run(main_async(args))
    except TransportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"RSS growth over {args.messages} messages (MB), {args.runs} runs")
    for col in ("traffic", "median", "runs", "received (last run)"):
        t.add_column(col)
    for key in ("fuzz", "clean"):
        runs = out[key]
        t.add_row(
            key,
            f"{out[f'{key}_median_mb']:.2f}",
            ", ".join(f"{r['rss_growth_mb']:.2f}" for r in runs),
            str(runs[-1]["received"]),
        )
    Console().print(t)
    print("open pull's 2 GiB metadata rejected:", all(r["open_pull_rejected"] for r in out["fuzz"]))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
