"""Task lifetimes: a task cancelled and waited for without losing the caller's own
cancellation (:func:`cancel_and_wait`), a cancellation an await absorbed still obeyed
(:func:`stop_if_cancelled`), a task that lives exactly as long as an ``async with`` block
(:func:`background`), and fire-and-forget tasks held by their owner until it closes
(:class:`TaskSet`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any


async def cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and wait until it has ended: its cancellation is absorbed, and an
    exception it had already failed with is raised.

    A cancellation of the caller while it waits is not absorbed: the caller still waits for
    ``task``'s end, then raises :class:`asyncio.CancelledError`. The usual ``task.cancel();
    with suppress(CancelledError): await task`` loses it: a cancel sent to the caller then
    goes to ``task`` (what it awaits), which ends cancelled, and the suppress takes that
    for ``task``'s own; the caller goes on as if never told to stop (a drained site's
    worker trained to its last round so)."""
    task.cancel()
    told_to_stop = False
    while not task.done():
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            told_to_stop = True
    if told_to_stop:
        raise asyncio.CancelledError
    failure = None if task.cancelled() else task.exception()
    if failure is not None:
        raise failure


def stop_if_cancelled() -> None:
    """Raise :class:`asyncio.CancelledError` when the current task was asked to stop
    (``Task.cancel``) and goes on: a cancellation that some await absorbed. Python 3.11's
    ``asyncio.wait_for`` does so when the awaited result arrives in the same pass of the
    loop as the cancel: it returns the result and drops the cancellation (CPython
    gh-86296; 3.12 rewrote it). A loop that calls this at each step stops at the next one
    however its awaits treated the cancel. Python 3.10 has no ``Task.cancelling``: nothing
    is checked there."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    if cancelling is not None and cancelling() > 0:
        raise asyncio.CancelledError


@contextlib.asynccontextmanager
async def background(coro: Coroutine[Any, Any, Any]) -> AsyncIterator[asyncio.Task[Any]]:
    """Run ``coro`` as a task while inside the block. On leaving (normally or not) the task
    is cancelled and awaited, so nothing it does outlives the block: its cancellation is
    absorbed, and an exception it had already failed with is raised."""
    task = asyncio.create_task(coro)
    try:
        yield task
    finally:
        await cancel_and_wait(task)


class TaskSet:
    """Fire-and-forget tasks one object owns (best-effort publishes): each is held until it
    ends, so none is collected while it runs; a failure is handed to ``on_error`` (never
    raised: the owner does not wait on them); :meth:`aclose` cancels and awaits those still
    running, so none outlives its owner."""

    def __init__(self, on_error: Callable[[BaseException], None] | None = None):
        self._tasks: set[asyncio.Task[Any]] = set()
        self._on_error = on_error

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as a task held by this set."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and self._on_error is not None:
            self._on_error(exc)

    def __len__(self) -> int:
        return len(self._tasks)

    async def aclose(self) -> None:
        """Cancel every task still running and wait until each has ended."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
