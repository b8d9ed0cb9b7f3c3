"""A task that lives exactly as long as an ``async with`` block."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
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
