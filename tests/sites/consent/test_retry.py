"""``p2pfl submit --retry RUN_ID``: a failed, aborted or cancelled run's spec proposed again
as its next attempt, with a run id of its own and a ledger entry that names the run it
retries; the spec's id is unchanged by the new field while it is unset. With the daemon
down, ``p2pfl runs`` reads the ledger."""

from __future__ import annotations

import json

import pytest
from daemon_helpers import Site, p2pfl_cli, spec

from p2pfl.sites.consent.run_spec import retry_spec, run_id, spec_from_dict

pytestmark = pytest.mark.one_broker


def test_an_attempt_has_its_own_id_and_an_unset_retry_changes_no_id():
    first = spec_from_dict(spec())
    assert first.retry is None
    assert "retry" not in json.loads(first.model_dump_json(exclude_none=True))
    second = retry_spec(first, run_id(first))
    third = retry_spec(second, run_id(second))
    assert (second.retry.attempt, second.retry.of) == (2, run_id(first))
    assert (third.retry.attempt, third.retry.of) == (3, run_id(second))
    assert len({run_id(first), run_id(second), run_id(third)}) == 3
    assert run_id(spec_from_dict(second.model_dump(mode="json"))) == run_id(second)
    # the id of a spec without retry is the one it always had: the hash leaves it out
    assert spec_from_dict({**spec(), "retry": None}) == first


@pytest.mark.integration
def test_a_run_aborted_for_a_missing_site_is_retried_when_it_is_back(tmp_path, broker):
    """s2 is down: the run that names it is aborted at the vote deadline. Once s2 is up,
    ``p2pfl submit --retry`` proposes the same spec as attempt 2, which commits with both
    and finishes; its entry at both sites names the aborted run; a second retry of the same
    run, or a retry of a run still going, is refused with the reason."""
    s1 = Site(tmp_path, "s1", broker.address).start()
    s2 = Site(tmp_path, "s2", broker.address)
    try:
        body = spec(members=["s1", "s2"], rounds=1, vote_deadline_s=3)
        first = s1.ask("submit", spec=body)["run_id"]
        assert "s2" in s1.wait_status(first, {"aborted"}, 60)["why"]

        s2.start()
        done = p2pfl_cli("submit", "--retry", first, "--site", str(s1.path), "--json")
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout)
        assert answer["attempt"] == 2 and answer["run_id"] != first
        second = answer["run_id"]
        for site in (s1, s2):
            run = site.wait_status(second, {"finished"}, 180)
            assert (run["retry_of"], run["attempt"], run["members"]) == (first, 2, ["s1", "s2"])
            assert len(site.records(second)) == 1

        again = p2pfl_cli("submit", "--retry", first, "--site", str(s1.path))
        assert again.returncode != 0
        assert f"retried already: run {second} (finished)" in again.stderr + again.stdout
        going = p2pfl_cli("submit", "--retry", second, "--site", str(s2.path))
        assert going.returncode != 0
        assert "is finished: only a failed, aborted or cancelled run" in going.stderr + going.stdout
        shown = p2pfl_cli("runs", "--site", str(s2.path), env={"COLUMNS": "300"})
        assert f"attempt 2 (retries {first})" in shown.stdout
    finally:
        s2.stop()
        s1.stop()
    # with its daemon down, `p2pfl runs` reads the site's ledger read-only
    ledger = s1.state_dir / "ledger.sqlite"
    before = ledger.stat().st_mtime_ns
    shown = p2pfl_cli("runs", "--site", str(s1.path), env={"COLUMNS": "300"})
    assert shown.returncode == 0, shown.stderr
    assert "the daemon is not running" in shown.stdout and f"{second}" in shown.stdout
    rows = {
        r["run_id"]: r
        for r in json.loads(p2pfl_cli("runs", "--site", str(s1.path), "--json").stdout)
    }
    assert rows[first]["status"] == "aborted" and rows[second]["status"] == "finished"
    assert (rows[second]["round"], rows[second]["attempt"]) == (1, 2)
    assert ledger.stat().st_mtime_ns == before
