"""The loop handler that quiets the MQTT client's closed-socket race, and the filter that
quiets its late acknowledgements: those, and only those."""

from __future__ import annotations

import asyncio
import logging
import socket

from p2pfl.wire.loop import quiet_closed_socket_races


async def _schedule_then_settle(callback, *args) -> None:
    loop = asyncio.get_running_loop()
    loop.call_soon(callback, *args)
    for _ in range(3):
        await asyncio.sleep(0)


def test_add_writer_on_a_closed_socket_is_one_debug_line(caplog) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        quiet_closed_socket_races(loop)
        sock = socket.socket()
        fd = sock.fileno()
        sock.close()  # the broker closed it between the schedule and the run
        await _schedule_then_settle(loop.add_writer, fd, lambda: None)

    with caplog.at_level(logging.DEBUG):
        asyncio.run(main())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("socket closed before its watcher" in r.getMessage() for r in caplog.records)


def test_any_other_callback_error_still_reaches_the_default_handler(caplog) -> None:
    def boom() -> None:
        raise OSError(9, "Bad file descriptor")  # same errno, but not a socket watcher

    async def main() -> None:
        quiet_closed_socket_races(asyncio.get_running_loop())
        await _schedule_then_settle(boom)

    with caplog.at_level(logging.DEBUG):
        asyncio.run(main())
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors and "Exception in callback" in errors[0].getMessage()


def test_a_previous_handler_keeps_the_rest() -> None:
    seen: list[dict] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda lp, ctx: seen.append(ctx))
        quiet_closed_socket_races(loop)
        await _schedule_then_settle(lambda: 1 / 0)

    asyncio.run(main())
    assert len(seen) == 1 and isinstance(seen[0]["exception"], ZeroDivisionError)


def test_a_late_unsuback_is_one_debug_line_and_other_errors_pass(caplog) -> None:
    """aiomqtt, given the lane's logger, meets an UNSUBACK for a call that stopped waiting
    (its packet id forgotten): no error, no traceback; its own other errors still show."""
    import aiomqtt

    from p2pfl.wire.loop import CLIENT_LOG

    async def main() -> None:
        client = aiomqtt.Client("127.0.0.1", 1, logger=CLIENT_LOG)
        client._on_unsubscribe(client._client, None, 4242, [], None)  # paho's callback
        CLIENT_LOG.error("There are %d pending publish calls.", 99)

    with caplog.at_level(logging.DEBUG):
        asyncio.run(main())
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in errors] == ["There are 99 pending publish calls."]
    assert any("after its call stopped waiting" in r.getMessage() for r in caplog.records)
