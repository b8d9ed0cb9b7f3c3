"""/livez, /readyz and /metrics over real HTTP on loopback; /metrics parses with
prometheus_client's own parser; labels stay bounded."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from p2pfl.sites.observe import MAX_DROP_REASONS, ObservabilityServer, SiteMetrics


async def _get(port: int, raw: bytes) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def test_the_three_endpoints_and_errors():
    metrics = SiteMetrics("s1")
    why: list[str] = []
    async with ObservabilityServer("127.0.0.1", 0, metrics, lambda: why, read_timeout=0.5) as srv:
        get = lambda path: _get(srv.port, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())  # noqa: E731
        assert await get("/livez") == (200, b"ok\n")
        assert await get("/readyz") == (200, b"ready\n")
        why[:] = ["broker 127.0.0.1:1883 not connected", "draining"]
        assert await get("/readyz") == (503, b"broker 127.0.0.1:1883 not connected\ndraining\n")
        assert (await get("/nope"))[0] == 404
        assert (await _get(srv.port, b"POST /livez HTTP/1.1\r\n\r\n"))[0] == 405
        assert (await _get(srv.port, b"GET /livez HTTP/1.1\r\nX: " + b"a" * 9000 + b"\r\n\r\n"))[
            0
        ] == 400
        assert (await _get(srv.port, b"nonsense\r\n\r\n"))[0] == 400
        # a client that says nothing is dropped after the read timeout
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        head = await _get(srv.port, b"HEAD /livez HTTP/1.1\r\n\r\n")
        assert head == (200, b"")


async def test_metrics_parse_with_every_name():
    m = SiteMetrics("s1")
    m.set_runs({"running": 2, "finished": 3})
    m.observe_round(1.5)
    m.add_bytes("direct", 100)
    m.add_bytes("mqtt", 7)
    m.set_peers_online(4)
    m.dropped("forged")
    m.rejected("method_not_allowed")
    m.rejected("made_up")
    m.set_epsilon(2.5)
    async with ObservabilityServer("127.0.0.1", 0, m, lambda: []) as srv:
        code, body = await _get(srv.port, b"GET /metrics HTTP/1.1\r\n\r\n")
    assert code == 200
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(body.decode())
        for s in f.samples
    }
    assert samples[("p2pfl_runs", (("state", "running"),))] == 2
    assert samples[("p2pfl_runs", (("state", "aborted"),))] == 0
    assert samples[("p2pfl_round_duration_seconds_count", ())] == 1
    assert samples[("p2pfl_bytes_sent_total", (("lane", "direct"),))] == 100
    assert samples[("p2pfl_peers_online", ())] == 4
    assert samples[("p2pfl_messages_dropped_total", (("reason", "forged"),))] == 1
    assert samples[("p2pfl_policy_rejections_total", (("reason", "other"),))] == 1
    assert samples[("p2pfl_dp_epsilon_spent", ())] == 2.5
    assert any(name == "p2pfl_build_info" for name, _ in samples)


def test_drop_reasons_are_capped():
    m = SiteMetrics("s1")
    for i in range(MAX_DROP_REASONS + 10):
        m.dropped(f"r{i}")
    text = m.render().decode()
    reasons = {
        s.labels["reason"]
        for f in text_string_to_metric_families(text)
        if f.name == "p2pfl_messages_dropped"
        for s in f.samples
        if s.name.endswith("_total")
    }
    assert len(reasons) == MAX_DROP_REASONS + 1 and "other" in reasons
