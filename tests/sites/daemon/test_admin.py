"""The admin socket: the operator's only way to command a daemon, mode 0600, one JSON request
and one JSON answer a connection, errors as words and never a crash."""

from __future__ import annotations

import asyncio
import os
import stat

import pytest

from p2pfl.sites.daemon.admin_socket import AdminError, AdminServer, request, socket_path


async def _handler(req):
    if req["cmd"] == "runs":
        return {"runs": [1, 2]}
    if req["cmd"] == "cancel":
        raise ValueError("no run 'x'")
    raise RuntimeError("boom")


async def test_requests_are_answered_and_errors_are_words(tmp_path):
    async with AdminServer(tmp_path, _handler):
        assert stat.S_IMODE(os.stat(socket_path(tmp_path)).st_mode) == 0o600
        assert (await request(tmp_path, "runs"))["runs"] == [1, 2]
        with pytest.raises(AdminError, match="no run 'x'"):
            await request(tmp_path, "cancel", run_id="x")
        with pytest.raises(AdminError, match="RuntimeError: boom"):
            await request(tmp_path, "drain")
        with pytest.raises(AdminError, match="a request is"):
            await request(tmp_path, "format_disk")
        # a client that sends garbage gets an error, and the server goes on
        reader, writer = await asyncio.open_unix_connection(str(socket_path(tmp_path)))
        writer.write(b"not json\n")
        await writer.drain()
        assert b'"ok": false' in await reader.readline()
        writer.close()
        assert (await request(tmp_path, "runs"))["ok"] is True
    assert not socket_path(tmp_path).exists()


async def test_no_daemon_is_a_clear_error(tmp_path):
    with pytest.raises(AdminError, match="is `p2pfl daemon --site"):
        await request(tmp_path, "runs", timeout=2)
