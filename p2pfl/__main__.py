"""``python -m p2pfl``: the ``p2pfl`` command (how a site daemon starts its run workers)."""

import sys

from p2pfl.cli import main

if __name__ == "__main__":
    sys.exit(main())
