#!/usr/bin/env python
"""Launch a local swarm — the same entry point as ``p2pfl swarm``.

    python scripts/launch_swarm.py topologies/ring-8.yaml --data-root ../shared/data \
        --rounds 5 --out runs/demo
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pfl.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["swarm", *sys.argv[1:]]))
