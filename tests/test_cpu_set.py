"""CPU sets (:mod:`p2pfl.cpu_set`): read as Linux writes them, written back the same way,
checked against the CPUs this process may use, and applied to a child process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from p2pfl.cpu_set import check_usable, format_cpus, parse_cpus, pin, usable_cpus


@pytest.mark.parametrize(
    "text, cpus",
    [
        ("0", [0]),
        ("0-3,6", [0, 1, 2, 3, 6]),
        ("6, 0-1", [0, 1, 6]),
        ([3, 1], [1, 3]),
        ("4095", [4095]),
    ],
)
def test_a_cpu_set_reads_as_a_cpulist_or_a_list(text, cpus):
    assert parse_cpus(text) == cpus
    assert parse_cpus(format_cpus(cpus)) == cpus


@pytest.mark.parametrize(
    "value, words",
    [
        ("", "written as '0-3,6'"),
        ("a-b", "written as '0-3,6'"),
        ("1-", "written as '0-3,6'"),
        ("-1", "written as '0-3,6'"),
        ("3-1", "the range '3-1' runs backwards"),
        ("0-4096", "CPU 4096 is not a CPU number"),
        ([0, -1], "CPU -1 is not a CPU number"),
        ([], "names no CPU"),
        ("0,0-1", "names a CPU twice: '0-1'"),
        ([True], "written as '0-3,6'"),
        (2, "written as '0-3,6'"),
    ],
)
def test_a_bad_cpu_set_says_what_is_wrong(value, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        parse_cpus(value)


def test_format_writes_runs_as_ranges():
    assert format_cpus([6, 0, 1, 2, 3, 9, 10]) == "0-3,6,9-10"
    assert format_cpus({5}) == "5"


def test_only_the_cpus_this_process_may_use_pass():
    usable = usable_cpus()
    assert check_usable(sorted(usable)) == sorted(usable)
    beyond = max(usable) + 1
    with pytest.raises(ValueError, match=f"CPU {beyond} is not one this machine"):
        check_usable([min(usable), beyond])


def test_a_pinned_process_and_what_it_starts_run_on_its_cpus():
    cpu = min(usable_cpus())
    code = (
        "import os, subprocess, sys; from p2pfl.cpu_set import pin; "
        f"pin([{cpu}]); "
        "print(sorted(os.sched_getaffinity(0))); "
        "print(subprocess.run([sys.executable, '-c', "
        "'import os; print(sorted(os.sched_getaffinity(0)))'], "
        "capture_output=True, text=True).stdout.strip())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == [f"[{cpu}]", f"[{cpu}]"]
    before = os.sched_getaffinity(0)
    pin(None)  # absent: nothing changes
    assert os.sched_getaffinity(0) == before
