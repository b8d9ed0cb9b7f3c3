"""One question asked of a short-lived child process, so the asking process imports nothing
of what the child loads (outside code, torch, pandas, a whole table).

The parent runs ``python -m MODULE ARGS...`` and reads the child's answer: the last line of
its stdout, a JSON object, at most :data:`MAX_ANSWER` bytes. The child (:func:`answer_main`)
prints whatever its work prints to stderr, so that only the answer is on stdout, and an
exception it raises is an answer too (``{"problem": ...}``), never a traceback in the
parent. A child past its ``timeout`` is killed; it dies with the parent too
(:func:`p2pfl.lifeline.die_with_parent`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2pfl.lifeline import die_with_parent

MAX_ANSWER = 64 * 1024
"""The most bytes of a child's stdout read (its answer is the last line)."""

STDERR_TAIL = 4 * 1024
"""The bytes kept of the end of a child's stderr (its last line says why it failed)."""


@dataclass(frozen=True)
class ChildAnswer:
    """The child's ``answer`` (the JSON object on its last stdout line), or the ``problem``
    of there being none, in words that follow "checking …" (``took longer than 120 s``,
    ``gave no answer (exit 1: ModuleNotFoundError: …)``)."""

    answer: dict[str, Any] | None = None
    problem: str | None = None


async def _read_capped(stream: asyncio.StreamReader, cap: int, *, tail: bool = False) -> bytes:
    """The stream to its end, keeping at most ``cap`` bytes: the first ones, or the last
    ones with ``tail`` (the rest is read and dropped, so the child never blocks on a pipe)."""
    kept = b""
    while chunk := await stream.read(64 * 1024):
        if tail:
            kept = (kept + chunk)[-cap:]
        elif len(kept) < cap:
            kept += chunk[: cap - len(kept)]
    return kept


async def ask_child(
    module: str, args: Sequence[str], *, timeout: float, cwd: Path | None = None
) -> ChildAnswer:
    """Run ``python -m module *args`` (in ``cwd``: where it imports a module from) and return
    its answer; a child that runs past ``timeout`` seconds is killed."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        module,
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=str(cwd) if cwd is not None else None,
        preexec_fn=die_with_parent(),
    )
    assert proc.stdout is not None and proc.stderr is not None
    try:
        out, err = await asyncio.wait_for(
            asyncio.gather(
                _read_capped(proc.stdout, MAX_ANSWER),
                _read_capped(proc.stderr, STDERR_TAIL, tail=True),
            ),
            timeout,
        )
        await asyncio.wait_for(proc.wait(), timeout)
    except asyncio.TimeoutError:
        return ChildAnswer(problem=f"took longer than {timeout:g} s")
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    lines = out.decode(errors="replace").strip().splitlines()
    try:
        answer = json.loads(lines[-1])
    except (ValueError, IndexError):
        answer = None
    if isinstance(answer, dict):
        return ChildAnswer(answer=answer)
    last = err.decode(errors="replace").strip().splitlines()[-1:]
    why = f": {last[0][:300]}" if last else ""
    return ChildAnswer(problem=f"gave no answer (exit {proc.returncode}{why})")


def answer_main(work: Callable[[list[str]], dict[str, Any]], argv: list[str]) -> int:
    """In the child: ``work(argv)``'s answer as one JSON line on stdout, whatever ``work``
    prints going to stderr; an exception it raises is the answer ``{"problem": ...}``."""
    try:
        with contextlib.redirect_stdout(sys.stderr):
            answer = work(argv)
    except Exception as exc:  # what the child loads may raise anything: that is the answer
        answer = {"problem": f"{type(exc).__name__}: {exc}"}
    sys.stdout.write("\n" + json.dumps(answer) + "\n")
    sys.stdout.flush()
    return 0
