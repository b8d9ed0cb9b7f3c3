"""The dashboard's HTTP server, and the ways to run it.

:class:`Dashboard` serves one run directory on an asyncio HTTP/1.1 server of its own (GET
and HEAD only, one request per connection, nothing but the routes below):

- ``/``: the page (``static/index.html``); ``/static/<name>``: its script and style, shipped
  in the package (no CDN: it works offline);
- ``/api/state``: the JSON snapshot (:func:`p2pfl.dashboard.snapshot.build_snapshot`), which
  the page polls about once a second.

Beside the server it re-reads the run directory every ``poll_s`` seconds
(:class:`~p2pfl.dashboard.runstate.RunState`) and observes the swarm's broker
(:func:`~p2pfl.dashboard.observer.observe`): the one named by ``broker``, or with
:data:`AUTO` the one the run's ``config.yaml`` records, re-targeted when that file changes.
A TLS swarm's broker is observed with the swarm's observer identity (``observer.crt`` and
``observer.key`` from ``p2pfl certs``, in ``certs`` or else the run's ``security.certs``;
read-only in the broker's ACL): without one, the swarm is shown from its records, and the
page says why.

Bound to a loopback address (the default), it answers only requests whose ``Host`` is a
loopback name, so a web page elsewhere cannot read it through DNS rebinding.

:class:`DashboardThread` runs one in a background thread (the launcher's ``--dashboard``);
:func:`run_dashboard` runs one in the foreground until Ctrl-C (``p2pfl dashboard``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from p2pfl.background import cancel_and_wait
from p2pfl.config.schema import BrokerAddress
from p2pfl.dashboard.live import LiveState
from p2pfl.dashboard.observer import observe, observer_tls_context
from p2pfl.dashboard.runstate import RunState
from p2pfl.dashboard.snapshot import build_snapshot
from p2pfl.errors import P2PFLError
from p2pfl.security.certs import CertError, SwarmCerts

log = logging.getLogger(__name__)

AUTO = "auto"  # observe the broker the run directory's config.yaml records
MAX_REQUEST_BYTES = 16 << 10
REQUEST_TIMEOUT_S = 10.0
STATIC_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
SECURITY_HEADERS = (
    ("Cache-Control", "no-store"),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    (
        "Content-Security-Policy",
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    ),
)
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}
REASONS |= {421: "Misdirected Request", 500: "Internal Server Error"}


class DashboardError(P2PFLError, RuntimeError):
    """The dashboard could not start (e.g. its port is taken)."""


def static_files() -> dict[str, tuple[bytes, str]]:
    """``{name: (bytes, content type)}`` of the page's files shipped in the package."""
    out = {}
    for entry in (resources.files("p2pfl.dashboard") / "static").iterdir():
        ctype = STATIC_TYPES.get(Path(entry.name).suffix)
        if ctype is not None and entry.is_file():
            out[entry.name] = (entry.read_bytes(), ctype)
    return out


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, an IPv6 one maybe in brackets) is loopback."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_of(value: str) -> str:
    """The host part of a ``Host`` header (``name``, ``name:port``, ``[v6]:port``)."""
    if value.startswith("["):
        return value[: value.find("]") + 1] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


@dataclass(frozen=True)
class _Target:
    swarm: str
    host: str
    port: int
    node_ids: tuple[str, ...]
    certs: str | None = None  # the observer identity's directory (a TLS swarm)


class Dashboard:
    """One run directory served at ``http://host:port/`` (port 0: a free one) until
    :meth:`close`. ``broker``: :data:`AUTO`, an address, or None (records only).
    ``certs``: the ``p2pfl certs`` directory whose observer identity the dashboard
    presents to a TLS swarm's broker (None: the run's ``security.certs``)."""

    def __init__(
        self,
        run_dir: Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        broker: BrokerAddress | str | None = AUTO,
        certs: Path | str | None = None,
        poll_s: float = 0.5,
    ):
        self.run = RunState(Path(run_dir))
        self.host, self.port = host, port
        self.broker = broker
        self.certs = certs
        self.poll_s = poll_s
        self.live: LiveState | None = None
        self.broker_note = ""
        self._observer_note = ""  # why the current target is not observed (its identity)
        self._target: _Target | None = None
        self._observer: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._server: asyncio.AbstractServer | None = None
        self._static = static_files()
        self._loopback_only = is_loopback(host)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    async def start(self) -> str:
        """Read the run directory, bind, start watching; return the URL."""
        self._refresh()
        try:
            self._server = await asyncio.start_server(
                self._client, self.host, self.port, limit=MAX_REQUEST_BYTES
            )
        except OSError as exc:
            why = os.strerror(exc.errno) if exc.errno else str(exc)
            raise DashboardError(
                f"dashboard: cannot listen on {self.host}:{self.port}: {why}"
            ) from None
        self.port = self._server.sockets[0].getsockname()[1]
        self._watcher = asyncio.create_task(self._watch(), name="dashboard-watch")
        return self.url

    async def close(self) -> None:
        """Stop serving, watching and observing; idempotent."""
        for task in (self._watcher, self._observer):
            if task is not None:
                with contextlib.suppress(Exception):
                    await cancel_and_wait(task)
        self._watcher = self._observer = None
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None

    # ------------------------------------------------------------------ watching
    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            self._refresh()

    def _refresh(self) -> None:
        try:
            self.run.refresh()
        except Exception as exc:  # a surprise in the files must not stop the page
            log.warning("dashboard: reading %s failed: %r", self.run.run_dir, exc)
        self._retarget()

    def _wanted(self) -> tuple[_Target | None, str]:
        """The broker to observe now, or None and why not."""
        cfg = self.run.cfg
        if cfg is None:
            return None, "waiting for the run's config.yaml"
        if self.broker is None:
            return None, "records only (no broker asked for)"
        certs = None
        if cfg.security.tls:
            certs = self.certs or cfg.security.certs
            if certs is None:
                return None, (
                    "records only: a TLS swarm, and no certificate directory to take the "
                    "observer identity from (security.certs)"
                )
            paths = SwarmCerts(Path(certs))
            if not (paths.observer_cert.is_file() and paths.observer_key.is_file()):
                return None, (
                    f"records only: a TLS swarm, and {paths.root} has no observer identity "
                    "(observer.crt, observer.key: run p2pfl certs on it to add one)"
                )
        if isinstance(self.broker, BrokerAddress):
            address: BrokerAddress | None = self.broker
        else:
            address = self.run.broker()
        if address is None or address.mdns:
            return None, "records only: the broker is found by mDNS (give --broker HOST:PORT)"
        target = _Target(
            cfg.name,
            address.host,
            address.port,
            tuple(cfg.node_ids),
            None if certs is None else str(certs),
        )
        return target, ""

    def _retarget(self) -> None:
        target, note = self._wanted()
        if target != self._target:
            if self._observer is not None:
                self._observer.cancel()
                self._observer = None
            self._target, self.live, self._observer_note = target, None, ""
            if target is not None:
                self._observe(target)
        self.broker_note = note or self._observer_note

    def _observe(self, target: _Target) -> None:
        """Start observing ``target`` (over TLS with the observer identity when it names a
        certificate directory); an unusable identity leaves the records only, and says why."""
        try:
            tls = observer_tls_context(target.certs) if target.certs is not None else None
        except CertError as exc:
            self._observer_note = f"records only: {exc}"
            return
        self.live = LiveState(target.swarm, target.node_ids)
        self._observer = asyncio.create_task(
            observe(self.live, target.host, target.port, tls_context=tls),
            name="dashboard-observer",
        )

    def snapshot(self) -> dict[str, Any]:
        """What ``/api/state`` returns now."""
        address = f"{self._target.host}:{self._target.port}" if self.live is not None else None
        return build_snapshot(self.run, self.live, broker=address, broker_note=self.broker_note)

    # ------------------------------------------------------------------ HTTP
    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
            status, ctype, body = self._respond(head)
            method = head.split(b" ", 1)[0]
            await self._send(writer, status, ctype, body, head_only=method == b"HEAD")
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # a slow, cut or oversized request: no answer
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _respond(self, head: bytes) -> tuple[int, str, bytes]:
        text = "text/plain; charset=utf-8"
        try:
            lines = head.decode("latin-1").split("\r\n")
            method, target, _version = lines[0].split(" ")
        except ValueError:
            return 400, text, b"bad request\n"
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        if method not in ("GET", "HEAD"):
            return 405, text, b"only GET and HEAD\n"
        if self._loopback_only and not is_loopback(_host_of(headers.get("host", ""))):
            return 421, text, b"this dashboard answers only to a loopback Host\n"
        path = target.split("?", 1)[0]
        if path in ("/", "/index.html"):
            page, ctype = self._static["index.html"]
            return 200, ctype, page
        if path.startswith("/static/") and path[len("/static/") :] in self._static:
            data, ctype = self._static[path[len("/static/") :]]
            return 200, ctype, data
        if path == "/api/state":
            try:
                body = json.dumps(self.snapshot(), separators=(",", ":"), allow_nan=False)
            except Exception as exc:  # a bug: say so, keep serving
                log.warning("dashboard: snapshot failed: %r", exc)
                return 500, text, b"snapshot failed\n"
            return 200, "application/json", body.encode()
        return 404, text, b"not found\n"

    async def _send(
        self,
        writer: asyncio.StreamWriter,
        status: int,
        ctype: str,
        body: bytes,
        *,
        head_only: bool = False,
    ) -> None:
        lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}"]
        lines += [f"Content-Type: {ctype}", f"Content-Length: {len(body)}", "Connection: close"]
        lines += [f"{k}: {v}" for k, v in SECURITY_HEADERS]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        if not head_only:
            writer.write(body)
        await writer.drain()


class DashboardThread:
    """A :class:`Dashboard` on its own event loop in a daemon thread, for a caller that is
    not asynchronous (the launcher). :meth:`start` returns once it listens (or raises
    :class:`DashboardError`); :meth:`stop` stops it."""

    def __init__(self, run_dir: Path, **options: Any):
        self._run_dir = Path(run_dir)
        self._options = options
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.url: str | None = None

    def start(self, timeout: float = 15.0) -> str:
        self._thread = threading.Thread(target=self._main, name="p2pfl-dashboard", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise DashboardError("dashboard: did not start in time")
        if self._error is not None:
            raise self._error
        assert self.url is not None
        return self.url

    def _main(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._serve())
        finally:
            loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        dash = Dashboard(self._run_dir, **self._options)
        try:
            self.url = await dash.start()
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            await dash.close()
            return
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await dash.close()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving and join the thread; idempotent."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop just finished
                loop.call_soon_threadsafe(stop.set)
        if self._thread is not None:
            self._thread.join(timeout)

    def wait(self) -> None:
        """Block until the dashboard stops or Ctrl-C (KeyboardInterrupt) arrives."""
        try:
            while self._thread is not None and self._thread.is_alive():
                self._thread.join(0.5)
        except KeyboardInterrupt:
            pass


def run_dashboard(
    run_dir: Path,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    broker: BrokerAddress | str | None = AUTO,
    certs: Path | str | None = None,
    announce: Callable[[str], None] = print,
) -> int:
    """Serve ``run_dir`` in the foreground until SIGINT or SIGTERM; ``announce`` gets the
    URL once it listens; ``certs``: as :class:`Dashboard`'s. Returns the exit code (0)."""

    async def main() -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        dash = Dashboard(Path(run_dir), host=host, port=port, broker=broker, certs=certs)
        try:
            url = await dash.start()
            announce(url)
            await stop.wait()
        finally:
            await dash.close()
        return 0

    return asyncio.run(main())


class SwarmDashboard:
    """``p2pfl swarm --dashboard``: a :class:`DashboardThread` over the run directory,
    started by the launcher once the run's config is written (:meth:`start`, its
    ``on_start``) and, after the swarm, stopped (:meth:`finish`); with ``keep`` it serves
    the finished run until Ctrl-C first (not after a swarm stopped by Ctrl-C: exit code
    130)."""

    def __init__(self, run_dir: Path, host: str, port: int, *, keep: bool, console: Any):
        self.thread = DashboardThread(run_dir, host=host, port=port)
        self.keep = keep
        self.console = console

    def start(self, _cfg: Any = None) -> None:
        url = self.thread.start()
        self.console.print(f"[bold]dashboard[/] {url}", highlight=False)

    def finish(self, code: int = 0) -> None:
        try:
            if self.keep and self.thread.url and code != 130:
                self.console.print(
                    f"[bold]dashboard[/] {self.thread.url} stays up: Ctrl-C to stop it",
                    highlight=False,
                )
                self.thread.wait()
        finally:
            self.thread.stop()
