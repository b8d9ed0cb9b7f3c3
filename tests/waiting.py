"""Waiting on a condition in async tests: poll it, never sleep a fixed time."""

from __future__ import annotations

import asyncio
import time


async def wait_until(predicate, timeout: float, what: str = "a condition") -> None:
    """Poll ``predicate`` every 20 ms; ``AssertionError`` naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)
