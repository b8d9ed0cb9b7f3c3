"""The site commands' bad input: one clear line naming the file or the socket, exit 2."""

from __future__ import annotations

import subprocess
import sys


def _p2pfl(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "p2pfl", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


def test_bad_input_and_no_daemon(tmp_path):
    site = tmp_path / "site.yaml"
    site.write_text("site: a\nswarm: f\nstate_dir: st\n")
    typo = tmp_path / "run.yaml"
    typo.write_text("name: x\ndata: d\nroundz: 3\n")
    good = tmp_path / "good.yaml"
    good.write_text("name: x\ndata: d\n")
    done = _p2pfl("submit", str(typo), "--site", str(site), cwd=tmp_path)
    assert done.returncode == 2 and "roundz: unknown field (did you mean 'rounds'?)" in done.stderr
    done = _p2pfl("submit", str(good), "--site", str(site), cwd=tmp_path)
    assert done.returncode == 2 and "no site daemon answers at" in done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    done = _p2pfl("runs", "--site", str(tmp_path / "missing.yaml"), cwd=tmp_path)
    assert done.returncode == 2 and "missing.yaml" in done.stderr
