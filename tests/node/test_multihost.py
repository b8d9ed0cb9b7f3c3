"""Three "hosts" on one machine: network namespaces joined by veth pairs on a bridge.

h0 runs ``p2pfl broker`` (Mosquitto with TLS, client certificates and the per-node ACL,
announced by mDNS); h1 and h2 each run ``p2pfl node --host hN`` for the two nodes the
topology pins to them. The nodes find the broker by mDNS across the bridge, connect with
TLS, sign every message, and run two UA-PDFL rounds with peers on the other host.

Needs root and ``ip netns`` (skipped otherwise). Everything it creates — namespaces, the
bridge and veths (in those namespaces; the root namespace's networking is never touched),
processes — carries a random suffix and is removed in ``finally``.
"""

from __future__ import annotations

import math
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2pfl.launch.broker import find_mosquitto
from p2pfl.metrics import read_records

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SBIN_PATH = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
NODES = {"h1": ["n0", "n1"], "h2": ["n2", "n3"]}
BROKER_READY_S = 45.0
NODES_DEADLINE_S = 180.0


def _ip() -> str:
    ip = shutil.which("ip", path=SBIN_PATH)
    if ip is None:
        pytest.skip("network namespaces: the `ip` command (iproute2) is not installed")
    return ip


class _Net:
    """A bridge namespace and three host namespaces, h0..h2, on 10.231.X.0/24."""

    def __init__(self, ip: str):
        self.ip = ip
        sfx = secrets.token_hex(3)
        self.sfx = sfx
        self.ns_br = f"p2pfl-mh-{sfx}-br"
        self.ns = {f"h{i}": f"p2pfl-mh-{sfx}-h{i}" for i in range(3)}
        subnet = random.randint(1, 254)
        self.addr = {f"h{i}": f"10.231.{subnet}.{i + 1}" for i in range(3)}
        self.bridge = f"p2br{sfx}"  # ≤ 15 characters: interface names
        self.created: list[str] = []

    def _run(self, *args: str) -> None:
        res = subprocess.run([self.ip, *args], capture_output=True, text=True, timeout=20)
        if res.returncode != 0:
            raise RuntimeError(f"`ip {' '.join(args)}` failed: {res.stderr.strip()}")

    def up(self) -> None:
        for ns in (self.ns_br, *self.ns.values()):
            self._run("netns", "add", ns)
            self.created.append(ns)
            self._run("-n", ns, "link", "set", "lo", "up")
        br = self.bridge
        self._run("-n", self.ns_br, "link", "add", br, "type", "bridge")
        # mDNS is multicast: without a querier, snooping would stop it at the bridge
        self._run("-n", self.ns_br, "link", "set", br, "type", "bridge", "mcast_snooping", "0")
        self._run("-n", self.ns_br, "link", "set", br, "up")
        for i, (host, ns) in enumerate(self.ns.items()):
            port, end = f"p2v{i}{self.sfx}", f"p2e{i}{self.sfx}"
            # both ends are created inside namespaces we own (never in the root namespace)
            self._run(
                "-n",
                self.ns_br,
                "link",
                "add",
                port,
                "type",
                "veth",
                "peer",
                "name",
                end,
                "netns",
                ns,
            )
            self._run("-n", self.ns_br, "link", "set", port, "master", br)
            self._run("-n", self.ns_br, "link", "set", port, "up")
            self._run("-n", ns, "addr", "add", f"{self.addr[host]}/24", "dev", end)
            self._run("-n", ns, "link", "set", end, "up")

    def pids(self, ns: str) -> list[int]:
        res = subprocess.run(
            [self.ip, "netns", "pids", ns], capture_output=True, text=True, timeout=20
        )
        return [int(p) for p in res.stdout.split() if p.isdigit()]

    def down(self) -> None:
        for ns in reversed(self.created):
            # a process left in a namespace (an orphaned Mosquitto) keeps it alive: end it
            for pid in self.pids(ns):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(
                [self.ip, "netns", "delete", ns], capture_output=True, text=True, timeout=20
            )
        self.created.clear()


class _Proc:
    """A command in a namespace, in its own process group, output to a log file."""

    def __init__(self, net: _Net, host: str, args: list[str], log: Path, **env: str):
        self.log = log
        self.name = log.stem
        self._fh = open(log, "wb")
        environment = {
            **os.environ,
            "PATH": SBIN_PATH,
            "PYTHONUNBUFFERED": "1",
            "COLUMNS": "200",
            "P2PFL_MDNS_INTERFACES": net.addr[host],
            **env,
        }
        self.proc = subprocess.Popen(
            [net.ip, "netns", "exec", net.ns[host], sys.executable, "-m", "p2pfl.cli", *args],
            cwd=ROOT,
            env=environment,
            stdin=subprocess.DEVNULL,
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, n: int = 3000) -> str:
        return f"--- {self.name} (rc {self.proc.poll()}) ---\n{self.text()[-n:]}"

    def wait_for(self, pattern: str, timeout: float) -> re.Match | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.text())
            if m or self.proc.poll() is not None:
                return m or re.search(pattern, self.text())
            time.sleep(0.1)
        return None

    def stop(self, grace: float = 10.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(grace)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:  # whatever is left of its process group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self._fh.close()


def _remove_staged_tls(conf: Path) -> None:
    """The broker stages its TLS files in a temp dir it removes on a clean stop; after a
    kill that dir is left behind: the generated config names it."""
    try:
        text = conf.read_text()
    except OSError:
        return
    m = re.search(r"^cafile (.+)/ca\.crt$", text, re.M)
    if m and Path(m.group(1)).name.startswith("p2pfl-broker-tls-"):
        shutil.rmtree(m.group(1), ignore_errors=True)


def _topology(swarm: str) -> str:
    nodes = ", ".join(f"{{id: {n}, host: {h}}}" for h, ids in NODES.items() for n in ids)
    return f"""\
name: {swarm}
seed: 0
broker: mdns
rounds: 2
algorithm: {{name: uapdfl, params: {{com: 2}}}}
dataset:
  name: synthetic
  partition: dirichlet(0.5)
  synthetic_train: 600
  synthetic_test: 300
  input_shape: [1, 8, 8]
  num_classes: 4
model: {{name: mlp, hidden: 16}}
training: {{epochs: 1, batch_size: 32}}
timing: {{round_timeout_s: 30, startup_timeout_s: 60, linger_s: 5}}
security: {{tls: true, sign: true}}
nodes: [{nodes}]
edges: full
"""


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "p2pfl.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PATH": SBIN_PATH, "COLUMNS": "200"},
    )


def test_swarm_across_three_network_namespaces(tmp_path):
    if os.geteuid() != 0:
        pytest.skip(f"network namespaces need root (running as uid {os.geteuid()})")
    ip = _ip()
    try:
        find_mosquitto()
    except Exception as exc:
        pytest.fail(str(exc))

    net = _Net(ip)
    swarm = f"mh{net.sfx}"
    topo = tmp_path / "topology.yaml"
    topo.write_text(_topology(swarm))
    certs, run_dir = tmp_path / "certs", tmp_path / "run"
    procs: list[_Proc] = []
    t0 = time.monotonic()
    try:
        try:
            net.up()
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            pytest.skip(f"cannot build the network namespaces: {exc}")

        res = _cli("validate", str(topo))
        assert res.returncode == 0, res.stderr
        res = _cli("certs", str(topo), "--out", str(certs), "--broker-host", net.addr["h0"])
        assert res.returncode == 0, res.stderr

        h0, h1 = net.addr["h0"], net.addr["h1"]
        broker = _Proc(
            net,
            "h0",
            ["broker", "--host", h0, "--swarm", swarm, "--certs", str(certs)]
            + ["--workdir", str(tmp_path / "broker")],
            tmp_path / "broker.log",
        )
        procs.append(broker)
        ready = broker.wait_for(
            rf"broker \w+ on ({re.escape(h0)}:\d+) announced for swarm {swarm}", BROKER_READY_S
        )
        assert ready, f"the broker did not come up in {BROKER_READY_S:g} s\n{broker.tail()}"
        broker_address = ready.group(1)

        nodes = {}
        for host in NODES:
            nodes[host] = _Proc(
                net,
                host,
                ["node", str(topo), "--host", host, "--certs", str(certs)]
                + ["--out", str(run_dir), "--no-rich"],
                tmp_path / f"node-{host}.log",
            )
        procs.extend(nodes.values())
        # meanwhile, from h1: the broker on h0 is listed by mDNS across the bridge
        lister = _Proc(
            net, "h1", ["discover", "--seconds", "3", "--interface", h1], tmp_path / "discover.log"
        )
        procs.append(lister)

        deadline = t0 + NODES_DEADLINE_S
        for proc in (*nodes.values(), lister):
            try:
                proc.proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        logs = "\n".join(p.tail() for p in procs)
        for host, proc in nodes.items():
            rc = proc.proc.poll()
            assert rc is not None, f"node process on {host} still running after deadline\n{logs}"
            assert rc == 0, f"node process on {host} exited with {rc}\n{logs}"

        final = {}
        for nid in (n for ids in NODES.values() for n in ids):
            recs = read_records(run_dir / "nodes" / f"{nid}.jsonl")
            last = [r for r in recs if r.get("round") == 2]
            assert last, f"{nid}: no record for round 2: {recs}\n{logs}"
            acc = last[0].get("test_acc")
            assert isinstance(acc, (int, float)) and math.isfinite(acc), (nid, last[0])
            final[nid] = last[0]
        # traffic crossed the bridge: a node on h1 heard from (and merged) a node on h2
        crossed = {nid: sorted(set(final[nid]["peers"]) & set(NODES["h2"])) for nid in NODES["h1"]}
        assert any(crossed.values()), f"no h1 node used an h2 peer in round 2: {crossed}\n{logs}"
        # the nodes connected where mDNS said (the first one records the resolved config)
        assert broker_address in (run_dir / "config.yaml").read_text()

        listed = lister.text()
        assert lister.proc.poll() == 0, lister.tail()
        assert swarm in listed and broker_address in listed, lister.tail()
    finally:
        for proc in reversed(procs):
            proc.stop()
        net.down()
        _remove_staged_tls(tmp_path / "broker" / "mosquitto.conf")
