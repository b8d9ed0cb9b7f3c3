#!/usr/bin/env python
"""Transfer benchmark: raw MQTT throughput vs a p2pfl weight pull, on one private broker.

1. raw: a publisher process sends ``--raw-mb`` MiB as 1 MiB QoS-1 publishes (a window of
   them in flight), a subscriber in this process times first byte to last byte;
2. p2pfl: a serving node process holds a ResNet18-sized state (~45 MB); this process pulls
   it with :meth:`p2pfl.wire.transport.Transport.pull` (request, metadata, 1 MiB chunks,
   reassembly, digest check, tensors) and times it end to end.

3. lanes (docs/wire.md, "Direct lane"), interleaved run by run: raw loopback TCP (a
   process writes the state's byte count on a socket, this process reads it into one
   buffer), the same raw TCP read with each transfer digest hashed piece by piece as the
   lane does (XXH3-128, BLAKE3: what the digest alone costs), the p2pfl pull
   over the direct lane (same serving process; request, metadata, digest, tensors) and the
   same pull over the MQTT lane.

Prints a table and writes ``raw_MBps``, ``p2pfl_MBps`` and ``ratio`` (plus details) to
``--json``, and ``tcp_MBps``, ``direct_MBps``, ``mqtt_MBps`` with ``direct_over_tcp`` and
``mqtt_over_tcp`` (``direct_over_tcp_runs``: run by run; ``tcp_xxh3_over_tcp``,
``tcp_blake3_over_tcp``: the digests' cost). Targets: p2pfl ≥ 50% of raw MQTT; the direct lane ≥ 80% of raw TCP.

``--security`` measures the cost of the security options (docs/wire.md, "Security") in the
same run: a second, TLS-only Mosquitto (client certificates, per-node ACL) from a throwaway
swarm CA, raw MQTT over TLS, and the p2pfl pull with signatures only, TLS only, and both
(``security`` in the JSON, MB/s and the ratio to the unprotected pull).

``--embedded`` compares the two brokers p2pfl can start (docs/wire.md, "Brokers"): raw MQTT
and the p2pfl pull on Mosquitto and on the embedded amqtt broker, interleaved run by run
(``brokers`` in the JSON: each broker's medians, and embedded / Mosquitto ratios).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiomqtt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pfl.launch.broker import EmbeddedBroker, MosquittoBroker  # noqa: E402

MiB = 1 << 20
WINDOW = 16
SWARM = "bench"
# the raw publisher writes into the subscriber's inbox: a topic the TLS broker's ACL allows
RAW_TOPIC = f"p2pfl/{SWARM}/inbox/raw-sub"
NODELAY = (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as p2pfl.wire.transport sets it


def _run(coro):
    from p2pfl.wire.sysopt import tune_malloc

    tune_malloc()  # the daemon's own setting, for raw and p2pfl processes alike
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


# ----------------------------------------------------------------------------- raw MQTT


def _tls(certs: str | None, identity: str):
    if certs is None:
        return None
    from p2pfl.security.signing import tls_context

    return tls_context(certs, identity)


async def _raw_publisher(
    host: str, port: int, total_mb: int, go: mp.Event, certs: str | None = None
) -> None:
    payload = b"\x5a" * MiB
    async with aiomqtt.Client(
        host,
        port,
        max_inflight_messages=WINDOW * 2,
        socket_options=[NODELAY],
        tls_context=_tls(certs, "raw-pub"),
    ) as client:
        client.pending_calls_threshold = WINDOW * 4
        go.wait()
        pending: set[asyncio.Task] = set()
        for _ in range(total_mb):
            pending.add(asyncio.create_task(client.publish(RAW_TOPIC, payload, qos=1)))
            if len(pending) >= WINDOW:
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.gather(*pending)


def raw_publisher_main(host, port, total_mb, go, certs=None):
    _run(_raw_publisher(host, port, total_mb, go, certs))


async def raw_once(host: str, port: int, total_mb: int, certs: str | None = None) -> float:
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    proc = ctx.Process(target=raw_publisher_main, args=(host, port, total_mb, go, certs))
    async with aiomqtt.Client(
        host, port, socket_options=[NODELAY], tls_context=_tls(certs, "raw-sub")
    ) as sub:
        await sub.subscribe(RAW_TOPIC, qos=1)
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

    from p2pfl.config.schema import ModelConfig
    from p2pfl.learning.models import build_model

    torch.manual_seed(0)
    return build_model(ModelConfig(name="resnet18"), 10, (3, 32, 32)).state_dict()


@dataclass(frozen=True)
class Mode:
    """One protection setting of the p2pfl pull."""

    name: str
    tls: bool = False
    sign: bool = False
    direct: bool = False  # serve (server) / use (client) the direct lane


# the receive-side cost of each transfer digest, measured on the raw TCP sender
DIGEST_COSTS = {"tcp_xxh3": "xxh3_128", "tcp_blake3": "blake3"}
MODES = (Mode("off"), Mode("sign", sign=True), Mode("tls", tls=True), Mode("tls+sign", True, True))
IDS = ["server", "client", "raw-pub", "raw-sub"]


def _transport(node_id: str, host: str, port: int, mode: Mode, certs: str | None):
    from p2pfl.security.signing import MessageSecurity
    from p2pfl.wire.direct import DirectLane
    from p2pfl.wire.transport import Transport

    security = MessageSecurity.from_certs(certs, node_id, IDS) if mode.sign else None
    tls = _tls(certs, node_id) if mode.tls else None
    lane = DirectLane() if mode.direct else None
    return Transport(
        SWARM, node_id, host, port, security=security, tls_context=tls, direct_lane=lane
    )


async def _server(
    host: str, port: int, ready: mp.Event, stop: mp.Event, mode: Mode, certs: str | None
) -> None:
    from p2pfl.wire.transfers import PreparedState

    state = resnet18_state()
    async with _transport("server", host, port, mode, certs) as t:
        prepared = PreparedState.from_state(state, t.digest_name)  # as a node serves it

        async def serve(env):
            await t.send_state(env.sender, env.id, env.round, prepared)

        t.on_request = serve
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.1)


def server_main(host, port, ready, stop, mode=MODES[0], certs=None):
    _run(_server(host, port, ready, stop, mode, certs))


async def p2pfl_pulls(
    host: str, port: int, repeats: int, mode: Mode = MODES[0], certs: str | None = None
) -> tuple[list[float], int]:
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=server_main, args=(host, port, ready, stop, mode, certs))
    proc.start()
    try:
        while not ready.is_set():
            await asyncio.sleep(0.1)
        speeds = []
        nbytes = 0
        async with _transport("client", host, port, mode, certs) as t:
            for i in range(repeats):
                speed, nbytes = await timed_pull(t, i)
                speeds.append(speed)
    finally:
        stop.set()
        proc.join(10)
    return speeds, nbytes


# ----------------------------------------------------------------------------- lanes


async def _tcp_sender(nbytes: int, port_q: mp.Queue, stop: mp.Event) -> None:
    from p2pfl.wire.direct import send_buffer

    buf = memoryview(bytearray(b"\x5a" * nbytes))

    async def handle(reader, writer):
        writer.get_extra_info("socket").setsockopt(*NODELAY)
        await reader.readexactly(1)  # the receiver is ready
        await send_buffer(writer, buf)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port_q.put(server.sockets[0].getsockname()[1])
    while not stop.is_set():
        await asyncio.sleep(0.1)


def tcp_sender_main(nbytes, port_q, stop):
    _run(_tcp_sender(nbytes, port_q, stop))


async def tcp_once(port: int, nbytes: int, digest: str | None = None) -> float:
    """Raw TCP: connect, then read ``nbytes`` straight into one buffer (the receiver of the
    direct lane, without its checks or digest). With ``digest``, hash each piece as it
    lands, as the lane does: the cost of the digest alone."""
    import numpy as np

    from p2pfl.wire import direct
    from p2pfl.wire.digest import new_hasher

    buf = memoryview(np.empty(nbytes, dtype=np.uint8)).cast("B")
    t0 = time.perf_counter()
    conn, rx = await direct.connect("127.0.0.1", port, None, 5)
    conn.write(b"!")
    hasher = None if digest is None else new_hasher(digest)
    rx.sink = None if hasher is None else hasher.update
    await rx.read_into(buf)
    if hasher is not None:
        hasher.hexdigest()
    dt = time.perf_counter() - t0
    conn.close()
    return nbytes / dt / 1e6


async def timed_pull(t, round_no: int, lane: str | None = None) -> tuple[float, int]:
    """MB/s and bytes of one pull of the serving node's state by ``t`` (which must take
    ``lane`` when it is given)."""
    from p2pfl.wire.codec import state_nbytes

    t0 = time.perf_counter()
    state = await t.pull("server", round_no, "all", timeout=120)
    dt = time.perf_counter() - t0
    if lane is not None:
        assert t.pull_lanes[-1] == ("server", lane), t.pull_lanes[-1]
    nbytes = state_nbytes(state)
    return nbytes / dt / 1e6, nbytes


async def bench_lanes(repeats: int) -> dict:
    """Raw TCP, the direct-lane pull and the MQTT-lane pull of the ResNet18 state,
    interleaved (one warm-up round discarded): one serving node process with the direct
    lane; a client with the lane pulls directly, one without it over MQTT."""
    from p2pfl.wire.transfers import PreparedState

    nbytes = len(PreparedState.from_state(resnet18_state()).buf)
    ctx = mp.get_context("spawn")
    ready, stop, port_q = ctx.Event(), ctx.Event(), ctx.Queue()
    runs: dict[str, list[float]] = {k: [] for k in ("tcp", *DIGEST_COSTS, "direct", "mqtt")}
    with MosquittoBroker(max_packet_mb=8) as broker:
        procs = [
            ctx.Process(
                target=server_main,
                args=(broker.host, broker.port, ready, stop, Mode("direct", direct=True)),
            ),
            ctx.Process(target=tcp_sender_main, args=(nbytes, port_q, stop)),
        ]
        for proc in procs:
            proc.start()
        try:
            tcp_port = port_q.get(timeout=60)
            while not ready.is_set():
                await asyncio.sleep(0.1)
            on_direct = _transport("client", broker.host, broker.port, Mode("d", direct=True), None)
            on_mqtt = _transport("client-mqtt", broker.host, broker.port, Mode("m"), None)
            async with on_direct, on_mqtt:
                while "direct" not in on_direct.peers.get("server", {}):
                    await asyncio.sleep(0.05)
                for i in range(repeats + 1):
                    # the compared pair back to back, then the digest rows and the MQTT lane
                    speeds = {"tcp": await tcp_once(tcp_port, nbytes)}
                    speeds["direct"] = (await timed_pull(on_direct, i, "direct"))[0]
                    for key, digest in DIGEST_COSTS.items():
                        speeds[key] = await tcp_once(tcp_port, nbytes, digest)
                    speeds["mqtt"] = (await timed_pull(on_mqtt, i, "mqtt"))[0]
                    if i:
                        for lane, v in speeds.items():
                            runs[lane].append(v)
        finally:
            stop.set()
            for proc in procs:
                proc.join(10)
    med = {lane: statistics.median(v) for lane, v in runs.items()}
    return {
        "tcp_MBps": med["tcp"],
        "direct_MBps": med["direct"],
        "mqtt_MBps": med["mqtt"],
        "direct_over_tcp": med["direct"] / med["tcp"],
        "direct_over_tcp_runs": [d / t for d, t in zip(runs["direct"], runs["tcp"], strict=True)],
        **{f"{key}_over_tcp": med[key] / med["tcp"] for key in DIGEST_COSTS},
        "mqtt_over_tcp": med["mqtt"] / med["tcp"],
        "lane_runs_MBps": runs,
        "lane_bytes": nbytes,
    }


async def bench_security(repeats: int, raw_mb: int) -> dict:
    """Raw MQTT over TLS and the pull in every protected :data:`MODES` setting; TLS modes
    on a TLS broker, signatures alone on a plain one."""
    from p2pfl.launch.broker import BrokerTLS
    from p2pfl.security.certs import make_swarm_certs

    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="p2pfl-bench-certs-") as tmp:
        certs = str(make_swarm_certs(Path(tmp), SWARM, IDS).root)
        with MosquittoBroker(max_packet_mb=8, tls=BrokerTLS(Path(certs), SWARM)) as tls_broker:
            runs = [
                await raw_once(tls_broker.host, tls_broker.port, raw_mb, certs)
                for _ in range(repeats + 1)
            ][1:]
            out["raw_tls"] = {"MBps": statistics.median(runs), "runs_MBps": runs}
            for mode in MODES[1:]:
                # a fresh plain broker: no retained unsigned presence from the "off" runs
                with MosquittoBroker(max_packet_mb=8) as plain:
                    port = tls_broker.port if mode.tls else plain.port
                    pulls, _ = await p2pfl_pulls("127.0.0.1", port, repeats + 1, mode, certs)
                out[mode.name] = {"MBps": statistics.median(pulls[1:]), "runs_MBps": pulls[1:]}
    return out


async def bench_brokers(repeats: int, raw_mb: int) -> dict:
    """Raw MQTT and the pull on Mosquitto and on the embedded broker, alternating brokers
    run by run (one warm-up of each discarded), so machine noise hits both alike."""
    names = ("mosquitto", "embedded")
    raw: dict[str, list[float]] = {n: [] for n in names}
    pulls: dict[str, list[float]] = {n: [] for n in names}
    with MosquittoBroker(max_packet_mb=8) as mosq, EmbeddedBroker(max_packet_mb=8) as emb:
        brokers = {"mosquitto": mosq, "embedded": emb}
        for i in range(repeats + 1):
            for name, b in brokers.items():
                speed = await raw_once(b.host, b.port, raw_mb)
                if i:
                    raw[name].append(speed)
        for i in range(repeats + 1):
            for name, b in brokers.items():
                speeds, _ = await p2pfl_pulls(b.host, b.port, 1)
                if i:
                    pulls[name] += speeds
    out: dict = {
        n: {
            "raw_MBps": statistics.median(raw[n]),
            "p2pfl_MBps": statistics.median(pulls[n]),
            "raw_runs_MBps": raw[n],
            "p2pfl_runs_MBps": pulls[n],
        }
        for n in names
    }
    for key in ("raw", "p2pfl"):
        out[f"embedded_over_mosquitto_{key}"] = (
            out["embedded"][f"{key}_MBps"] / out["mosquitto"][f"{key}_MBps"]
        )
    return out


async def bench(repeats: int, raw_mb: int, security: bool = False, embedded: bool = False) -> dict:
    with MosquittoBroker(max_packet_mb=8) as broker:
        # one warm-up run of each (discarded), so neither side pays first-touch costs
        raw = [await raw_once(broker.host, broker.port, raw_mb) for _ in range(repeats + 1)][1:]
        pulls, nbytes = await p2pfl_pulls(broker.host, broker.port, repeats + 1)
        pulls = pulls[1:]
        secure = await bench_security(repeats, raw_mb) if security else None
    lanes = await bench_lanes(repeats)
    brokers = await bench_brokers(repeats, raw_mb) if embedded else None
    raw_mbps = statistics.median(raw)
    p2p_mbps = statistics.median(pulls)
    if secure is not None:
        for mode in MODES[1:]:
            secure[mode.name]["ratio_to_off"] = secure[mode.name]["MBps"] / p2p_mbps
        secure["raw_tls"]["ratio_to_raw"] = secure["raw_tls"]["MBps"] / raw_mbps
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
        **lanes,
        **({"security": secure} if secure is not None else {}),
        **({"brokers": brokers} if brokers is not None else {}),
    }


def main(argv: list[str] | None = None) -> int:
    from p2pfl.wire.sysopt import tune_malloc

    tune_malloc()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--raw-mb", type=int, default=128, help="MiB sent in the raw test")
    ap.add_argument(
        "--security",
        action="store_true",
        help="also measure TLS (client certificates, ACL) and Ed25519 signatures",
    )
    ap.add_argument(
        "--embedded",
        action="store_true",
        help="also compare Mosquitto with the embedded broker (interleaved runs)",
    )
    args = ap.parse_args(argv)
    res = _run(bench(args.repeats, args.raw_mb, args.security, args.embedded))
    from rich.console import Console
    from rich.table import Table

    def speed_row(table: Table, label: str, mbps: float, runs: list[float]) -> None:
        table.add_row(label, f"{mbps:.0f}", ", ".join(f"{x:.0f}" for x in runs))

    t = Table(title="transfer throughput (median of runs, MB/s = 1e6 B/s)")
    t.add_column("path")
    t.add_column("MB/s", justify="right")
    t.add_column("runs")
    speed_row(
        t,
        f"raw MQTT, 1 MiB QoS-1 publishes ({args.raw_mb} MiB)",
        res["raw_MBps"],
        res["raw_runs_MBps"],
    )
    speed_row(
        t,
        f"p2pfl pull, ResNet18 state ({res['state_bytes'] / 1e6:.1f} MB)",
        res["p2pfl_MBps"],
        res["p2pfl_runs_MBps"],
    )
    t.add_row("ratio p2pfl / raw", f"{res['ratio']:.2f}", "target ≥ 0.50")
    t.add_section()
    runs = res["lane_runs_MBps"]
    mb = res["lane_bytes"] / 1e6
    speed_row(t, f"raw loopback TCP ({mb:.1f} MB)", res["tcp_MBps"], runs["tcp"])
    for key, digest in DIGEST_COSTS.items():
        ratio = res[f"{key}_over_tcp"]
        label = f"raw TCP + {digest} as it lands — {ratio:.2f}× TCP"
        speed_row(t, label, statistics.median(runs[key]), runs[key])
    for lane, label in (("direct", "direct lane"), ("mqtt", "MQTT lane")):
        speed_row(t, f"p2pfl pull, {label} ({mb:.1f} MB)", res[lane + "_MBps"], runs[lane])
    per_run = res["direct_over_tcp_runs"]
    t.add_row(
        "ratio direct / TCP, MQTT / TCP",
        f"{res['direct_over_tcp']:.2f}, {res['mqtt_over_tcp']:.2f}",
        f"target ≥ 0.80 (direct); run by run {min(per_run):.2f}–{max(per_run):.2f}",
    )
    sec = res.get("security")
    if sec is not None:
        t.add_section()
        speed_row(
            t,
            f"raw MQTT over TLS (client certificates) — {sec['raw_tls']['ratio_to_raw']:.2f}× raw",
            sec["raw_tls"]["MBps"],
            sec["raw_tls"]["runs_MBps"],
        )
        for mode in MODES[1:]:
            row = sec[mode.name]
            speed_row(
                t,
                f"p2pfl pull, security {mode.name} — {row['ratio_to_off']:.2f}× unprotected",
                row["MBps"],
                row["runs_MBps"],
            )
    brokers = res.get("brokers")
    if brokers is not None:
        t.add_section()
        for name in ("mosquitto", "embedded"):
            row = brokers[name]
            speed_row(t, f"{name}: raw MQTT", row["raw_MBps"], row["raw_runs_MBps"])
            speed_row(t, f"{name}: p2pfl pull", row["p2pfl_MBps"], row["p2pfl_runs_MBps"])
        t.add_row(
            "embedded / mosquitto (raw, pull)",
            f"{brokers['embedded_over_mosquitto_raw']:.2f}, "
            f"{brokers['embedded_over_mosquitto_p2pfl']:.2f}",
            "interleaved runs",
        )
    Console().print(t)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
