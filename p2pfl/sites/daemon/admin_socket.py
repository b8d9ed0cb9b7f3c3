"""The site daemon's admin socket: a unix socket in ``state_dir`` (mode 0600), the only way
to command a daemon (``p2pfl submit``, ``vote``, ``runs``, ``logs``, ``cancel``, ``drain``).
There is no remote admin port: reaching the socket means being the site's operator on its
machine.

One request a connection: a JSON object on one line (``{"cmd": ..., ...}``), answered by
one JSON object on one line: ``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from p2pfl.errors import P2PFLError

log = logging.getLogger(__name__)

SOCKET_NAME = "admin.sock"
MAX_REQUEST_BYTES = 1 << 20  # a run spec is a few KiB
MAX_ANSWER_BYTES = 16 << 20  # a run's log tail
COMMANDS = ("runs", "submit", "retry", "vote", "cancel", "drain", "logs", "status")

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class AdminError(P2PFLError):
    """The daemon could not be reached, or refused the request (its words)."""


class DaemonDown(AdminError):
    """No daemon answers on the admin socket (it is not running, or not yet)."""


def socket_path(state_dir: str | Path) -> Path:
    return Path(state_dir) / SOCKET_NAME


class AdminServer:
    """Serve ``handler`` on the socket in ``state_dir``: it gets each request's mapping and
    answers a mapping (``ok`` is added); an exception is answered as ``{"ok": false}`` with
    its words, and never reaches the daemon's loop."""

    def __init__(self, state_dir: str | Path, handler: Handler):
        self.path = socket_path(state_dir)
        self._handler = handler
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a stale socket of a daemon that died
        old = os.umask(0o177)  # the socket is born 0600: no window where others may connect
        try:
            self._server = await asyncio.start_unix_server(
                self._serve, path=str(self.path), limit=MAX_REQUEST_BYTES
            )
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def __aenter__(self) -> AdminServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 10.0)
            try:
                request = json.loads(line)
                if not isinstance(request, dict) or request.get("cmd") not in COMMANDS:
                    raise ValueError(f"a request is {{'cmd': one of {', '.join(COMMANDS)}}}")
                answer = {"ok": True, **await self._handler(request)}
            except (ValueError, P2PFLError) as exc:
                answer = {"ok": False, "error": str(exc)}
            except Exception as exc:  # noqa: BLE001 - an admin request never stops the daemon
                log.exception("admin request failed")
                answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            writer.write(json.dumps(answer).encode() + b"\n")
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.LimitOverrunError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def request(state_dir: str | Path, cmd: str, timeout: float = 30.0, **fields: Any) -> dict:
    """Send one request to the daemon of ``state_dir``; its answer (``ok`` true), or an
    :class:`AdminError` with the daemon's words or why it could not be reached."""
    path = socket_path(state_dir)
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_unix_connection(str(path), limit=MAX_ANSWER_BYTES), timeout
        )
    except (OSError, asyncio.TimeoutError) as exc:
        raise DaemonDown(
            f"no site daemon answers at {path} ({exc.__class__.__name__}: {exc}); "
            "is `p2pfl daemon --site ...` running?"
        ) from None
    try:
        writer.write(json.dumps({"cmd": cmd, **fields}).encode() + b"\n")
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout)
    except (OSError, asyncio.TimeoutError) as exc:
        raise AdminError(f"the site daemon at {path} did not answer: {exc}") from None
    finally:
        writer.close()
    try:
        answer = json.loads(line)
    except ValueError:
        raise AdminError(f"the site daemon at {path} answered no JSON") from None
    if not isinstance(answer, dict) or not answer.get("ok"):
        raise AdminError(str(answer.get("error") if isinstance(answer, dict) else answer))
    return answer


def call(state_dir: str | Path, cmd: str, timeout: float = 30.0, **fields: Any) -> dict:
    """:func:`request` from synchronous code (the CLI)."""
    return asyncio.run(request(state_dir, cmd, timeout, **fields))
