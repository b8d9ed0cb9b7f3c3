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
import re
import subprocess
import sys
import time

import pytest
from netns_helpers import (
    ROOT,
    SBIN_PATH,
    Net,
    Proc,
    remove_staged_tls,
    require_netns,
    synthetic_topology,
)

from p2pfl.launch.broker import find_mosquitto
from p2pfl.metrics import read_records

pytestmark = pytest.mark.integration

NODES = {"h1": ["n0", "n1"], "h2": ["n2", "n3"]}
BROKER_READY_S = 45.0
NODES_DEADLINE_S = 180.0


def _topology(swarm: str) -> str:
    return synthetic_topology(swarm, NODES, rounds=2, broker="mdns")


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
    ip = require_netns()
    try:
        find_mosquitto()
    except Exception as exc:
        pytest.fail(str(exc))

    net = Net(ip, ["h0", "h1", "h2"])
    swarm = f"mh{net.sfx}"
    topo = tmp_path / "topology.yaml"
    topo.write_text(_topology(swarm))
    certs, run_dir = tmp_path / "certs", tmp_path / "run"
    procs: list[Proc] = []
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
        broker = Proc(
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
            nodes[host] = Proc(
                net,
                host,
                ["node", str(topo), "--host", host, "--certs", str(certs)]
                + ["--out", str(run_dir), "--no-rich"],
                tmp_path / f"node-{host}.log",
            )
        procs.extend(nodes.values())
        # meanwhile, from h1: the broker on h0 is listed by mDNS across the bridge
        lister = Proc(
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
        remove_staged_tls(tmp_path / "broker" / "mosquitto.conf")
