"""Process limits a packed swarm needs (p2pfl.wire.sysopt)."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest


def test_raise_fd_limit_lifts_the_soft_limit_to_the_hard_one():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"hard open-file limit {hard}: nothing to raise")
    want = min(hard, 1 << 20) if hard != resource.RLIM_INFINITY else 1 << 20
    code = (
        "import resource\n"
        "from p2pfl.wire.sysopt import raise_fd_limit\n"
        "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "print(raise_fd_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(want), str(want)]
