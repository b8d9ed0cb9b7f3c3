"""A site daemon seen from outside, on ``observability.listen``: ``/livez`` (the daemon's own
event loop answers), ``/readyz`` (ready, or 503 with the reasons) and ``/metrics`` in the
Prometheus text format (``prometheus_client``, a registry of the daemon's own).

Labels are bounded: a run's state is one of :data:`RUN_STATES`, a lane ``mqtt`` or
``direct``, a policy rejection one of :data:`~p2pfl.sites.policy.REASON_CODES`, and a drop
reason one of the first :data:`MAX_DROP_REASONS` seen (later ones count as ``other``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

import p2pfl
from p2pfl.sites.policy import REASON_CODES

RUN_STATES = (
    "proposed",
    "pending",
    "committed",
    "running",
    "finished",
    "failed",
    "aborted",
    "cancelled",
)
LANES = ("mqtt", "direct")
MAX_DROP_REASONS = 32
CONTENT_TYPE = CONTENT_TYPE_LATEST
MAX_HEAD_BYTES = 8192


class SiteMetrics:
    """The daemon's metrics, in a registry of its own (:meth:`render`)."""

    def __init__(self, site: str):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        build = Gauge("p2pfl_build_info", "p2pfl's version", ["version"], registry=r)
        build.labels(getattr(p2pfl, "__version__", "unknown")).set(1)
        self.runs = Gauge("p2pfl_runs", "runs at this site by state", ["state"], registry=r)
        for state in RUN_STATES:
            self.runs.labels(state).set(0)
        self.round_duration = Histogram(
            "p2pfl_round_duration_seconds",
            "rounds this site's workers finished",
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800),
            registry=r,
        )
        self.bytes_sent = Counter(
            "p2pfl_bytes_sent_total", "bytes this site's workers sent", ["lane"], registry=r
        )
        for lane in LANES:
            self.bytes_sent.labels(lane)
        self.peers_online = Gauge("p2pfl_peers_online", "peers heard in the last round", registry=r)
        self.messages_dropped = Counter(
            "p2pfl_messages_dropped_total", "site messages dropped", ["reason"], registry=r
        )
        self.policy_rejections = Counter(
            "p2pfl_policy_rejections_total", "policy refusals by reason", ["reason"], registry=r
        )
        self.dp_epsilon = Gauge("p2pfl_dp_epsilon_spent", "ε spent by the last run", registry=r)
        self._drop_reasons: set[str] = set()

    def set_runs(self, counts: Mapping[str, int]) -> None:
        for state in RUN_STATES:
            self.runs.labels(state).set(counts.get(state, 0))

    def observe_round(self, seconds: float) -> None:
        self.round_duration.observe(seconds)

    def add_bytes(self, lane: str, n: int) -> None:
        if n > 0:
            self.bytes_sent.labels(lane if lane in LANES else "mqtt").inc(n)

    def set_peers_online(self, n: int) -> None:
        self.peers_online.set(n)

    def dropped(self, reason: str, n: int = 1) -> None:
        if reason not in self._drop_reasons and len(self._drop_reasons) >= MAX_DROP_REASONS:
            reason = "other"
        self._drop_reasons.add(reason)
        self.messages_dropped.labels(reason).inc(n)

    def rejected(self, reason: str) -> None:
        self.policy_rejections.labels(reason if reason in REASON_CODES else "other").inc()

    def set_epsilon(self, epsilon: float) -> None:
        self.dp_epsilon.set(epsilon)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def parse_listen(value: str) -> tuple[str, int]:
    """``host:port`` (as the site file checked it) as a pair."""
    host, _, port = value.rpartition(":")
    return host.strip("[]"), int(port)


class ObservabilityServer:
    """``/livez``, ``/readyz`` and ``/metrics`` on ``host:port`` (port 0: a free one, then
    :attr:`port`). ``not_ready`` gives why the daemon is not ready (empty: ready). Explicit
    lifecycle: :meth:`start` / :meth:`aclose`, or ``async with``."""

    def __init__(
        self,
        host: str,
        port: int,
        metrics: SiteMetrics,
        not_ready: Callable[[], list[str]],
        read_timeout: float = 5.0,
    ):
        self.host, self.port = host, port
        self.metrics = metrics
        self.not_ready = not_ready
        self.read_timeout = read_timeout
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._serve, self.host, self.port, limit=MAX_HEAD_BYTES
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> ObservabilityServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _answer(self, method: str, path: str) -> tuple[int, str, bytes]:
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", b"method not allowed\n"
        path = path.split("?", 1)[0]
        if path == "/livez":
            return 200, "text/plain", b"ok\n"
        if path == "/readyz":
            why = self.not_ready()
            if why:
                return 503, "text/plain", ("\n".join(why) + "\n").encode()
            return 200, "text/plain", b"ready\n"
        if path == "/metrics":
            return 200, CONTENT_TYPE, self.metrics.render()
        return 404, "text/plain", b"not found\n"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.read_timeout)
                parts = head.split(b"\r\n", 1)[0].decode("ascii").split()
                if len(parts) != 3 or not parts[2].startswith("HTTP/"):
                    raise ValueError("bad request line")
                method = parts[0]
                code, ctype, body = self._answer(method, parts[1])
            except (asyncio.LimitOverrunError, asyncio.IncompleteReadError, ValueError):
                method, (code, ctype, body) = "GET", (400, "text/plain", b"bad request\n")
            reason = {
                200: "OK",
                400: "Bad Request",
                404: "Not Found",
                405: "Method Not Allowed",
                503: "Service Unavailable",
            }[code]
            head_out = (
                f"HTTP/1.1 {code} {reason}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            ).encode()
            writer.write(head_out + (b"" if method == "HEAD" else body))
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
