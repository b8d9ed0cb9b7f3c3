"""A site daemon seen from outside, on ``observability.listen``: ``/livez`` (the daemon's own
event loop answers), ``/readyz`` (ready, or 503 with the reasons) and ``/metrics`` in the
Prometheus text format (``prometheus_client``, a registry of the daemon's own).

- :class:`SiteMetrics`: the metrics, each named with the ``p2pfl_`` prefix and in base units;
- :class:`ObservabilityServer`: the three routes over a minimal HTTP/1.1 server on the
  daemon's event loop (one request a connection, ``Connection: close``);
- :func:`parse_listen`: ``host:port`` as a pair; :func:`check_listen`: whether it can be bound.

Labels are bounded, so a peer can never grow the series a scraper stores: a run's state is
one of :data:`RUN_STATES`, a lane one of :data:`LANES`, a policy rejection one of
:data:`~p2pfl.sites.policy.rules.REASON_CODES` (else ``other``), and a drop reason one of the first
:data:`MAX_DROP_REASONS` seen (later ones count as ``other``).
"""

from __future__ import annotations

import asyncio
import http
import logging
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

import p2pfl
from p2pfl.errors import P2PFLError
from p2pfl.sites.policy.rules import REASON_CODES

log = logging.getLogger(__name__)

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
"""Every state ``p2pfl_runs{state}`` counts runs in (each exported, 0 when none)."""

LANES = ("mqtt", "direct")
"""The lanes ``p2pfl_bytes_sent_total{lane}`` counts bytes on."""

OTHER = "other"
"""The label value a rejection or drop reason outside the bounded set is counted under."""

MAX_DROP_REASONS = 32
"""How many distinct reasons ``p2pfl_messages_dropped_total`` keeps apart."""

ROUND_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800)
"""Upper bounds (s) of ``p2pfl_round_duration_seconds``: a round of a small model on one
machine takes well under a second, one of a CNN over slow links tens of minutes."""

GATE_DECISIONS = ("promoted", "refused", "failed")
"""What became of a finished run's model at the gate (``failed``: not kept at all)."""

MAX_METRIC_RUNS = 8
"""How many runs ``p2pfl_run_metric`` shows (the newest this site measured)."""


@dataclass(frozen=True)
class ServedModel:
    """What ``/metrics`` says of the served model: its id, run, and held-out score."""

    id: str
    run_id: str
    metric: str
    score: float | None


CONTENT_TYPE = CONTENT_TYPE_LATEST
"""The content type of :meth:`SiteMetrics.render`'s text (Prometheus exposition format)."""

MAX_HEAD_BYTES = 8192
"""The most bytes a request line and its headers may take (more: 431)."""

READ_TIMEOUT_S = 5.0
"""How long a client has to send its request, and again to take the answer."""


class SiteMetrics:
    """The daemon's metrics, in a registry of its own (never ``prometheus_client``'s global
    one, so two daemons in one process, or a test, never share a series).

    Meters never raise into the daemon for a value it measured: a negative byte count or
    drop count is ignored (a counter never goes down), an unknown reason becomes ``other``.
    Only a lane outside :data:`LANES` raises (``ValueError``): the callers name lanes in code.
    """

    def __init__(
        self,
        site: str = "",
        *,
        serving_dir: Path | None = None,
        served: Callable[[], ServedModel | None] | None = None,
    ):
        """``site``: the site's name, a label of ``p2pfl_build_info`` beside ``version`` (one
        value per daemon, so still bounded). ``serving_dir``: the folder the serving
        processes count into (:mod:`~p2pfl.sites.models.serving_meter`), read back at each
        scrape; ``served``: what the site serves now, asked at each scrape."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        if serving_dir is not None:
            from prometheus_client.multiprocess import MultiProcessCollector

            MultiProcessCollector(r, path=str(serving_dir))
        self._served = served
        self.served_model = Gauge(
            "p2pfl_served_model_info",
            "1, labelled with the served model's id and the run it came from",
            ["model", "run_id"],
            registry=r,
        )
        self.served_metric = Gauge(
            "p2pfl_served_model_metric",
            "the served model's held-out promote.metric when it was judged",
            ["metric"],
            registry=r,
        )
        self._served_labels: tuple[tuple[str, str], tuple[str, ...]] | None = None
        self.gate_decisions = Counter(
            "p2pfl_gate_decisions_total",
            "finished runs' models judged at the gate",
            ["decision"],
            registry=r,
        )
        for decision in GATE_DECISIONS:
            self.gate_decisions.labels(decision)
        self.run_metric = Gauge(
            "p2pfl_run_metric",
            "this site's latest test_* figures of its newest runs",
            ["run_id", "metric"],
            registry=r,
        )
        self._metric_runs: dict[str, set[str]] = {}  # run id -> its metric names, oldest first
        build = Gauge(
            "p2pfl_build_info", "1, labelled with p2pfl's version", ["version", "site"], registry=r
        )
        build.labels(p2pfl.__version__, site).set(1)
        self.runs = Gauge("p2pfl_runs", "runs at this site by state", ["state"], registry=r)
        for state in RUN_STATES:
            self.runs.labels(state).set(0)
        self.round_duration = Histogram(
            "p2pfl_round_duration_seconds",
            "rounds this site's workers finished",
            buckets=ROUND_BUCKETS,
            registry=r,
        )
        self.bytes_sent = Counter(
            "p2pfl_bytes_sent_total", "bytes this site's workers sent", ["lane"], registry=r
        )
        for lane in LANES:
            self.bytes_sent.labels(lane)  # exported at 0 before the first byte
        self.peers_online = Gauge(
            "p2pfl_peers_online", "peers heard in the last finished round", registry=r
        )
        self.messages_dropped = Counter(
            "p2pfl_messages_dropped_total",
            "site messages dropped, by reason",
            ["reason"],
            registry=r,
        )
        self.policy_rejections = Counter(
            "p2pfl_policy_rejections_total", "policy refusals by reason", ["reason"], registry=r
        )
        for reason in (*REASON_CODES, OTHER):
            self.policy_rejections.labels(reason)
        self.dp_epsilon = Gauge(
            "p2pfl_dp_epsilon_spent", "the DP epsilon spent by the last run", registry=r
        )
        self._drop_reasons: set[str] = set()

    def set_runs(self, counts: Mapping[str, int]) -> None:
        """The number of runs in each state; a state of :data:`RUN_STATES` that ``counts``
        leaves out is 0, a state outside it is ignored."""
        for state in RUN_STATES:
            self.runs.labels(state).set(counts.get(state, 0))

    def observe_round(self, seconds: float) -> None:
        """One round a worker finished, in ``seconds``."""
        self.round_duration.observe(seconds)

    def add_bytes(self, lane: str, n: int) -> None:
        """``n`` more bytes sent on ``lane`` (``mqtt`` or ``direct``; another raises
        ``ValueError``)."""
        if lane not in LANES:
            raise ValueError(f"lane must be one of {LANES}, got {lane!r}")
        if n > 0:
            self.bytes_sent.labels(lane).inc(n)

    def set_peers_online(self, n: int) -> None:
        """How many peers the last finished round heard."""
        self.peers_online.set(n)

    def dropped(self, reason: str, n: int = 1) -> None:
        """``n`` site messages dropped for ``reason``; past :data:`MAX_DROP_REASONS` distinct
        reasons, a new one counts as ``other`` (reasons may carry what a peer sent)."""
        if n <= 0:
            return
        if reason not in self._drop_reasons:
            if len(self._drop_reasons) >= MAX_DROP_REASONS:
                reason = OTHER
            else:
                self._drop_reasons.add(reason)
        self.messages_dropped.labels(reason).inc(n)

    def rejected(self, reason: str) -> None:
        """One policy refusal for ``reason`` (a code outside ``REASON_CODES``: ``other``)."""
        self.policy_rejections.labels(reason if reason in REASON_CODES else OTHER).inc()

    def set_epsilon(self, epsilon: float) -> None:
        """The DP ε the last run's records show spent."""
        self.dp_epsilon.set(epsilon)

    def judged(self, decision: str) -> None:
        """One finished run's model judged at the gate: ``decision`` one of
        :data:`GATE_DECISIONS` (another counts as ``failed``)."""
        self.gate_decisions.labels(decision if decision in GATE_DECISIONS else "failed").inc()

    def set_run_metrics(self, run_id: str, metrics: Mapping[str, float]) -> None:
        """This site's latest ``metrics`` of run ``run_id``; the runs beyond the newest
        :data:`MAX_METRIC_RUNS` leave the series (a bounded label set)."""
        names = self._metric_runs.pop(run_id, set())
        for gone in names - set(metrics):
            self.run_metric.remove(run_id, gone)
        for name, value in metrics.items():
            self.run_metric.labels(run_id, name).set(value)
        self._metric_runs[run_id] = set(metrics)
        while len(self._metric_runs) > MAX_METRIC_RUNS:
            old = next(iter(self._metric_runs))
            for name in self._metric_runs.pop(old):
                self.run_metric.remove(old, name)

    def _refresh_served(self) -> None:
        """The served model's series, as ``served()`` says now."""
        served = self._served() if self._served is not None else None
        labels = None if served is None else ((served.id, served.run_id), (served.metric,))
        if labels != self._served_labels:  # another model: the old one's series go
            if self._served_labels is not None:
                self.served_model.remove(*self._served_labels[0])
                self.served_metric.remove(*self._served_labels[1])
            self._served_labels = labels
        if served is not None:
            self.served_model.labels(served.id, served.run_id).set(1)
            if served.score is not None:
                self.served_metric.labels(served.metric).set(served.score)

    def render(self) -> bytes:
        """Every metric in the Prometheus text format (:data:`CONTENT_TYPE`)."""
        self._refresh_served()
        return generate_latest(self.registry)


def parse_listen(value: str) -> tuple[str, int]:
    """``host:port`` (``[v6-address]:port`` too) as ``(host, port)``; port 0 asks for a free
    one. Raises ``ValueError`` for anything else. (The site file checks ``listen`` the same
    way when it loads.)"""
    host, sep, port = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise ValueError(f"listen must be 'host:port', got {value!r}")
    return host, int(port)


class ListenError(P2PFLError, OSError):
    """A ``listen`` address cannot be bound (taken, or not this machine's): its field,
    address and the system's words."""


def check_listen(field: str, value: str) -> None:
    """Bind ``value`` (``host:port``) for a moment, as a server would (``SO_REUSEADDR``: a
    port left in TIME_WAIT is free), so a daemon stops at its start, with a
    :class:`ListenError` naming ``field``, rather than a server of it failing later. Port 0
    is always free."""
    host, port = parse_listen(value)
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(1)
    except OSError as exc:
        raise ListenError(f"{field} {value}: {exc.strerror or exc}") from None


class _HeadTooLarge(Exception):
    """The request line and headers ran past :data:`MAX_HEAD_BYTES`."""


class _BadRequest(Exception):
    """The request is not one HTTP/1.x request line and headers."""


Answer = tuple[int, dict[str, str], bytes]


class ObservabilityServer:
    """``/livez``, ``/readyz`` and ``/metrics`` over HTTP/1.1 on ``host:port``.

    - ``GET /livez``: 200 ``ok``. It never looks at peers or the broker: the answer comes
      from the daemon's own event loop, so getting one proves the loop runs;
    - ``GET /readyz``: 200 ``ready`` when ``not_ready()`` returns no reason, else 503 with
      one reason a line;
    - ``GET /metrics``: 200, ``metrics.render()`` as :data:`CONTENT_TYPE`;
    - ``HEAD`` of each: its headers only. Another path: 404; another method: 405; a request
      that does not parse: 400; a head over :data:`MAX_HEAD_BYTES`: 431; a route that fails
      (``not_ready`` raising): 500, logged. Nothing a client sends raises out of a handler.

    One request a connection (``Connection: close``). A client has ``read_timeout`` seconds
    to send its request line and headers (else it is dropped unanswered) and as long again
    to take the answer (else the connection is reset).

    Explicit lifecycle: :meth:`start` / :meth:`aclose`, or ``async with``. :attr:`port` is
    the bound port once started (port 0 picks a free one; with a host that resolves to
    several addresses, the first socket's).
    """

    def __init__(
        self,
        host: str,
        port: int,
        metrics: SiteMetrics,
        not_ready: Callable[[], list[str]],
        *,
        read_timeout: float = READ_TIMEOUT_S,
    ):
        self.host, self.port = host, port
        self.metrics = metrics
        self.not_ready = not_ready
        self.read_timeout = read_timeout
        self._server: asyncio.AbstractServer | None = None
        self._handlers: set[asyncio.Task] = set()

    async def start(self) -> None:
        """Listen (a :class:`ListenError`, an ``OSError``, when the address is taken).
        Raises ``RuntimeError`` when already started."""
        if self._server is not None:
            raise RuntimeError("the observability server is already started")
        try:
            self._server = await asyncio.start_server(
                self._serve, self.host, self.port, limit=MAX_HEAD_BYTES
            )
        except OSError as exc:
            raise ListenError(
                f"observability.listen {self.host}:{self.port}: {exc.strerror or exc}"
            ) from None
        self.port = self._server.sockets[0].getsockname()[1]

    async def aclose(self) -> None:
        """Stop listening and end the connections still open (idempotent)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        # ended here: a client still sending its request would otherwise hold the close
        # for up to read_timeout (Python 3.12's wait_closed waits for every connection)
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await server.wait_closed()

    async def __aenter__(self) -> ObservabilityServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection: read a request, answer it, close. Never raises."""
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        unread = False  # the client may have sent more than was read (an error answer)
        try:
            try:
                lines = await asyncio.wait_for(_read_head(reader), self.read_timeout)
            except asyncio.TimeoutError:
                return  # a client that says nothing in time is dropped unanswered
            except _HeadTooLarge:
                answer, method, unread = _plain(431, "request header fields too large"), "GET", True
            except _BadRequest as exc:
                answer, method = _plain(400, f"bad request: {exc}"), "GET"
            else:
                if lines is None:
                    return  # connected and left: nobody to answer
                try:
                    method, target = _request_line(lines)
                except _BadRequest as exc:
                    answer, method, unread = _plain(400, f"bad request: {exc}"), "GET", True
                else:
                    answer = self._answer(method, target)
            writer.write(_response(answer, head_only=method == "HEAD"))
            await asyncio.wait_for(writer.drain(), self.read_timeout)
            if unread and writer.can_write_eof():
                # closing with bytes still unread would reset the connection, and the
                # client could lose the answer: end our side, let it finish sending
                writer.write_eof()
                await asyncio.wait_for(_discard(reader), self.read_timeout)
            writer.close()
            await asyncio.wait_for(writer.wait_closed(), self.read_timeout)
        except (asyncio.TimeoutError, OSError):
            writer.transport.abort()  # gone, or will not take the answer: reset
        except asyncio.CancelledError:
            # aclose ends the connection. The task is the stream server's own, awaited by
            # no caller, so it ends quietly: re-raised, Python 3.11's stream callback logs
            # the cancellation as an error
            pass
        except Exception:
            log.exception("observability: a request failed")
        finally:
            if not writer.is_closing():  # returned early, or cancelled by aclose
                if writer.transport.get_write_buffer_size():
                    writer.transport.abort()  # close() would wait for the client to read
                else:
                    writer.close()
            if task is not None:
                self._handlers.discard(task)

    def _answer(self, method: str, target: str) -> Answer:
        """The answer to ``method`` on ``target`` (a request that parsed)."""
        if method not in ("GET", "HEAD"):
            code, headers, body = _plain(405, "method not allowed")
            return code, {**headers, "Allow": "GET, HEAD"}, body
        path = target.split("?", 1)[0]
        try:
            if path == "/livez":
                return _plain(200, "ok")
            if path == "/readyz":
                why = self.not_ready()
                return _plain(503, "\n".join(why)) if why else _plain(200, "ready")
            if path == "/metrics":
                return 200, {"Content-Type": CONTENT_TYPE}, self.metrics.render()
        except Exception:
            log.exception("observability: %s %s failed", method, path)
            return _plain(500, "internal error")
        return _plain(404, "not found")


async def _read_head(reader: asyncio.StreamReader) -> list[bytes] | None:
    """The request line and header lines, without the blank line that ends them; None when
    the client closed before sending anything. Raises :class:`_HeadTooLarge` past
    :data:`MAX_HEAD_BYTES` (the reader's own limit stops one long line first) and
    :class:`_BadRequest` when the client closed in the middle."""
    lines: list[bytes] = []
    size = 0
    while True:
        try:
            line = await reader.readuntil(b"\n")
        except asyncio.LimitOverrunError:
            raise _HeadTooLarge from None
        except asyncio.IncompleteReadError as exc:
            if lines or exc.partial.strip():
                raise _BadRequest("the client closed before the end of its headers") from None
            return None
        size += len(line)
        if size > MAX_HEAD_BYTES:
            raise _HeadTooLarge
        if line.strip(b"\r\n"):
            lines.append(line.rstrip(b"\r\n"))
        elif lines:
            return lines
        # an empty line before the request line is skipped (RFC 9112, section 2.2)


def _request_line(lines: list[bytes]) -> tuple[str, str]:
    """The method and target of a request's head; raises :class:`_BadRequest` when its
    request line or a header line is malformed."""
    try:
        first = lines[0].decode("ascii")
    except UnicodeDecodeError:
        raise _BadRequest("the request line is not ASCII") from None
    parts = first.split(" ")
    if len(parts) != 3:
        raise _BadRequest("the request line is not 'METHOD TARGET HTTP/1.x'")
    method, target, version = parts
    if not method.isalpha() or not method.isupper():
        raise _BadRequest(f"method {method!r}")
    if version not in ("HTTP/1.0", "HTTP/1.1"):
        raise _BadRequest(f"version {version!r}")
    if not target.startswith("/") and target != "*":
        raise _BadRequest(f"target {target!r}")
    for line in lines[1:]:
        name, sep, _ = line.partition(b":")
        if not sep or not name or name != name.strip():
            raise _BadRequest("a header line is not 'Name: value'")
    return method, target


async def _discard(reader: asyncio.StreamReader) -> None:
    """Read and drop what the client still sends, up to its end or 64 KiB."""
    left = 65536
    while left > 0 and (chunk := await reader.read(min(left, 8192))):
        left -= len(chunk)


def _plain(code: int, text: str) -> Answer:
    """A text/plain answer: ``text`` and a newline."""
    return code, {"Content-Type": "text/plain; charset=utf-8"}, (text + "\n").encode()


def _response(answer: Answer, *, head_only: bool) -> bytes:
    """The bytes of ``answer``: status line, headers, and the body unless ``head_only`` (a
    HEAD's headers still give the body's length)."""
    code, headers, body = answer
    lines = [f"HTTP/1.1 {code} {http.HTTPStatus(code).phrase}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    lines += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
    return "\r\n".join(lines).encode("ascii") + (b"" if head_only else body)
