"""p2pfl.background: a task bound to an ``async with`` block."""

from __future__ import annotations

import asyncio

import pytest

from p2pfl.background import background


async def test_the_task_runs_inside_and_is_gone_after():
    ticks: list[int] = []
    started = asyncio.Event()

    async def tick() -> None:
        while True:
            ticks.append(len(ticks))
            started.set()
            await asyncio.sleep(0)

    async with background(tick()) as task:
        await asyncio.wait_for(started.wait(), 5)
        assert not task.done()
    assert task.cancelled()
    seen = len(ticks)
    await asyncio.sleep(0.01)
    assert len(ticks) == seen  # nothing ran after the block


async def test_the_task_is_cancelled_when_the_block_raises():
    async def forever() -> None:
        await asyncio.Event().wait()

    with pytest.raises(KeyError):
        async with background(forever()) as task:
            await asyncio.sleep(0)
            raise KeyError("the block's own error")
    assert task.cancelled()


async def test_a_failure_of_the_task_reaches_the_caller():
    async def fail() -> None:
        raise ValueError("the task's error")

    with pytest.raises(ValueError, match="the task's error"):
        async with background(fail()) as task:
            await asyncio.wait({task})
