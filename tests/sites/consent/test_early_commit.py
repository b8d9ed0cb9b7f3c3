"""A run commits as soon as its votes decide it, not at its vote deadline: when every site
it names has voted, or, open to any site, a short grace after its quorum accepted; a
pending vote waits for its operator, and a fallback committer still waits for the
deadline."""

from __future__ import annotations

import pytest
from daemon_helpers import Site, spec

pytestmark = pytest.mark.one_broker

DEADLINE_S = 600  # far past each wait below: a commit that waited for it times the test out


@pytest.mark.integration
def test_runs_commit_once_their_votes_decide_them(tmp_path, broker):
    s1, s2 = (Site(tmp_path, name, broker.address).start() for name in ("s1", "s2"))
    s3 = Site(tmp_path, "s3", broker.address, {"approve": "manual"}).start()
    sites = (s1, s2, s3)
    try:
        named = s1.ask(
            "submit", spec=spec("named", members=["s1", "s2"], vote_deadline_s=DEADLINE_S)
        )["run_id"]
        anyone = s2.ask(
            "submit", spec=spec("anyone", quorum={"min_accept": 2}, vote_deadline_s=DEADLINE_S)
        )["run_id"]
        for site in (s1, s2):
            assert site.wait_status(named, {"finished"}, 120)["members"] == ["s1", "s2"]
            run = site.wait_status(anyone, {"finished"}, 120)
            assert run["members"] == ["s1", "s2"]  # s3's vote is pending: its operator's
        assert "early_commit" not in s3.ask("status")["dropped"]
        assert s3.run(anyone)["status"] == "aborted"

        # a named site whose vote is pending holds the commit until its operator decides
        held = s1.ask(
            "submit", spec=spec("held", members=["s1", "s3"], vote_deadline_s=DEADLINE_S)
        )["run_id"]
        s3.wait_status(held, {"proposed"}, 30)
        assert s1.run(held)["status"] == "proposed"
        s3.ask("vote", run_id=held, accept=True)
        for site in (s1, s3):
            assert site.wait_status(held, {"finished"}, 120)["members"] == ["s1", "s3"]
    finally:
        for site in sites:
            site.stop()
