"""Kernel shaping applied (``network.kernel``, p2pfl.wire.shaping): two hosts in network
namespaces (tests/node/netns_helpers.py), created and removed by the test; host a shapes
its uplink as a node does, and a TCP transfer from a to b takes the shaped time."""

from __future__ import annotations

import os
import subprocess
import sys

from netns_helpers import ROOT, SBIN_PATH, Net, require_netns

MBPS = 8.0  # 1 MB/s
NBYTES = 1_000_000

RECEIVER = """
import socket, sys, time
s = socket.socket()
s.bind((sys.argv[1], 0))
s.listen(1)
s.settimeout(60)
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
c.settimeout(60)
n, t0 = 0, None
while chunk := c.recv(1 << 16):
    t0 = t0 or time.monotonic()
    n += len(chunk)
print(n, time.monotonic() - t0, flush=True)
"""
SENDER = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
c.sendall(b"x" * int(sys.argv[3]))
c.close()
"""
SHAPE = f"""
import sys
from p2pfl.config.emulation import LinkParams
from p2pfl.wire.shaping import shape_uplink
print(shape_uplink(sys.argv[1], LinkParams(bandwidth_mbps={MBPS})))
"""


def test_a_shaped_uplink_sends_at_the_links_rate():
    ip = require_netns()
    net = Net(ip, ["a", "b"], tag="tc")
    env = {**os.environ, "PATH": SBIN_PATH, "PYTHONPATH": str(ROOT)}

    def in_ns(host: str, code: str, *args: str, **kw) -> subprocess.Popen:
        cmd = [ip, "netns", "exec", net.ns[host], sys.executable, "-c", code, *args]
        return subprocess.Popen(cmd, env=env, cwd=ROOT, text=True, **kw)

    try:
        net.up()
        shaped = in_ns("a", SHAPE, net.addr["b"], stdout=subprocess.PIPE)
        assert shaped.communicate(timeout=60)[0].strip() == "None"  # shaped, no reason
        classes = subprocess.run(
            [ip, "netns", "exec", net.ns["a"], "tc", "class", "show", "dev", net.ends["a"]],
            capture_output=True,
            text=True,
            timeout=20,
            env=env,
        ).stdout
        assert "rate 8Mbit" in classes, classes
        receiver = in_ns("b", RECEIVER, net.addr["b"], stdout=subprocess.PIPE)
        try:
            port = receiver.stdout.readline().strip()  # listening
            sender = in_ns("a", SENDER, net.addr["b"], port, str(NBYTES))
            assert sender.wait(60) == 0
            received, seconds = receiver.stdout.readline().split()
            receiver.wait(20)
        finally:
            receiver.kill()
        assert int(received) == NBYTES
        # 1 MB at 1 MB/s; the bucket lets a little through at once
        assert 0.7 <= float(seconds) < 15, seconds
    finally:
        net.down()
