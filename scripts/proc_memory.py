"""A process tree's memory, read from ``/proc`` (Linux): the benchmarks' PSS samplers use
these without importing p2pfl, so they can measure another commit's code."""

from __future__ import annotations

from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc/<pid>/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def pss_mb(pid: int) -> float:
    """The process's proportional set size in MB (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0
