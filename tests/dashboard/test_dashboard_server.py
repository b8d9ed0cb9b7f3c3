"""The dashboard's HTTP server (p2pfl/dashboard/server.py): its routes, what it refuses,
the page's files shipped in the package, the thread the launcher runs it in, and the
command line."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest

from p2pfl.check.load import load_topology
from p2pfl.cli import build_parser
from p2pfl.config.schema import dump_topology
from p2pfl.dashboard.server import Dashboard, DashboardError, DashboardThread, static_files


async def _get(port: int, path: str, *, method: str = "GET", host: str = "127.0.0.1"):
    """(status, headers, body) of one raw HTTP/1.1 request."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


@pytest.fixture
def run_dir(tmp_path):
    cfg = load_topology("topologies/synthetic.yaml", ["broker=127.0.0.1:1"])
    run = tmp_path / "run"
    (run / "nodes").mkdir(parents=True)
    (run / "config.yaml").write_text(dump_topology(cfg))
    rec = {"round": 1, "test_acc": 0.5, "bytes_sent": 10, "round_s": 1.0, "chosen": ["b"]}
    (run / "nodes" / "a.jsonl").write_text(json.dumps(rec) + "\n")
    return run


def test_the_page_and_its_files_ship_in_the_package():
    files = static_files()
    assert {"index.html", "dashboard.js", "dashboard.css"} <= set(files)
    page = files["index.html"][0].decode()
    assert "/static/dashboard.js" in page and "/static/dashboard.css" in page
    for body, _ in files.values():  # offline: nothing is loaded from elsewhere
        assert b"http://" not in body.replace(b"http://www.w3.org/2000/svg", b"")
        assert b"https://" not in body


async def test_routes_and_refusals(run_dir):
    dash = Dashboard(run_dir, port=0, broker=None, poll_s=0.05)
    url = await dash.start()
    try:
        assert url == f"http://127.0.0.1:{dash.port}/"
        status, headers, body = await _get(dash.port, "/")
        assert status == 200 and headers["Content-Type"].startswith("text/html")
        assert "default-src 'self'" in headers["Content-Security-Policy"]
        assert b'id="graph"' in body
        status, headers, body = await _get(dash.port, "/static/dashboard.js")
        assert status == 200 and headers["Content-Type"].startswith("text/javascript")
        status, headers, body = await _get(dash.port, "/api/state?t=1")
        assert status == 200 and headers["Content-Type"] == "application/json"
        state = json.loads(body)
        assert state["swarm"] == "synthetic" and [n["id"] for n in state["nodes"]] == list("abcd")
        assert state["broker"]["address"] is None and "records only" in state["broker"]["note"]
        assert state["series"]["acc"]["nodes"]["a"] == [[1, 0.5]]
        status, headers, body = await _get(dash.port, "/api/state", method="HEAD")
        assert status == 200 and body == b"" and int(headers["Content-Length"]) > 0
        # a new record shows up at the next poll
        with open(run_dir / "nodes" / "b.jsonl", "w") as f:
            f.write(json.dumps({"round": 1, "test_acc": 0.75}) + "\n")
        for _ in range(100):
            state = json.loads((await _get(dash.port, "/api/state"))[2])
            if state["series"]["acc"]["mean"] == [[1, 0.625]]:
                break
            await asyncio.sleep(0.05)
        assert state["series"]["acc"]["mean"] == [[1, 0.625]]
        for path in ("/static/../server.py", "/static/", "/nope", "/static/runstate.py"):
            assert (await _get(dash.port, path))[0] == 404, path
        assert (await _get(dash.port, "/", method="POST"))[0] == 405
        assert (await _get(dash.port, "/api/state", host="evil.example"))[0] == 421
        assert (await _get(dash.port, "/", host="localhost"))[0] == 200
        # a request that never ends its head is cut off, and the server goes on
        reader, writer = await asyncio.open_connection("127.0.0.1", dash.port)
        writer.write(b"GET / HTTP/1.1\r\n" + b"X: " + b"y" * (20 << 10))
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()
        assert (await _get(dash.port, "/"))[0] == 200
    finally:
        await dash.close()


async def test_a_taken_port_is_an_error_with_a_message(run_dir):
    first = Dashboard(run_dir, port=0, broker=None)
    await first.start()
    try:
        with pytest.raises(DashboardError, match="cannot listen"):
            await Dashboard(run_dir, port=first.port, broker=None).start()
    finally:
        await first.close()


def test_the_launchers_thread_serves_until_stopped(run_dir):
    dash = DashboardThread(run_dir, port=0, broker=None)
    url = dash.start()
    try:
        with urllib.request.urlopen(url + "api/state", timeout=10) as resp:
            assert json.loads(resp.read())["rounds"] == 3
    finally:
        dash.stop()
    assert not dash._thread.is_alive()
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=2)


def test_command_line_flags():
    p = build_parser()
    args = p.parse_args(["swarm", "t.yaml", "--dashboard", "--dashboard-port", "8080"])
    assert args.dashboard and args.dashboard_port == 8080 and args.dashboard_host == "127.0.0.1"
    assert not args.dashboard_keep
    args = p.parse_args(["dashboard", "runs/x", "--broker", "10.0.0.2:1883", "--port", "0"])
    assert (args.broker.host, args.broker.port, args.no_broker) == ("10.0.0.2", 1883, False)
    with pytest.raises(SystemExit):
        p.parse_args(["dashboard", "runs/x", "--broker", "mdns"])
