"""Kernel shaping (p2pfl.wire.shaping): the tc commands, and the refusal to shape a shared
namespace. Applying them in namespaces: tests/node/test_kernel_shaping.py."""

from __future__ import annotations

import pytest

from p2pfl.config.emulation import PRESETS, LinkParams
from p2pfl.wire.shaping import own_network_namespace, shape_uplink, tc_commands


def test_tc_commands_hold_the_interface_to_the_links_bandwidth():
    assert tc_commands("eth0", PRESETS["lte"]) == [
        ["tc", "qdisc", "replace", "dev", "eth0", "root", "handle", "1:", "htb", "default", "10"],
        ["tc", "class", "replace", "dev", "eth0", "parent", "1:", "classid", "1:10", "htb"]
        + ["rate", "10000kbit", "ceil", "10000kbit"],
        ["tc", "qdisc", "replace", "dev", "eth0", "parent", "1:10", "handle", "10:", "tbf"]
        + ["rate", "10000kbit", "burst", "12500", "latency", "50ms"],
    ]
    slow = tc_commands("v0", LinkParams(bandwidth_mbps=0.5))
    assert slow[1][-4:] == ["rate", "500kbit", "ceil", "500kbit"]
    assert slow[2][slow[2].index("burst") + 1] == "3200"  # two packets at least
    assert not any("netem" in c for c in tc_commands("v0", PRESETS["wan"]))
    assert tc_commands("v0", LinkParams(latency_ms=30)) == []  # no bandwidth: nothing


def test_a_node_outside_a_namespace_of_its_own_is_not_shaped():
    if own_network_namespace():
        pytest.skip("the suite runs in a network namespace of its own")
    assert shape_uplink("127.0.0.1", PRESETS["lte"]) == "not in a network namespace of its own"
    assert shape_uplink("127.0.0.1", LinkParams()) == "the access link sets no bandwidth"
