"""``python -m p2pfl ARGS`` run to its end, for the tests that drive the command line as a
user does: the repository's code whatever the working directory, output captured as text."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_p2pfl(
    *args: str,
    cwd: Path | str | None = None,
    path: Iterable[Path | str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """Run ``p2pfl ARGS``. ``PYTHONPATH`` is the repository, then ``path`` (a plugin's
    folder), then the caller's; ``env`` adds variables (``COLUMNS``)."""
    pythonpath = [str(ROOT), *map(str, path)]
    if os.environ.get("PYTHONPATH"):
        pythonpath.append(os.environ["PYTHONPATH"])
    return subprocess.run(
        [sys.executable, "-m", "p2pfl", *args],
        cwd=cwd,
        env={**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(pythonpath)},
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=timeout,
    )
