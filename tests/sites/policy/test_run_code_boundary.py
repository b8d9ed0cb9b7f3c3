"""A site daemon never loads what a peer names (docs/design.md, "Site policy"): it judges a
run by the spec and its method's card, checks outside code only in a short-lived child
process where its policy allows plugins, and holds no torch after voting and running runs.
Real ``p2pfl daemon`` processes and a real broker on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml
from daemon_helpers import Site, spec, wait

pytestmark = pytest.mark.one_broker

PEER_CODE = """
import os, pathlib
pathlib.Path(os.environ["P2PFL_TEST_MARKS"], str(os.getpid())).touch()
Evil = 1  # not a method: a child that imports it says so
"""


@pytest.fixture
def sites(tmp_path, broker):
    made: list[Site] = []

    def make(name: str, policy: dict | None = None, env: dict | None = None) -> Site:
        site = Site(tmp_path, name, broker.address, policy)
        made.append(site)
        return site.start(env)

    yield make
    for site in made:
        site.stop()


def _reasons(site: Site, rid: str, voter: str) -> list[str]:
    return [r["code"] for r in site.run(rid)["votes"][voter]["reasons"]]


def test_a_peers_module_is_never_imported_by_the_daemon(sites, tmp_path):
    """A spec naming ``peer_code:Evil`` (a module that marks who imports it, on the
    daemons' import path): the site whose policy denies plugins refuses it with nothing
    imported; the site that allows them refuses it after a child process imported it and
    found no method in it. No daemon imported it, and neither holds torch."""
    code, marks = tmp_path / "code", tmp_path / "marks"
    code.mkdir()
    marks.mkdir()
    (code / "peer_code.py").write_text(PEER_CODE)
    env = {"PYTHONPATH": f"{code}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env["P2PFL_TEST_MARKS"] = str(marks)
    deny = sites("deny", {"code": {"plugins": "deny"}}, env)
    allow = sites("allow", {"code": {"plugins": "allow"}}, env)
    body = spec(algorithm={"name": "peer_code:Evil"}, vote_deadline_s=15)
    rid = deny.ask("submit", spec=body)["run_id"]
    for site in (deny, allow):
        site.wait_status(rid, {"aborted"}, 120)
    assert _reasons(deny, rid, "deny") == ["plugins_denied"]
    assert _reasons(deny, rid, "allow") == ["plugin_failed"]
    detail = deny.run(rid)["votes"]["allow"]["reasons"][0]["detail"]
    assert "peer_code:Evil" in detail and "not callable" in detail, detail
    imported_by = {int(p.name) for p in marks.iterdir()}
    assert len(imported_by) == 1  # the one child of the allowing site
    assert not imported_by & {deny.proc.pid, allow.proc.pid}
    for site in (deny, allow):
        assert "libtorch" not in site.maps() and "/torch/" not in site.maps()


def _torch_free(*args: str, cwd) -> tuple[int, str]:
    """Run ``p2pfl ARGS`` in a fresh interpreter: (exit status, its output), with a last
    line saying whether torch was imported."""
    code = (
        "import sys\nfrom p2pfl.cli import main\nrc = main(sys.argv[1:])\n"
        "print('TORCH', 'torch' in sys.modules)\nsys.exit(rc)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )
    assert done.stdout.strip().endswith("TORCH False"), (args, done.stdout, done.stderr)
    return done.returncode, done.stdout + done.stderr


def test_the_operators_commands_import_no_torch(sites, tmp_path):
    """``submit``, ``policy check``, ``runs`` and ``vote`` check a spec by its card: no torch
    in their process."""
    site = sites("a", {"approve": "manual"})
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump(spec(members=["a"], quorum={"min_accept": 1})))
    where = ("--site", str(site.path))
    assert _torch_free("policy", "check", str(run), *where, cwd=tmp_path)[0] == 0
    rc, out = _torch_free("submit", str(run), *where, "--json", cwd=tmp_path)
    assert rc == 0, out
    rid = json.loads(out.splitlines()[0])["run_id"]
    wait(lambda: site.run(rid) is not None and "a" in site.run(rid)["votes"], 60, "a's vote")
    assert _torch_free("runs", *where, cwd=tmp_path)[0] == 0
    assert _torch_free("vote", rid, "--reject", *where, cwd=tmp_path)[0] == 0
    assert site.wait_status(rid, {"aborted"}, 60)["votes"]["a"]["vote"] == "reject"
