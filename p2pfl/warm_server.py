"""The warm worker's fork server (``python -m p2pfl.warm_server SOCKET``), which a site
daemon starts (:class:`~p2pfl.sites.runs.warm_worker.WarmWorkers`, the protocol): it
imports torch and the node's code once, then forks ``p2pfl ARGV`` for each request, so a
committed run's worker starts without importing them again. Single-threaded
(``selectors``, and SIGCHLD through a wakeup pipe), so no lock is held across a fork. It
stands beside ``__main__``: what it forks is the ``p2pfl`` command itself."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from p2pfl.cpu_set import parse_cpus, pin
from p2pfl.sites.runs.warm_worker import HANDLED, MAX_REQUEST_BYTES, READY


def _preload() -> None:
    """What ``p2pfl node`` imports before it trains: torch, the node's modules and what the
    first optimizer imports (:func:`~p2pfl.learning.train.load_optimizer_machinery`)."""
    import torch  # noqa: F401

    import p2pfl.check.checked  # noqa: F401
    import p2pfl.cli  # noqa: F401
    import p2pfl.node.daemon  # noqa: F401
    from p2pfl.learning.train import load_optimizer_machinery

    load_optimizer_machinery()


def _run_child(
    request: dict[str, Any],
    listener: socket.socket,
    wake_r: int,
    preexec: Callable[[], None] | None,
) -> None:
    """In the forked child: become ``p2pfl ARGV`` in ``cwd``, output to ``log``; never
    returns. ``preexec`` is the server's :func:`~p2pfl.lifeline.die_with_parent`."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in HANDLED:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDLED)
        listener.close()
        os.close(wake_r)
        if preexec is not None:
            preexec()
        os.nice(request.get("nice", 0))
        pin(request.get("cpus"))
        out = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.close(null)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.chdir(request["cwd"])
        from p2pfl.cli import main

        code = main(list(request["argv"]))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - the child reports, then ends
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _read_request(conn: socket.socket) -> dict[str, Any] | None:
    """One JSON line of at most :data:`MAX_REQUEST_BYTES`: ``argv`` (strings), ``cwd``,
    ``log``, ``nice`` (0 to 19; absent: 0), ``cpus`` (a list of CPU numbers; absent or
    null: the server's); None for anything else."""
    data = b""
    while not data.endswith(b"\n") and len(data) < MAX_REQUEST_BYTES:
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    try:
        request = json.loads(data)
    except ValueError:
        return None
    argv = request.get("argv") if isinstance(request, dict) else None
    if (
        not isinstance(argv, list)
        or not all(isinstance(a, str) for a in argv)
        or not isinstance(request.get("cwd"), str)
        or not isinstance(request.get("log"), str)
        or type(request.get("nice", 0)) is not int
        or not 0 <= request.get("nice", 0) <= 19
    ):
        return None
    if request.get("cpus") is not None:
        try:
            request["cpus"] = parse_cpus(request["cpus"])
        except ValueError:
            return None
    return request


def serve(path: Path) -> None:
    """Listen on ``path``, fork a worker per request, report each one's exit; until
    SIGTERM (its workers get SIGTERM then: their parent died)."""
    import selectors

    from p2pfl.lifeline import die_with_parent, ended_children

    _preload()
    preexec = die_with_parent()  # taken here: it names this process as the parent
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_mask = os.umask(0o177)
    try:
        listener.bind(str(path))
    finally:
        os.umask(old_mask)
    listener.listen(16)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # delivered through the wakeup pipe
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    children: dict[int, socket.socket] = {}
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    print(READY, flush=True)
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                conn.settimeout(10)
                request = _read_request(conn)
                if request is None:
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                # a signal sent to the worker before it has reset the server's handlers
                # waits until it has (the child unblocks them), so it acts as on any process
                signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED)
                pid = os.fork()
                if pid == 0:
                    _run_child(request, listener, wake_r, preexec)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDLED)
                children[pid] = conn
                with contextlib.suppress(OSError):
                    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            else:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 512)
        for pid, status in ended_children():
            conn = children.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())
                conn.close()


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
