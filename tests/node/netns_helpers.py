"""Hosts on one machine for the multi-host tests: network namespaces joined by veth pairs on
a bridge namespace, and ``p2pfl`` commands run inside them.

Needs root and ``ip netns`` (:func:`require_netns` skips otherwise). Everything a :class:`Net`
creates (namespaces, the bridge and veths, all inside namespaces it owns: the root
namespace's networking is never touched) carries a random suffix and is removed by
:meth:`Net.down`, which also ends any process left in them.
"""

from __future__ import annotations

import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SBIN_PATH = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"


def synthetic_topology(
    swarm: str,
    hosts: dict[str, list[str]],
    *,
    rounds: int,
    algorithm: str = "uapdfl",
    secure: bool = True,
    broker: str | None = None,
) -> str:
    """The topology YAML of the multi-host tests: a small synthetic task (MLP, 4 classes,
    600 training examples), every node pinned to its host (``hosts``: host → node ids), a
    full graph; UA-PDFL draws 2 peers; ``secure``: TLS and signatures; ``broker``: a
    ``broker:`` value (e.g. ``mdns``), else the topology's default."""
    nodes = ", ".join(f"{{id: {n}, host: {h}}}" for h, ids in hosts.items() for n in ids)
    params = "{com: 2}" if algorithm == "uapdfl" else "{}"
    security = "{tls: true, sign: true}" if secure else "{tls: false, sign: false}"
    broker_line = f"broker: {broker}\n" if broker else ""
    return f"""\
name: {swarm}
seed: 0
{broker_line}rounds: {rounds}
algorithm: {{name: {algorithm}, params: {params}}}
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
security: {security}
nodes: [{nodes}]
edges: full
"""


def require_netns() -> str:
    """The ``ip`` command; skips the test (with the reason) without root or iproute2."""
    if os.geteuid() != 0:
        pytest.skip(f"network namespaces need root (running as uid {os.geteuid()})")
    ip = shutil.which("ip", path=SBIN_PATH)
    if ip is None:
        pytest.skip("network namespaces: the `ip` command (iproute2) is not installed")
    return ip


class Net:
    """A bridge namespace and one namespace per host, on 10.231.X.0/24 (host ``i`` of
    ``hosts`` at ``.i+1``)."""

    def __init__(self, ip: str, hosts: Sequence[str], tag: str = "mh"):
        self.ip = ip
        sfx = secrets.token_hex(3)
        self.sfx = sfx
        self.ns_br = f"p2pfl-{tag}-{sfx}-br"
        self.ns = {h: f"p2pfl-{tag}-{sfx}-{h}" for h in hosts}
        subnet = random.randint(1, 254)
        self.addr = {h: f"10.231.{subnet}.{i + 1}" for i, h in enumerate(hosts)}
        self.bridge = f"p2br{sfx}"  # ≤ 15 characters: interface names
        self.ports = {h: f"p2v{i}{sfx}" for i, h in enumerate(hosts)}  # bridge-side veth ends
        self.ends = {h: f"p2e{i}{sfx}" for i, h in enumerate(hosts)}  # host-side veth ends
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
        for host, ns in self.ns.items():
            port, end = self.ports[host], self.ends[host]
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

    def link_bytes(self, host: str) -> dict[str, int]:
        """Bytes ``host`` has sent and received over its cable (``tx``, ``rx``): its traffic
        with the other hosts (traffic to its own address stays on its loopback)."""
        res = subprocess.run(
            [self.ip, "-n", self.ns[host], "-j", "-s", "link", "show", "dev", self.ends[host]],
            capture_output=True,
            text=True,
            timeout=20,
        )
        stats = json.loads(res.stdout)[0]["stats64"]
        return {"tx": stats["tx"]["bytes"], "rx": stats["rx"]["bytes"]}

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


class Proc:
    """``python -m p2pfl.cli ARGS`` in ``host``'s namespace, in its own process group, output
    to a log file; mDNS limited to the host's address."""

    def __init__(self, net: Net, host: str, args: list[str], log: Path, **env: str):
        self.log = log
        self.name = log.stem
        self._fh = open(log, "wb")
        environment = {
            **os.environ,
            "PATH": SBIN_PATH,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
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
        """The first match of ``pattern`` in the output, polled until ``timeout`` or the
        process ends."""
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


def remove_staged_tls(conf: Path) -> None:
    """A TLS broker stages its files in a temp dir it removes on a clean stop; after a kill
    that dir is left behind: the generated config names it."""
    try:
        text = conf.read_text()
    except OSError:
        return
    m = re.search(r"^cafile (.+)/ca\.crt$", text, re.M)
    if m and Path(m.group(1)).name.startswith("p2pfl-broker-tls-"):
        shutil.rmtree(m.group(1), ignore_errors=True)


def wait_all(procs: Sequence[Proc], deadline: float) -> None:
    """Wait for every process to end, until ``deadline`` (monotonic) at most."""
    for p in procs:
        try:
            p.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
