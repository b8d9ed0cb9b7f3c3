"""How many finished runs' files a site keeps (``limits.keep_runs``): a standing daemon runs
for months, and each run leaves its worker's topology, log and records under
``state_dir/runs/<run id>`` (about 40–80 KiB). The newest ``keep_runs`` finished ones stay;
older ones are removed, whole. What the site agreed stays in its ledger (``p2pfl runs``
lists every run), and the models it kept live in its model store, a copy of their own.
A run that is not final (running, pending, its model being offered) is never touched.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Collection
from pathlib import Path

log = logging.getLogger(__name__)


def prune_runs(runs_dir: Path, keep: int, busy: Collection[str]) -> list[str]:
    """Remove the run directories under ``runs_dir`` beyond the newest ``keep`` (by the
    time they last changed), never one named in ``busy``; returns the run ids removed. A
    directory that cannot be removed is logged and left."""
    if not runs_dir.is_dir():
        return []
    done = [p for p in runs_dir.iterdir() if p.is_dir() and p.name not in busy]
    done.sort(key=lambda p: (p.stat().st_mtime, p.name), reverse=True)
    removed = []
    for path in done[keep:]:
        try:
            shutil.rmtree(path)
        except OSError as exc:
            log.warning("run %s: its files were not removed (limits.keep_runs): %s", path.name, exc)
            continue
        removed.append(path.name)
    return removed
