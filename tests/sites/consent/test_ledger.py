"""A site's consent ledger (:mod:`p2pfl.sites.consent.ledger`): what came is kept across a restart,
a retained proposal heard again is not a new run, and a status never goes back."""

from __future__ import annotations

import pytest

from p2pfl.sites.consent.ledger import ConsentLedger, LedgerError

SPEC = {"name": "ward", "rounds": 3, "data": "ward"}


def test_a_run_its_votes_and_commits_survive_a_restart(tmp_path):
    path = tmp_path / "state" / "ledger.sqlite"
    with ConsentLedger(path) as ledger:
        assert ledger.propose("r1", "ward", "a", SPEC, signed=b"sig")
        assert not ledger.propose("r1", "ward", "a", SPEC)  # the retained spec, again
        ledger.vote("r1", "b", {"vote": "pending", "reasons": [], "policy": "p1"})
        ledger.vote("r1", "b", {"vote": "accept", "reasons": [], "policy": "p1"})  # decided
        ledger.vote(
            "r1",
            "c",
            {"vote": "reject", "reasons": [{"code": "method_not_allowed"}], "policy": "p2"},
        )
        ledger.commit("r1", "a", ["b", "a"])
        ledger.set_status("r1", "committed")
    with ConsentLedger(path) as ledger:
        run = ledger.run("r1")
        assert run is not None and run.status == "committed" and run.spec == SPEC
        assert run.votes["b"]["vote"] == "accept" and run.votes["c"]["reasons"][0]["code"]
        assert run.commits == {"a": ["a", "b"]}
        assert [r.run_id for r in ledger.runs()] == ["r1"]
        assert ledger.run("nope") is None


def test_another_spec_under_a_known_id_is_refused(tmp_path):
    with ConsentLedger(tmp_path / "l.sqlite") as ledger:
        ledger.propose("r1", "ward", "a", SPEC)
        with pytest.raises(LedgerError, match="another spec"):
            ledger.propose("r1", "ward", "a", {**SPEC, "rounds": 4})


def test_a_status_follows_the_lifecycle_and_never_goes_back(tmp_path):
    with ConsentLedger(tmp_path / "l.sqlite") as ledger:
        ledger.propose("r1", "ward", "a", SPEC)
        with pytest.raises(LedgerError, match="proposed cannot become running"):
            ledger.set_status("r1", "running")
        for status in ("committed", "running", "finished"):
            ledger.set_status("r1", status)
        with pytest.raises(LedgerError, match="finished cannot become running"):
            ledger.set_status("r1", "running")
        ledger.propose("r2", "ward", "a", {**SPEC, "rounds": 5})
        ledger.set_status("r2", "aborted", "1 of the 2 accepting sites needed")
        assert ledger.run("r2").why.startswith("1 of the 2")
        with pytest.raises(LedgerError, match="unknown status"):
            ledger.set_status("r2", "lost")
        with pytest.raises(LedgerError, match="not known"):
            ledger.vote("r9", "b", {"vote": "accept"})


def test_each_sites_told_status_is_kept_newest_first_and_read_offline(tmp_path):
    path = tmp_path / "l.sqlite"
    told = {"status": "running", "why": "", "round": 2, "metrics": {"test_acc": 0.8}}
    with ConsentLedger(path) as ledger:
        ledger.propose("r1", "ward", "a", SPEC)
        assert ledger.site_status("r1", "b", told, at=10.0)
        final = {**told, "status": "finished", "why": "3 rounds", "round": 3}
        assert ledger.site_status("r1", "b", final, at=12.0)
        assert not ledger.site_status("r1", "b", told, at=11.0)  # an older one, heard late
        with pytest.raises(LedgerError, match="not known"):
            ledger.site_status("r9", "b", told, at=1.0)
    with ConsentLedger(path, read_only=True) as ledger:
        assert ledger.run("r1").sites == {"b": {**final, "at": 12.0}}


def test_a_ledger_older_than_site_statuses_reads_offline(tmp_path):
    import sqlite3

    path = tmp_path / "l.sqlite"
    with ConsentLedger(path) as ledger:
        ledger.propose("r1", "ward", "a", SPEC)
    with sqlite3.connect(path) as db:
        db.execute("DROP TABLE site_status")
    with ConsentLedger(path, read_only=True) as ledger:
        assert ledger.run("r1").sites == {}
