"""p2pfl.background: a task cancelled and waited for, a cancellation an await absorbed
still obeyed, and a task bound to an ``async with`` block."""

from __future__ import annotations

import asyncio

import pytest

from p2pfl.background import background, cancel_and_wait, stop_if_cancelled


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


async def _slow_to_stop(stopping: asyncio.Event, release: asyncio.Event) -> None:
    """Once cancelled, finishes only when ``release`` is set (a pull's clean-up)."""
    try:
        await asyncio.Event().wait()
    finally:
        stopping.set()
        await release.wait()


async def test_a_caller_cancelled_while_it_waits_for_the_task_still_stops():
    """The caller is cancelled while it waits for the task it cancelled (a drained worker's
    SIGTERM landing in a pull's clean-up): it still waits for the task's end, then stops,
    instead of going on as ``with suppress(CancelledError): await task`` let it."""
    stopping, release = asyncio.Event(), asyncio.Event()
    went_on = []

    async def caller() -> None:
        child = asyncio.ensure_future(_slow_to_stop(stopping, release))
        await asyncio.sleep(0)
        await cancel_and_wait(child)
        went_on.append(child.cancelled())

    task = asyncio.ensure_future(caller())
    await asyncio.wait_for(stopping.wait(), 5)
    task.cancel()  # what SIGTERM does to a node's task
    await asyncio.sleep(0)
    assert not task.done()  # it waits for the child's end...
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task  # ...then stops
    assert went_on == []


async def test_cancel_and_wait_absorbs_the_tasks_cancellation_and_raises_its_failure():
    async def forever() -> None:
        await asyncio.Event().wait()

    task = asyncio.ensure_future(forever())
    await asyncio.sleep(0)
    await cancel_and_wait(task)
    assert task.cancelled()

    async def failing_on_cancel() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise ValueError("its clean-up failed") from None

    task = asyncio.ensure_future(failing_on_cancel())
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="its clean-up failed"):
        await cancel_and_wait(task)


@pytest.mark.skipif(not hasattr(asyncio.Task, "cancelling"), reason="Python 3.11's Task.cancelling")
async def test_a_cancellation_an_await_absorbed_still_stops_the_loop():
    """A loop whose await swallowed its cancellation (as 3.11's ``wait_for`` does when the
    result arrives with the cancel) stops at its next :func:`stop_if_cancelled`; a task
    never asked to stop goes on."""
    steps: list[int] = []
    blocked = asyncio.Event()

    async def rounds() -> None:
        for step in range(100):
            try:
                blocked.set()
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                pass  # what a swallowing await leaves: the task goes on
            steps.append(step)
            stop_if_cancelled()

    task = asyncio.ensure_future(rounds())
    await asyncio.wait_for(blocked.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(steps) == 1

    steps.clear()
    await rounds()  # not asked to stop: every step
    assert len(steps) == 100
