"""The dashboard in a real headless browser (Debian's chromium driven by playwright) while
``p2pfl swarm --dashboard-keep`` runs a small synthetic swarm: the page loads without a
script error, draws one graph element per node, colours nodes by their live state, and its
accuracy curve grows while the swarm runs; afterwards the finished run stays served until
the launcher is stopped. A hand-written run's robustness facts: a distrusted edge is drawn
dashed, an attacking node ringed, a rolled-back one badged."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from p2pfl.check.load import load_topology
from p2pfl.config.schema import dump_topology
from p2pfl.dashboard.server import DashboardThread

CHROMIUM = Path("/usr/bin/chromium")
ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="needs Debian's chromium at /usr/bin/chromium (apt-get install -y chromium)",
    ),
]

POINTS = "document.querySelectorAll('#chart-acc circle.pt').length"
# every state the graph's nodes took, recorded in the page as it changes (waits are given
# functions, not expressions: the page's content security policy forbids eval)
RECORD_STATES = """() => {
  window.__states = new Set();
  const note = () => document.querySelectorAll('#g-nodes [data-node]')
    .forEach((e) => window.__states.add(e.dataset.state));
  note();
  new MutationObserver(note).observe(document.getElementById('g-nodes'),
    {attributes: true, subtree: true, attributeFilter: ['data-state']});
}"""


def _read_lines(proc: subprocess.Popen, lines: queue.Queue) -> None:
    for line in proc.stdout:
        lines.put(line)


def test_page_follows_a_running_swarm(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    rounds = 5
    cmd = [
        sys.executable,
        "-m",
        "p2pfl.cli",
        "swarm",
        "topologies/synthetic.yaml",
        "--out",
        str(tmp_path / "run"),
        "--rounds",
        str(rounds),
        "--nodes-per-process",
        "4",
        "--no-progress",
        "--dashboard-keep",
        "--set",
        "dataset.synthetic_train=1600",  # rounds long enough to watch the curve grow
        "--set",
        "timing.linger_s=2",
    ]
    env = {**os.environ, "PATH": os.environ.get("PATH", "") + ":/usr/sbin", "COLUMNS": "200"}
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_read_lines, args=(proc, lines), daemon=True).start()
    output: list[str] = []

    def wait_line(pattern: str, timeout: float) -> re.Match:
        while True:
            try:
                line = lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no {pattern!r} in:\n{''.join(output)}") from None
            output.append(line)
            if m := re.search(pattern, line):
                return m

    try:
        url = wait_line(r"dashboard (http://127\.0\.0\.1:\d+/)", 30).group(1)
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(url + "?poll=200")
            page.wait_for_selector("#g-nodes [data-node]", timeout=10_000)
            ids = page.eval_on_selector_all(
                "#g-nodes [data-node]", "es => es.map(e => e.dataset.node)"
            )
            assert ids == ["a", "b", "c", "d"]
            assert page.locator("#g-edges line.edge").count() == 4  # a ring of four
            page.evaluate(RECORD_STATES)
            # the curve grows while the swarm runs: a first round, then more
            page.wait_for_function(f"() => {POINTS} > 0", timeout=40_000)
            first = page.evaluate(POINTS)
            assert page.inner_text("#run-status") == "running"
            page.wait_for_function(f"() => {POINTS} > {first}", timeout=30_000)
            # then every node is done and every round is plotted: 4 nodes and the mean
            page.wait_for_function(
                "() => [...document.querySelectorAll('#g-nodes [data-node]')]"
                ".every(e => e.dataset.state === 'done')",
                timeout=30_000,
            )
            page.wait_for_function(f"() => {POINTS} === {5 * rounds}", timeout=10_000)
            assert first < 5 * rounds
            states = set(page.evaluate("[...window.__states]"))
            # live states came from the broker (presence and status telemetry)
            assert states & {"online", "training", "waiting", "aggregating", "evaluating"}
            assert page.locator("#dec-panel").is_visible()  # UA-PDFL's decisions
            wait_line(r"stays up", 30)  # --dashboard-keep: the finished run is still served
            page.wait_for_function(
                "() => document.getElementById('run-status').textContent === 'finished'",
                timeout=10_000,
            )
            assert errors == []
            browser.close()
        proc.send_signal(signal.SIGINT)  # Ctrl-C stops the kept dashboard
        assert proc.wait(timeout=20) == 0, "".join(output)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_page_marks_distrust_attacks_and_rollbacks(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    run = tmp_path / "run"
    (run / "nodes").mkdir(parents=True)
    cfg = load_topology("topologies/synthetic.yaml", ["broker=127.0.0.1:1"])  # ring a-b-c-d
    (run / "config.yaml").write_text(dump_topology(cfg))
    base = {"round": 1, "test_acc": 0.5, "bytes_sent": 10, "round_s": 1.0, "chosen": []}
    recs = {
        "a": {"rejected": {"b": "norm ratio 25 > 10"}, "distrusted": {"b": 4}},
        "b": {"attack": ["sign_flip"], "distrusted": {}},
        "c": {"diverged": {"merged_from": ["b"], "rolled_back_to": 0}, "distrusted": {}},
        "d": {},  # an older record: no robustness fields
    }
    for nid, extra in recs.items():
        (run / "nodes" / f"{nid}.jsonl").write_text(json.dumps({**base, **extra}) + "\n")
    dash = DashboardThread(run, port=0, broker=None)
    url = dash.start()
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(url + "?poll=200")
            edge = page.locator("#g-edges line.edge.distrusted")
            edge.wait_for(timeout=10_000)
            assert edge.count() == 1 and edge.get_attribute("data-edge") == "a|b"
            assert edge.evaluate("e => getComputedStyle(e).strokeDasharray") not in ("", "none")
            assert "a distrusts b until round 4" in edge.locator("title").text_content()
            assert page.locator("#g-nodes .node.attacking").get_attribute("data-node") == "b"
            assert page.locator("#g-nodes .node.diverged").get_attribute("data-node") == "c"
            assert page.locator("#legend-robust").is_visible()
            assert "1 refused" in page.inner_text("#progress")
            assert errors == []
            browser.close()
    finally:
        dash.stop()
