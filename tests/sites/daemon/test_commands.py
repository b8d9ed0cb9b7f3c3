"""The site commands' bad input: one clear line naming the file or the socket, exit 2."""

from __future__ import annotations

from daemon_helpers import p2pfl_cli


def test_bad_input_and_no_daemon(tmp_path):
    site = tmp_path / "site.yaml"
    site.write_text("site: a\nswarm: f\nstate_dir: st\n")
    typo = tmp_path / "run.yaml"
    typo.write_text("name: x\ndata: d\nroundz: 3\n")
    good = tmp_path / "good.yaml"
    good.write_text("name: x\ndata: d\n")
    done = p2pfl_cli("submit", str(typo), "--site", str(site), cwd=tmp_path, timeout=120)
    assert done.returncode == 2 and "roundz: unknown field (did you mean 'rounds'?)" in done.stderr
    done = p2pfl_cli("submit", str(good), "--site", str(site), cwd=tmp_path, timeout=120)
    assert done.returncode == 2 and "no site daemon answers at" in done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    done = p2pfl_cli("runs", "--site", str(tmp_path / "missing.yaml"), cwd=tmp_path, timeout=120)
    assert done.returncode == 2 and "missing.yaml" in done.stderr
