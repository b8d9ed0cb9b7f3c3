"""The HTTP side of a site's served model (docs/design.md, "A site's own models"):
aiohttp's server on the socket a :class:`~p2pfl.sites.models.serving.ModelServer` bound,
on one event loop a serving process, each request routed (:func:`route`) to the server's
answers and metered (:mod:`~p2pfl.sites.models.serving_meter`).

One loop, not a thread a connection: a process answers its connections' requests one at a
time, in the order they come (an answer is mostly Python, which holds the GIL; threads
would only take it from each other mid-answer and answer out of order), and a pool of such
processes (:mod:`~p2pfl.sites.models.serving_pool`) uses the cores.

The contract of every route: connections are kept alive (HTTP/1.1) and dropped after
:data:`IDLE_S` without a request; each answer is JSON (``Cache-Control: no-store``); an
unknown path is a 404, a known one asked with another method a 405 naming the method it
takes (``Allow``); a body without a length (``Content-Length`` or chunked) a 411, one over
``serving.max_request_bytes`` a 413, unread, on a connection then closed; a bad request a
4xx that says what is wrong (:class:`BadRequest`)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from http import HTTPStatus
from typing import Any, Protocol

from aiohttp import web

from p2pfl.errors import P2PFLError
from p2pfl.sites.models import oip, serving_meter

log = logging.getLogger(__name__)

IDLE_S = 30.0
"""A keep-alive connection silent this long is closed."""
STOP_S = 5.0
"""How long a stopping server lets the requests under way finish."""
ACCEPT_RETRY_S = 1.0
"""After an accept that failed for want of descriptors, the wait before the next."""


class BadRequest(P2PFLError, ValueError):
    """A request the server cannot answer: the status and what to tell the client."""

    def __init__(self, status: HTTPStatus, message: str):
        super().__init__(message)
        self.status = status


class Answers(Protocol):
    """What the HTTP side asks of the served model
    (:class:`~p2pfl.sites.models.serving.ModelServer`); each answer raises
    :class:`BadRequest` for a request it cannot answer."""

    max_request_bytes: int

    @property
    def served(self) -> Any: ...  # the model answering now; None before one is served

    def model_name(self) -> str: ...

    def served_or_503(self) -> Any: ...

    def v2_metadata(self) -> dict[str, Any]: ...

    def predict(self, content_type: str, body: bytes) -> dict[str, Any]: ...

    def v2_infer(self, body: bytes, header_length: str | None) -> dict[str, Any]: ...


def route(path: str, name: str) -> tuple[str, str] | None:
    """What ``path`` asks and the one method it takes; None: no such path. ``name`` is the
    served model's name in the v2 protocol (the site's)."""
    fixed = {
        "/v1/model": ("v1_model", "GET"),
        "/v1/predict": ("v1_predict", "POST"),
        "/v2/health/live": ("live", "GET"),
        "/v2/health/ready": ("ready", "GET"),
    }
    if path in fixed:
        return fixed[path]
    parts = path.split("/")
    if len(parts) < 4 or parts[:3] != ["", "v2", "models"] or not parts[3]:
        return None
    if len(parts) > 5 and parts[4] == "versions":  # /versions/{id}: the served one
        parts = parts[:4] + parts[6:]
    tail = "/".join(parts[4:])
    kinds = {"": ("metadata", "GET"), "ready": ("model_ready", "GET"), "infer": ("infer", "POST")}
    if tail not in kinds:
        return None
    if parts[3] != name:
        return ("unknown_model", kinds[tail][1])
    return kinds[tail]


async def serve(app: Answers, sock: socket.socket, stopping: asyncio.Event) -> None:
    """Answer ``app``'s requests on the listening ``sock`` until ``stopping`` is set; the
    requests under way then get :data:`STOP_S` to finish."""

    async def handle(request: web.Request) -> web.StreamResponse:
        return await _answer_metered(app, request)

    server = web.Application(client_max_size=app.max_request_bytes)
    server.router.add_route("*", "/{path:.*}", handle)
    runner = web.AppRunner(
        server,
        access_log=None,
        handle_signals=False,
        keepalive_timeout=IDLE_S,
        shutdown_timeout=STOP_S,
    )
    await runner.setup()
    loop = asyncio.get_running_loop()
    connections = runner.server
    assert connections is not None
    opening: set[asyncio.Task] = set()

    def accept_one() -> None:
        """One connection a wakeup: the pool's workers, every one woken by a connection,
        take the waiting ones in turn (a server's own accept loop takes them all, and one
        worker would answer a burst of clients while the others idle)."""
        try:
            conn, _ = sock.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return  # another worker took it
        except OSError as exc:  # out of descriptors: not a busy loop, try again later
            log.warning("serving: accepting a connection failed (%s); again in 1 s", exc)
            loop.remove_reader(sock.fileno())
            loop.call_later(ACCEPT_RETRY_S, listen_again)
            return
        conn.setblocking(False)
        task = loop.create_task(loop.connect_accepted_socket(connections, conn))
        opening.add(task)
        task.add_done_callback(opened)

    def listen_again() -> None:
        if not stopping.is_set():
            loop.add_reader(sock.fileno(), accept_one)

    def opened(task: asyncio.Task) -> None:
        opening.discard(task)
        if not task.cancelled() and task.exception() is not None:  # the client left at once
            log.debug("serving: a connection closed as it opened: %s", task.exception())

    sock.setblocking(False)
    loop.add_reader(sock.fileno(), accept_one)
    try:
        await stopping.wait()
    finally:
        loop.remove_reader(sock.fileno())
        await runner.cleanup()


async def _answer_metered(app: Answers, request: web.Request) -> web.StreamResponse:
    """:func:`_answer`, metered by route and status (:mod:`.serving_meter`)."""
    started = time.perf_counter()
    found = route(request.path, app.model_name())
    status = HTTPStatus.INTERNAL_SERVER_ERROR  # unless an answer goes out
    try:
        response = await _answer(app, request, found)
        status = HTTPStatus(response.status)
        return response
    finally:
        what = found[0] if found is not None else "none"
        serving_meter.answered(what, int(status), time.perf_counter() - started)


async def _answer(
    app: Answers, request: web.Request, found: tuple[str, str] | None
) -> web.StreamResponse:
    """Answer by path (:func:`route`); a known path asked with another method: 405."""
    method, path = request.method, request.path
    if found is None:
        return _reply(HTTPStatus.NOT_FOUND, {"error": f"no route {path}"})
    what, allowed = found
    if method != allowed:
        return _reply(
            HTTPStatus.METHOD_NOT_ALLOWED,
            {"error": f"{path} takes {allowed}, not {method}"},
            allow=allowed,
        )
    try:
        if what == "live":
            return _reply(HTTPStatus.OK, {"live": True})
        if what in ("ready", "model_ready"):
            ready = app.served is not None
            body = (
                {"ready": ready}
                if what == "ready"
                else {"name": path.split("/")[3], "ready": ready}
            )
            return _reply(HTTPStatus.OK if ready else HTTPStatus.SERVICE_UNAVAILABLE, body)
        if what == "unknown_model":
            served = app.model_name()
            return _reply(
                HTTPStatus.NOT_FOUND,
                {"error": f"no model {path.split('/')[3]!r}: this site serves {served!r}"},
            )
        if what == "v1_model":
            return _reply(HTTPStatus.OK, app.served_or_503().describe())
        if what == "metadata":
            return _reply(HTTPStatus.OK, app.v2_metadata())
        refused = _refused_body(app, request)
        if refused is not None:
            return refused
        try:
            body_bytes = await request.read()
        except web.HTTPRequestEntityTooLarge:  # a chunked body past the limit
            return _too_large(app, "the body")
        if what == "v1_predict":
            answer = app.predict(request.headers.get("Content-Type", ""), body_bytes)
        else:
            answer = app.v2_infer(body_bytes, request.headers.get(oip.HEADER_LENGTH))
    except BadRequest as exc:
        return _reply(exc.status, {"error": str(exc)})
    return _reply(HTTPStatus.OK, answer)


def _refused_body(app: Answers, request: web.Request) -> web.Response | None:
    """A 411 for a body of no stated length, a 413 for one stated over the limit (neither
    read: the connection closes); None when the body may be read."""
    length = request.content_length
    if length is None and "chunked" not in request.headers.get("Transfer-Encoding", "").lower():
        response = _reply(HTTPStatus.LENGTH_REQUIRED, {"error": "Content-Length required"})
        response.force_close()
        return response
    if length is not None and length > app.max_request_bytes:
        return _too_large(app, f"{length} bytes")
    return None


def _too_large(app: Answers, what: str) -> web.Response:
    response = _reply(
        HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
        {"error": f"{what}: more than serving.max_request_bytes {app.max_request_bytes}"},
    )
    response.force_close()  # the rest of the body is not read
    return response


def _reply(status: HTTPStatus, body: dict[str, Any], allow: str | None = None) -> web.Response:
    headers = {"Cache-Control": "no-store"}
    if allow is not None:
        headers["Allow"] = allow
    return web.Response(
        status=int(status),
        body=json.dumps(body).encode(),
        content_type="application/json",
        headers=headers,
    )
