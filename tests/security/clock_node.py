"""A signed node whose clock runs off by a set offset, driven line by line (the presence
tests: a member whose clock jumps ahead and back). Not a test module.

``python clock_node.py CERTS PORT MAX_AGE`` then, on stdin, one offset in seconds per line:
for each, the process's clock (``time.time``) becomes real time + offset, node ``n1`` connects
(a new signing session: a restart), publishes presence ``online`` with ``clock=<offset>``,
prints ``up <offset>`` and waits for the next line; it then closes and takes the next offset.
An empty line or end of input ends it."""

from __future__ import annotations

import asyncio
import sys
import time

_real_time = time.time
OFFSET = [0.0]
time.time = lambda: _real_time() + OFFSET[0]  # every module calls time.time() through here

from p2pfl.security.signing import MessageSecurity  # noqa: E402
from p2pfl.wire.transport import Transport  # noqa: E402


async def main(certs: str, port: int, max_age: float) -> None:
    loop = asyncio.get_running_loop()
    line = await loop.run_in_executor(None, sys.stdin.readline)
    while line.strip():
        OFFSET[0] = float(line)
        security = MessageSecurity.from_certs(certs, "n1", ["n0", "n1"], max_age_s=max_age)
        t = Transport(
            "sec", "n1", "127.0.0.1", port, security=security, connect_timeout=10,
            presence={"clock": OFFSET[0]},
        )  # fmt: skip
        async with t:
            print("up", OFFSET[0], flush=True)
            line = await loop.run_in_executor(None, sys.stdin.readline)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3])))
