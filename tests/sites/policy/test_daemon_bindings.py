"""A site's own mistakes surface before it consents: a real ``p2pfl daemon`` on a real
broker checks its data bindings at its start, when their files or the site file change,
and at every vote (docs/design.md, "The site daemon"). Waits on what the daemon says
(its admin socket, ``/readyz``), never on fixed sleeps."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
import yaml
from daemon_helpers import Site, csv_binding, patients, spec, wait

from p2pfl.launch.broker import free_port

pytestmark = pytest.mark.one_broker  # the daemon's MQTT use is the nodes'; Mosquitto only


def _readyz(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _own_vote(site: Site, rid: str) -> dict:
    """This site's own vote on ``rid``, once its daemon has cast it."""
    found: dict = {}

    def voted() -> bool:
        vote = ((site.run(rid) or {}).get("votes") or {}).get(site.name)
        found.update(vote or {})
        return vote is not None

    wait(voted, 60, f"{site.name}'s vote on {rid}", lambda: site.log()[-3000:])
    return found


def test_a_binding_that_cannot_serve_a_run_is_refused_at_the_vote_and_said_in_readyz(
    tmp_path, broker
):
    """Site a's binding ``ward`` has a label typo and its watched binding ``gone`` names a
    CSV that is not there: /readyz says both, each run on them is rejected with
    ``binding_invalid`` naming the binding and its field, and the missing file is logged
    once, not every 2 s. The operator fixes the site file and writes the CSV: the daemon
    takes the file's bindings without a restart, /readyz turns ready, and it accepts."""
    ward = tmp_path / "ward.csv"
    patients(40, seed=0).to_csv(ward, index=False)
    gone = tmp_path / "gone.csv"
    port = free_port()
    data = {
        "ward": csv_binding(ward, label="outcme"),
        "gone": csv_binding(gone, watch=True),
    }
    site = Site(
        tmp_path, "a", broker.address, data=data, observability={"listen": f"127.0.0.1:{port}"}
    ).start()
    try:
        code, why = _readyz(port)
        assert code == 503, why
        assert f"data.ward.label: {ward}: no label column 'outcme'" in why
        assert "did you mean 'outcome'?" in why
        assert f"data.gone.root: {gone} does not exist" in why

        typo = site.ask("submit", spec=spec("typo", data="ward"))["run_id"]
        missing = site.ask("submit", spec=spec("missing", data="gone"))["run_id"]
        vote = _own_vote(site, typo)
        assert vote["vote"] == "reject", vote
        (reason,) = vote["reasons"]
        assert reason["code"] == "binding_invalid"
        assert "data binding 'ward'" in reason["detail"] and "data.ward.label" in reason["detail"]
        vote = _own_vote(site, missing)
        assert vote["vote"] == "reject" and vote["reasons"][0]["code"] == "binding_invalid"
        assert f"data.gone.root: {gone} does not exist" in vote["reasons"][0]["detail"]
        # the vote's deadline passes (the daemon has looked at its files 3 times since):
        # the missing file was said once at the start, not every 2 s
        site.wait_status(typo, {"aborted"}, 60)
        said = [line for line in site.log().splitlines() if "cannot serve a run:" in line]
        assert sum("data binding gone" in line for line in said) == 1, said
        assert not any("no such file or folder" in line for line in site.log().splitlines())

        # the operator fixes the label and writes the file: no restart
        patients(30, seed=1).to_csv(gone, index=False)
        body = yaml.safe_load(site.path.read_text())
        body["data"]["ward"]["label"] = "outcome"
        site.path.write_text(yaml.safe_dump(body))
        wait(lambda: _readyz(port)[0] == 200, 30, "/readyz ready", lambda: _readyz(port)[1])
        fixed = site.ask("submit", spec=spec("fixed", data="ward"))["run_id"]
        assert _own_vote(site, fixed)["vote"] == "accept"
        assert "data bindings changed (ward): taken" in site.log()
        # the tables were read by child processes: the daemon holds no pandas, nor its memory
        assert "pandas" not in site.maps() and "pyarrow" not in site.maps()
        assert site.rss_mib() < 100, site.rss_mib()
    finally:
        site.stop()
