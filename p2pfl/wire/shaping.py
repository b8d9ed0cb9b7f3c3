"""Kernel shaping of a node's uplink (``network.kernel: true``; docs/wire.md, "Emulated
links").

Where a node runs in a network namespace of its own (a host of the multi-host tests, a
device), the kernel can hold what it sends to its access link's bandwidth: an htb class at
that rate, with a tbf leaf that bounds the queue. The kernel here has no netem, so latency,
jitter and loss stay emulated in the transport (:mod:`p2pfl.wire.emulation`), which then
leaves bandwidth to the kernel. A node that cannot tell it has a namespace of its own is
never shaped: the machine's interfaces carry every other program's traffic too.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from p2pfl.config.emulation import LinkParams

SBIN = ":/usr/sbin:/sbin"
QUEUE_LATENCY = "50ms"  # tbf: longest a packet may wait in the queue before it is dropped


def tc_commands(interface: str, link: LinkParams) -> list[list[str]]:
    """The ``tc`` argument lists that hold ``interface``'s egress to ``link``'s bandwidth
    (none when it has none). Each replaces what is there, so applying them twice is the
    same as once."""
    if link.bandwidth_mbps is None:
        return []
    kbit = max(8, round(link.bandwidth_mbps * 1000))
    rate = f"{kbit}kbit"
    burst = str(max(3200, kbit * 1000 // 8 // 100))  # bytes: 10 ms at the rate, 2 packets at least
    dev = ["dev", interface]
    return [
        ["tc", "qdisc", "replace", *dev, "root", "handle", "1:", "htb", "default", "10"],
        ["tc", "class", "replace", *dev, "parent", "1:", "classid", "1:10", "htb", "rate", rate]
        + ["ceil", rate],
        ["tc", "qdisc", "replace", *dev, "parent", "1:10", "handle", "10:", "tbf", "rate", rate]
        + ["burst", burst, "latency", QUEUE_LATENCY],
    ]


def own_network_namespace(ip: str = "ip") -> bool:
    """Whether this process runs in a network namespace other than the machine's: a named
    one (``ip netns exec``; ``ip netns identify`` names it), or one other than PID 1's.
    False when it cannot tell (PID 1's namespace is not readable, nor is this one named)."""
    try:
        named = subprocess.run(
            [ip, "netns", "identify"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except OSError:
        named = ""
    if named:
        return True
    try:
        return os.stat("/proc/self/ns/net").st_ino != os.stat("/proc/1/ns/net").st_ino
    except OSError:
        return False


def shape_uplink(peer_host: str, link: LinkParams) -> str | None:
    """Shape the interface on the route to ``peer_host`` (the broker) to ``link``'s
    bandwidth. None when done; otherwise why not."""
    if link.bandwidth_mbps is None:
        return "the access link sets no bandwidth"
    path = os.environ.get("PATH", "") + SBIN
    ip, tc = shutil.which("ip", path=path), shutil.which("tc", path=path)
    if ip is None or tc is None:
        return "the `ip` and `tc` commands (iproute2) are needed"
    if not own_network_namespace(ip):
        return "not in a network namespace of its own"
    route = subprocess.run(
        [ip, "-o", "route", "get", peer_host], capture_output=True, text=True, timeout=10
    )
    words = route.stdout.split()
    if route.returncode != 0 or "dev" not in words[:-1]:
        return f"no route to {peer_host}: {route.stderr.strip()}"
    interface = words[words.index("dev") + 1]
    if interface == "lo":
        return "the broker is reached over the loopback"
    for args in tc_commands(interface, link):
        res = subprocess.run([tc, *args[1:]], capture_output=True, text=True, timeout=10)
        if res.returncode != 0:
            return f"`{' '.join(args)}` failed: {res.stderr.strip()}"
    return None
