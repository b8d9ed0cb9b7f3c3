"""``limits.keep_runs``: a standing site keeps the files of its newest finished runs only,
never those of a run under way or whose model is being kept."""

from __future__ import annotations

import os

import pytest

from p2pfl.sites.daemon.site_file import Limits
from p2pfl.sites.runs.retention import prune_runs


def _runs(tmp_path, n: int):
    runs = tmp_path / "runs"
    for i in range(n):
        d = runs / f"run-{i:02d}"
        d.mkdir(parents=True)
        (d / "worker.log").write_text("x" * 100)
        os.utime(d, (1_000_000 + i, 1_000_000 + i))  # run-00 the oldest
    return runs


def test_the_newest_finished_runs_stay_and_busy_ones_are_never_touched(tmp_path):
    runs = _runs(tmp_path, 8)
    removed = prune_runs(runs, keep=3, busy={"run-01"})
    assert removed == ["run-04", "run-03", "run-02", "run-00"]
    assert sorted(p.name for p in runs.iterdir()) == ["run-01", "run-05", "run-06", "run-07"]
    assert prune_runs(runs, keep=3, busy={"run-01"}) == []  # bounded: nothing more to do


def test_no_runs_folder_is_nothing_to_prune(tmp_path):
    assert prune_runs(tmp_path / "runs", keep=1, busy=()) == []


def test_keep_runs_defaults_to_fifty_and_is_positive():
    assert Limits().keep_runs == 50
    with pytest.raises(ValueError):
        Limits(keep_runs=0)
