"""``p2pfl serve --site`` with ``serving.workers`` (``p2pfl.sites.models.serving_pool``): a
real serving process forks its workers around one port, every one answers what ``p2pfl
predict`` answers, a killed worker is forked again while the others go on answering, and
SIGTERM ends them all. A real process on loopback, a real model built like a swarm's."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from export_helpers import CLASSES, FEATURES, SPEC, two_tabular_runs

from p2pfl.cpu_set import format_cpus
from p2pfl.export import classify
from p2pfl.launch.broker import free_port
from p2pfl.sites.models.store import ModelStore


def _children(pid: int) -> set[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    try:
        return {int(p) for p in path.read_text().split()}
    except OSError:
        return set()


def _wait(pred, what: str, timeout: float = 60.0, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}" + (f": {log.read_text()}" if log else ""))


def _predict(port: int, records: list[dict], connections: int, each: int) -> list[dict]:
    """``connections`` keep-alive clients at once, ``each`` requests of one record apiece."""

    def client(i: int) -> list[dict]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        answers = []
        try:
            for k in range(each):
                record = records[(i * each + k) % len(records)]
                conn.request(
                    "POST",
                    "/v1/predict",
                    json.dumps([record]),
                    {"Content-Type": "application/json"},
                )
                reply = conn.getresponse()
                body = json.loads(reply.read())
                assert reply.status == 200, body
                answers.append({"row": (i * each + k) % len(records), **body})
        finally:
            conn.close()
        return answers

    with ThreadPoolExecutor(connections) as pool:
        return [a for batch in pool.map(client, range(connections)) for a in batch]


def _ready(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/v2/health/ready")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def _served_site(tmp_path: Path, serving: dict) -> tuple[Path, ModelStore, str]:
    """A site file whose state serves a model built like a swarm's, with ``serving``; its
    store and the served entry's id."""
    site_dir = tmp_path / "site"
    store = ModelStore(site_dir / "state", "a")
    first, _ = two_tabular_runs(tmp_path / "runs", SPEC, CLASSES)
    entry = store.add(first.dir, "run1")
    store.promote(entry.id)
    site_file = site_dir / "site.yaml"
    site_file.write_text(
        yaml.safe_dump({"site": "a", "swarm": "fed", "state_dir": "state", "serving": serving})
    )
    return site_file, store, entry.id


def _serve(site_file: Path, log: Path) -> subprocess.Popen:
    """``p2pfl serve --site SITE_FILE``, its output in ``log``."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "p2pfl", "serve", "--site", str(site_file)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def test_serving_cpus_pins_the_server_and_auto_sizes_the_pool_to_them(tmp_path):
    """``serving.cpus`` of one CPU: the server runs there, and ``workers: auto`` is one
    worker (the process itself), which answers."""
    cpu = max(os.sched_getaffinity(0))
    port = free_port()
    site_file, _, _ = _served_site(tmp_path, {"listen": f"127.0.0.1:{port}", "cpus": str(cpu)})
    log = tmp_path / "serve.log"
    proc = _serve(site_file, log)
    try:
        _wait(lambda: _ready(port), "the server", log=log)
        assert os.sched_getaffinity(proc.pid) == {cpu}
        assert f"1 worker on CPUs {cpu}," in log.read_text()
        assert not _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_serving_workers_share_one_port_and_outlive_a_killed_worker(tmp_path):
    port = free_port()
    cpus = [max(os.sched_getaffinity(0))]  # serving.cpus: the workers run on its one CPU
    serving = {"listen": f"127.0.0.1:{port}", "workers": 2, "cpus": cpus}
    site_file, store, served = _served_site(tmp_path, serving)
    rng = np.random.default_rng(5)
    df = pd.DataFrame({f: rng.normal(50, 10, 12) for f in FEATURES})
    df.to_csv(tmp_path / "rows.csv", index=False)
    rows, out = tmp_path / "rows.csv", tmp_path / "predicted.csv"
    want = pd.read_csv(classify(store.path(served), "a", rows, out).path)
    records = df.to_dict(orient="records")

    log = tmp_path / "serve.log"
    proc = _serve(site_file, log)
    try:
        _wait(lambda: _ready(port) and len(_children(proc.pid)) == 2, "two workers", log=log)
        workers = _children(proc.pid)
        assert all(os.sched_getaffinity(pid) == set(cpus) for pid in workers)
        assert f"2 workers on CPUs {format_cpus(cpus)}," in log.read_text()

        def check(answers: list[dict]) -> None:
            for a in answers:
                assert a["model"] == served
                row = want.iloc[a["row"]]
                assert a["predictions"][0]["label"] == row["label"]
                probs = [row[f"p_{c}"] for c in a["classes"]]
                np.testing.assert_allclose(a["predictions"][0]["probabilities"], probs, atol=1e-6)

        check(_predict(port, records, connections=8, each=10))

        victim = min(workers)
        os.kill(victim, signal.SIGKILL)
        _wait(
            lambda: len(_children(proc.pid)) == 2 and victim not in _children(proc.pid),
            "a worker forked in the killed one's place",
            log=log,
        )
        check(_predict(port, records, connections=4, each=5))
        assert f"serving worker {victim} ended (signal SIGKILL)" in log.read_text()

        workers = _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
        for pid in workers:
            _wait(lambda p=pid: not Path(f"/proc/{p}").exists(), f"worker {pid} to end")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
