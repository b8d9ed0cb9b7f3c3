"""Task lifetimes: a task that lives exactly as long as an ``async with`` block
(:func:`background`), and fire-and-forget tasks held by their owner until it closes
(:class:`TaskSet`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any


@contextlib.asynccontextmanager
async def background(coro: Coroutine[Any, Any, Any]) -> AsyncIterator[asyncio.Task[Any]]:
    """Run ``coro`` as a task while inside the block. On leaving (normally or not) the task
    is cancelled and awaited, so nothing it does outlives the block: its cancellation is
    absorbed, and an exception it had already failed with is raised."""
    task = asyncio.create_task(coro)
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


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
