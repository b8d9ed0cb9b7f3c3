"""/livez, /readyz and /metrics over real HTTP on loopback (raw asyncio streams, and
urllib as a real client); /metrics parses with prometheus_client's own parser; labels
stay bounded."""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

import p2pfl
from p2pfl.sites.daemon.observe import (
    CONTENT_TYPE,
    MAX_DROP_REASONS,
    MAX_HEAD_BYTES,
    RUN_STATES,
    ObservabilityServer,
    SiteMetrics,
    parse_listen,
)
from p2pfl.sites.policy.rules import REASON_CODES


async def _exchange(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``raw``, read to the end: the status code, the headers and the body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    status, *header_lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in header_lines)
    return int(status.split()[1]), headers, body


def _get(port: int, path: str, method: str = "GET") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def _by_reason(metrics: SiteMetrics, name: str) -> dict[str, float]:
    """The samples of counter ``name``, by their ``reason`` label."""
    return {
        dict(labels)["reason"]: value
        for (sample, labels), value in _samples(metrics.render().decode()).items()
        if sample == name
    }


async def test_livez_and_readyz_follow_the_callback():
    why: list[str] = []
    async with ObservabilityServer("127.0.0.1", 0, SiteMetrics("s1"), lambda: why) as srv:
        assert srv.port != 0
        code, headers, body = await _exchange(srv.port, _get(srv.port, "/livez"))
        assert (code, body) == (200, b"ok\n")
        assert headers["Connection"] == "close" and headers["Content-Length"] == "3"
        assert (await _exchange(srv.port, _get(srv.port, "/readyz")))[::2] == (200, b"ready\n")
        why[:] = ["broker 127.0.0.1:1883 not connected", "draining"]
        code, _, body = await _exchange(srv.port, _get(srv.port, "/readyz?verbose"))
        assert (code, body) == (503, b"broker 127.0.0.1:1883 not connected\ndraining\n")
        why.clear()
        assert (await _exchange(srv.port, _get(srv.port, "/readyz")))[0] == 200


async def test_a_real_client_reads_every_route():
    metrics = SiteMetrics("s1")
    metrics.set_peers_online(3)
    why = ["no broker"]

    def fetch(path: str) -> tuple[int, str, bytes]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}{path}", timeout=10) as r:
                return r.status, r.headers["Content-Type"], r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.headers["Content-Type"], exc.read()

    async with ObservabilityServer("127.0.0.1", 0, metrics, lambda: why) as srv:
        assert await asyncio.to_thread(fetch, "/livez") == (
            200,
            "text/plain; charset=utf-8",
            b"ok\n",
        )
        assert (await asyncio.to_thread(fetch, "/readyz"))[::2] == (503, b"no broker\n")
        code, ctype, body = await asyncio.to_thread(fetch, "/metrics")
        assert (code, ctype) == (200, CONTENT_TYPE)
        assert _samples(body.decode())[("p2pfl_peers_online", ())] == 3
        assert (await asyncio.to_thread(fetch, "/nope"))[0] == 404


async def test_head_404_405_and_malformed_requests():
    async with ObservabilityServer("127.0.0.1", 0, SiteMetrics(), lambda: []) as srv:
        port = srv.port
        code, headers, body = await _exchange(port, _get(port, "/livez", "HEAD"))
        assert (code, headers["Content-Length"], body) == (200, "3", b"")
        metrics_head = await _exchange(port, _get(port, "/metrics", "HEAD"))
        assert metrics_head[0] == 200 and int(metrics_head[1]["Content-Length"]) > 0
        assert metrics_head[2] == b""
        assert (await _exchange(port, _get(port, "/nope")))[0] == 404
        code, headers, _ = await _exchange(port, _get(port, "/livez", "POST"))
        assert code == 405 and headers["Allow"] == "GET, HEAD"
        assert (await _exchange(port, _get(port, "/metrics", "DELETE")))[0] == 405
        for raw in (
            b"nonsense\r\n\r\n",
            b"GET /livez\r\n\r\n",
            b"GET /livez HTTP/2.0\r\n\r\n",
            b"GET livez HTTP/1.1\r\n\r\n",
            b"get /livez HTTP/1.1\r\n\r\n",
            b"GET /livez HTTP/1.1\r\nno colon here\r\n\r\n",
            b"GET /\xff HTTP/1.1\r\n\r\n",
            b"GET /livez HTTP/1.1\r\nHost: x\r\n",  # then the client closes its side
        ):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(raw)
            writer.write_eof()
            answer = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n"), (raw, answer)
        # still serving after all of them
        assert (await _exchange(port, _get(port, "/livez")))[0] == 200


async def test_an_oversized_head_gets_431():
    async with ObservabilityServer("127.0.0.1", 0, SiteMetrics(), lambda: []) as srv:
        one_long_line = b"GET /livez HTTP/1.1\r\nX: " + b"a" * (MAX_HEAD_BYTES + 10) + b"\r\n\r\n"
        assert (await _exchange(srv.port, one_long_line))[0] == 431
        many_lines = b"GET /livez HTTP/1.1\r\n" + b"X: aaaaaaaaaa\r\n" * 1000 + b"\r\n"
        assert (await _exchange(srv.port, many_lines))[0] == 431
        assert (await _exchange(srv.port, _get(srv.port, "/livez")))[0] == 200


async def test_a_failing_readiness_check_is_a_500_not_a_crash():
    def broken() -> list[str]:
        raise RuntimeError("bug")

    async with ObservabilityServer("127.0.0.1", 0, SiteMetrics(), broken) as srv:
        assert (await _exchange(srv.port, _get(srv.port, "/readyz")))[0] == 500
        assert (await _exchange(srv.port, _get(srv.port, "/livez")))[0] == 200


async def test_a_silent_client_is_dropped_after_the_read_timeout():
    timeout = 0.3
    async with ObservabilityServer(
        "127.0.0.1", 0, SiteMetrics(), lambda: [], read_timeout=timeout
    ) as srv:
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        started = time.monotonic()
        assert await asyncio.wait_for(reader.read(), 10) == b""
        waited = time.monotonic() - started
        writer.close()
        assert timeout * 0.8 <= waited < 5
        # a client that stops in the middle of its headers is dropped too
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        writer.write(b"GET /livez HTTP/1.1\r\nHost: x\r\n")
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()


async def test_aclose_ends_open_connections_at_once():
    srv = ObservabilityServer("127.0.0.1", 0, SiteMetrics(), lambda: [], read_timeout=60)
    await srv.start()
    with pytest.raises(RuntimeError):
        await srv.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
    writer.write(b"GET /livez HTTP/1.1\r\n")  # and never the end of its headers
    await writer.drain()
    await asyncio.wait_for(srv.aclose(), 5)  # not the 60 s read timeout
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    await srv.aclose()  # idempotent
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", srv.port)


async def test_metrics_parse_with_every_name_and_value():
    m = SiteMetrics("s1")
    m.set_runs({"running": 2, "finished": 3, "made_up": 9})
    m.observe_round(1.5)
    m.observe_round(0.05)
    m.add_bytes("direct", 100)
    m.add_bytes("mqtt", 7)
    m.add_bytes("mqtt", -5)  # ignored: a counter never goes down
    m.set_peers_online(4)
    m.dropped("forged")
    m.dropped("forged", 2)
    m.rejected("method_not_allowed")
    m.rejected("made_up")
    m.set_epsilon(2.5)
    async with ObservabilityServer("127.0.0.1", 0, m, lambda: []) as srv:
        code, headers, body = await _exchange(srv.port, _get(srv.port, "/metrics"))
    assert code == 200 and headers["Content-Type"] == CONTENT_TYPE
    samples = _samples(body.decode())
    assert samples[("p2pfl_build_info", (("site", "s1"), ("version", p2pfl.__version__)))] == 1
    assert samples[("p2pfl_runs", (("state", "running"),))] == 2
    assert samples[("p2pfl_runs", (("state", "finished"),))] == 3
    for state in set(RUN_STATES) - {"running", "finished"}:
        assert samples[("p2pfl_runs", (("state", state),))] == 0
    assert not any(name == "p2pfl_runs" and ("state", "made_up") in lb for name, lb in samples)
    assert samples[("p2pfl_round_duration_seconds_count", ())] == 2
    assert samples[("p2pfl_round_duration_seconds_sum", ())] == pytest.approx(1.55)
    assert samples[("p2pfl_round_duration_seconds_bucket", (("le", "0.1"),))] == 1
    assert samples[("p2pfl_bytes_sent_total", (("lane", "direct"),))] == 100
    assert samples[("p2pfl_bytes_sent_total", (("lane", "mqtt"),))] == 7
    assert samples[("p2pfl_peers_online", ())] == 4
    assert samples[("p2pfl_messages_dropped_total", (("reason", "forged"),))] == 3
    assert samples[("p2pfl_policy_rejections_total", (("reason", "method_not_allowed"),))] == 1
    assert samples[("p2pfl_policy_rejections_total", (("reason", "other"),))] == 1
    assert samples[("p2pfl_policy_rejections_total", (("reason", "draining"),))] == 0
    assert samples[("p2pfl_dp_epsilon_spent", ())] == 2.5


def test_runs_reset_to_zero_when_left_out():
    m = SiteMetrics()
    m.set_runs({"running": 2})
    m.set_runs({"finished": 1})
    samples = _samples(m.render().decode())
    assert samples[("p2pfl_runs", (("state", "running"),))] == 0
    assert samples[("p2pfl_runs", (("state", "finished"),))] == 1


def test_each_daemon_has_its_own_registry():
    a, b = SiteMetrics("a"), SiteMetrics("b")
    a.set_peers_online(5)
    assert _samples(b.render().decode())[("p2pfl_peers_online", ())] == 0


def test_drop_reasons_are_capped():
    m = SiteMetrics()
    for i in range(MAX_DROP_REASONS + 10):
        m.dropped(f"r{i}")
    m.dropped("r0")  # one of the first kept apart: still its own
    reasons = _by_reason(m, "p2pfl_messages_dropped_total")
    assert len(reasons) == MAX_DROP_REASONS + 1
    assert reasons["other"] == 10 and reasons["r0"] == 2
    assert f"r{MAX_DROP_REASONS}" not in reasons


def test_rejection_reasons_are_the_policy_codes_or_other():
    m = SiteMetrics()
    for code in REASON_CODES:
        m.rejected(code)
    for i in range(100):
        m.rejected(f"peer-said-{i}")
    reasons = _by_reason(m, "p2pfl_policy_rejections_total")
    assert set(reasons) == {*REASON_CODES, "other"}
    assert reasons["other"] == 100 and all(reasons[c] == 1 for c in REASON_CODES)


def test_a_lane_is_mqtt_or_direct():
    with pytest.raises(ValueError):
        SiteMetrics().add_bytes("carrier-pigeon", 1)


def test_parse_listen():
    assert parse_listen("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_listen("[::1]:9464") == ("::1", 9464)
    assert parse_listen("localhost:0") == ("localhost", 0)
    for bad in ("9464", ":9464", "host:", "host:port", "host:65536", "host:-1", "host:²"):
        with pytest.raises(ValueError):
            parse_listen(bad)


def test_run_metrics_keep_the_newest_runs_and_the_served_model_follows_the_store():
    from p2pfl.sites.daemon.observe import MAX_METRIC_RUNS, ServedModel

    served: list[ServedModel | None] = [None]
    m = SiteMetrics("s1", served=lambda: served[0])
    for i in range(MAX_METRIC_RUNS + 2):
        m.set_run_metrics(f"run{i}", {"test_acc": i / 10, "test_loss": 1.0})
    m.set_run_metrics(f"run{MAX_METRIC_RUNS + 1}", {"test_acc": 0.99})  # loss left out
    m.judged("promoted")
    m.judged("made_up")
    samples = _samples(m.render().decode())
    runs = {dict(lb)["run_id"] for name, lb in samples if name == "p2pfl_run_metric"}
    assert runs == {f"run{i}" for i in range(2, MAX_METRIC_RUNS + 2)}
    last = f"run{MAX_METRIC_RUNS + 1}"
    assert samples[("p2pfl_run_metric", (("metric", "test_acc"), ("run_id", last)))] == 0.99
    assert ("p2pfl_run_metric", (("metric", "test_loss"), ("run_id", last))) not in samples
    assert samples[("p2pfl_gate_decisions_total", (("decision", "promoted"),))] == 1
    assert samples[("p2pfl_gate_decisions_total", (("decision", "failed"),))] == 1
    assert samples[("p2pfl_gate_decisions_total", (("decision", "refused"),))] == 0
    assert not any(name == "p2pfl_served_model_info" for name, _ in samples)
    served[0] = ServedModel("m1", "run1", "accuracy", 0.91)
    samples = _samples(m.render().decode())
    assert samples[("p2pfl_served_model_info", (("model", "m1"), ("run_id", "run1")))] == 1
    assert samples[("p2pfl_served_model_metric", (("metric", "accuracy"),))] == 0.91
    served[0] = ServedModel("m2", "run2", "mae", None)  # a rollback to an unjudged model
    samples = _samples(m.render().decode())
    assert [lb for name, lb in samples if name == "p2pfl_served_model_info"] == [
        (("model", "m2"), ("run_id", "run2"))
    ]
    assert not any(name == "p2pfl_served_model_metric" for name, _ in samples)
    served[0] = ServedModel("m3", "run3", "accuracy", 0.5)  # after an unjudged one
    samples = _samples(m.render().decode())
    assert samples[("p2pfl_served_model_metric", (("metric", "accuracy"),))] == 0.5


def test_the_serving_processes_answers_reach_the_daemons_metrics(tmp_path):
    """``p2pfl serve``'s processes count into the folder the daemon names (prometheus'
    multiprocess mode); the daemon's registry sums them at each scrape."""
    import subprocess
    import sys

    folder = tmp_path / "serving-metrics"
    folder.mkdir()
    m = SiteMetrics("s1", serving_dir=folder)
    code = (
        "from p2pfl.sites.models import serving_meter as s\n"
        "s.answered('v1_predict', 200, 0.0012)\n"
        "s.answered('v1_predict', 400, 0.3)\n"
        "s.answered('/etc/passwd', 404, 0.001)\n"
    )
    for _ in range(2):  # two processes, as two workers
        done = subprocess.run(
            [sys.executable, "-c", code],
            env={"PROMETHEUS_MULTIPROC_DIR": str(folder), "PATH": ""},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
    samples = _samples(m.render().decode())
    ok = ("p2pfl_serving_requests_total", (("code", "200"), ("route", "v1_predict")))
    assert samples[ok] == 2
    assert samples[("p2pfl_serving_requests_total", (("code", "404"), ("route", "none")))] == 2
    count = ("p2pfl_serving_request_seconds_count", (("route", "v1_predict"),))
    assert samples[count] == 4
    bucket = ("p2pfl_serving_request_seconds_bucket", (("le", "0.002"), ("route", "v1_predict")))
    assert samples[bucket] == 2
