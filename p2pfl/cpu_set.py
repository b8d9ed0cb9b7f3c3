"""CPU sets: the cores a site's serving processes and its runs' workers may run on
(``serving.cpus``, ``limits.worker_cpus``; docs/design.md, "The site daemon").

A set is written as Linux writes one (``taskset -c``, systemd's ``CPUAffinity=``, the
kernel's ``cpulist``): ``"0-3,6"``, or as a list of CPU numbers (``[0, 1, 2, 3, 6]``).
A process pinned to a set runs on those CPUs only, and so do the processes and threads it
starts afterwards (Linux's ``sched_setaffinity``; a fork inherits it).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

MAX_CPU = 4095
"""The highest CPU number a set may name (Linux's default ``NR_CPUS`` on x86-64 and arm64)."""


def parse_cpus(value: object) -> list[int]:
    """The sorted CPU numbers of ``value``: a cpulist string (``"0-3,6"``) or a list of
    CPU numbers; a ``ValueError`` that says what is wrong with it."""
    if isinstance(value, str):
        cpus: list[int] = []
        for part in value.replace(" ", "").split(","):
            low, dash, high = part.partition("-")
            if not low.isdigit() or (dash and not high.isdigit()):
                raise ValueError(f"CPUs are written as '0-3,6' or [0, 1, 2, 3, 6], got {value!r}")
            first, last = int(low), int(high) if dash else int(low)
            if last < first:
                raise ValueError(f"the range {part!r} runs backwards")
            if last > MAX_CPU:
                raise ValueError(f"CPU {last} is not a CPU number (0 to {MAX_CPU})")
            cpus.extend(range(first, last + 1))
    elif isinstance(value, list) and all(type(c) is int for c in value):
        cpus = list(value)
    else:
        raise ValueError(f"CPUs are written as '0-3,6' or [0, 1, 2, 3, 6], got {value!r}")
    if not cpus:
        raise ValueError("names no CPU")
    bad = [c for c in cpus if not 0 <= c <= MAX_CPU]
    if bad:
        raise ValueError(f"CPU {bad[0]} is not a CPU number (0 to {MAX_CPU})")
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"names a CPU twice: {format_cpus(cpus)!r}")
    return sorted(cpus)


def format_cpus(cpus: Iterable[int]) -> str:
    """``cpus`` as a cpulist string: ``[0, 1, 2, 3, 6]`` is ``"0-3,6"``."""
    parts: list[str] = []
    run: list[int] = []
    for cpu in sorted(set(cpus)):
        if run and cpu != run[-1] + 1:
            parts.append(_span(run))
            run = []
        run.append(cpu)
    if run:
        parts.append(_span(run))
    return ",".join(parts)


def _span(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def usable_cpus() -> set[int]:
    """The CPUs this process may run on now."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def check_usable(cpus: Iterable[int]) -> list[int]:
    """``cpus`` when every one is a CPU this process may run on, else a ``ValueError``
    naming the first that is not and the usable ones."""
    usable = usable_cpus()
    missing = [c for c in cpus if c not in usable]
    if missing:
        raise ValueError(
            f"CPU {missing[0]} is not one this machine lets this process use "
            f"(usable: {format_cpus(usable)})"
        )
    return list(cpus)


def pin(cpus: Iterable[int] | None) -> None:
    """Run this process (its calling thread, and every process and thread it starts
    afterwards) on ``cpus`` only; nothing when ``cpus`` is None."""
    if cpus is not None:
        os.sched_setaffinity(0, set(cpus))
