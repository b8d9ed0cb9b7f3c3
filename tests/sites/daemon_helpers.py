"""Real site daemons (``p2pfl daemon --site``) for the acceptance tests: site files, a
daemon process each, and waits on what their admin sockets say (never fixed sleeps)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from cli_run import ROOT
from cli_run import run_p2pfl as p2pfl_cli  # noqa: F401 - the tests' name for it

from p2pfl.sites.daemon.admin_socket import AdminError, call

sys.path.insert(0, str(ROOT / "scripts"))
from site_fixtures import SYNTHETIC_BINDING as SYNTHETIC  # noqa: E402

FEATURES = ["f1", "f2", "f3", "f4"]


def patients(n: int, seed: int):
    """A site's own table: ``n`` rows whose class (``outcome``: good or bad) follows their
    first two features, so a model learns it in a round or two."""
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (n, len(FEATURES)))
    df = pd.DataFrame(x * [3, 2, 1, 1] + [40, 20, 5, 0], columns=FEATURES)
    df["outcome"] = np.where(x[:, 0] + x[:, 1] > 0, "bad", "good")
    return df


def csv_binding(path: Path, **over: Any) -> dict[str, Any]:
    """A data binding of the site's own CSV file (``patients``' columns)."""
    return {
        "name": "csv",
        "root": str(path),
        "partition": "none",
        "label": "outcome",
        "classes": ["good", "bad"],
        "test_fraction": 0.25,
        **over,
    }


def http_json(method: str, url: str, body: bytes | None = None, kind: str = "application/json"):
    """(status, JSON answer) of one HTTP request; (None, {}) when nothing answers."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": kind})
    try:
        with urllib.request.urlopen(req, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")
    except OSError:
        return None, {}


def spec(name: str = "trial", **over: Any) -> dict[str, Any]:
    """A small run spec: UA-PDFL on the synthetic binding ``syn``, two rounds, a vote of 6 s."""
    body: dict[str, Any] = {
        "name": name,
        "rounds": 2,
        "algorithm": {"name": "uapdfl", "params": {"mu": 0.1, "com": 2}},
        "model": {"name": "cnn"},
        "training": {"epochs": 1, "batch_size": 20, "lr": 0.05},
        "timing": {"round_timeout_s": 20, "startup_timeout_s": 30, "linger_s": 2},
        "data": "syn",
        "members": "any",
        "quorum": {"min_accept": 2},
        "vote_deadline_s": 6,
    }
    body.update(over)
    return body


class Site:
    """One site: its file, its daemon process (when started) and its admin socket."""

    def __init__(self, root: Path, name: str, broker: str, policy: dict | None = None, **extra):
        self.name = name
        self.dir = root / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.state_dir = self.dir / "state"
        body = {
            "site": name,
            "swarm": "fed",
            "broker": broker,
            "state_dir": "state",
            "data": {"syn": SYNTHETIC},
            "policy": policy or {},
            # a finished run's model is offered to the gate by a torch process of its own:
            # only the tests of a site's models ask for it (promote={"offer": True})
            "promote": {"offer": False},
            **extra,
        }
        self.path = self.dir / "site.yaml"
        self.path.write_text(yaml.safe_dump(body))
        self.proc: subprocess.Popen | None = None
        self.log_path = self.dir / "daemon.log"

    def start(self, env: dict[str, str] | None = None) -> Site:
        """Start the daemon (``env``: more environment variables) and wait until it is
        connected to the broker."""
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child holds it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "p2pfl", "daemon", "--site", str(self.path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", **(env or {})},
        )
        log.close()
        wait(lambda: self._connected(), 60, f"{self.name}'s daemon to connect")
        return self

    def _connected(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"{self.name}'s daemon exited:\n{self.log()}")
        try:
            return bool(call(self.state_dir, "status", timeout=5)["connected"])
        except AdminError:
            return False

    def ask(self, cmd: str, **fields: Any) -> dict:
        return call(self.state_dir, cmd, timeout=20, **fields)

    def runs(self) -> dict[str, dict]:
        return {r["run_id"]: r for r in self.ask("runs")["runs"]}

    def run(self, run_id: str) -> dict | None:
        return self.runs().get(run_id)

    def wait_status(self, run_id: str, statuses: set[str], timeout: float = 120) -> dict:
        def reached() -> bool:
            r = self.run(run_id)
            return r is not None and r["status"] in statuses

        wait(
            reached,
            timeout,
            f"run {run_id} at {self.name} to be one of {sorted(statuses)}",
            lambda: f"{self.run(run_id)}\n{self.log()[-3000:]}",
        )
        run = self.run(run_id)
        assert run is not None
        return run

    def records(self, run_id: str) -> list[dict]:
        path = self.state_dir / "runs" / run_id / "nodes" / f"{self.name}.jsonl"
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def worker_pid(self, run_id: str) -> int:
        why = self.run(run_id)["why"]  # "worker pid N" while it runs
        return int(why.rsplit(" ", 1)[-1])

    def maps(self) -> str:
        """The daemon process's memory maps (``/proc/PID/maps``): the libraries it loaded."""
        assert self.proc is not None
        return Path(f"/proc/{self.proc.pid}/maps").read_text()

    def rss_mib(self) -> float:
        """The daemon process's resident memory, MiB."""
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def wait(pred, timeout: float, what: str, detail=None, step: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(step)
    raise AssertionError(f"timed out waiting for {what}" + (f"\n{detail()}" if detail else ""))
