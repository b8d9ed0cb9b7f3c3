"""Site daemons admit runs by their own policy, with no server: real ``p2pfl daemon``
processes, a real broker on loopback, real workers training (docs/design.md, "Site
policy"). Each test waits on what the daemons' admin sockets say, never on fixed sleeps."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from daemon_helpers import Site, p2pfl_cli, spec, wait
from prometheus_client.parser import text_string_to_metric_families

from p2pfl.launch.broker import free_port
from p2pfl.sites.daemon.admin_socket import socket_path
from p2pfl.sites.policy.rules import Policy, policy_digest

pytestmark = pytest.mark.one_broker  # the daemons' MQTT use is the nodes'; Mosquitto only


@pytest.fixture
def sites(tmp_path, broker):
    """A factory of started site daemons on ``broker``; every one is stopped after."""
    made: list[Site] = []

    def make(name: str, policy: dict | None = None, start: bool = True, **extra) -> Site:
        site = Site(tmp_path, name, broker.address, policy, **extra)
        made.append(site)
        return site.start() if start else site

    yield make
    for site in made:
        site.stop()


def _http(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_a_site_refuses_the_method_and_a_dp_site_trains_under_its_own_bound(sites):
    """Three sites; s3's policy refuses the method: it votes reject with the reason, and the
    run commits with s1 and s2 and finishes. s2 requires DP (max_epsilon 8) though the spec
    asks none: its records show ε, s1's do not. /metrics parses; the run directory records
    the run_id and the policy digest it ran under."""
    port = free_port()
    s1 = sites("s1", observability={"listen": f"127.0.0.1:{port}"})
    dp_policy = {"privacy": {"require_dp": True, "max_epsilon": 8}}
    s2 = sites("s2", dp_policy)
    s3 = sites("s3", {"methods": {"allow": ["fedavg"]}})
    rid = s1.ask("submit", spec=spec())["run_id"]
    r3 = s3.wait_status(rid, {"aborted"}, 60)
    assert r3["votes"]["s3"]["vote"] == "reject"
    assert r3["votes"]["s3"]["reasons"][0]["code"] == "method_not_allowed"
    assert "not among the members" in r3["why"]
    for site in (s1, s2):
        run = site.wait_status(rid, {"finished"}, 180)
        assert run["members"] == ["s1", "s2"] and run["round"] == 2
        facts = json.loads((site.state_dir / "runs" / rid / "run.json").read_text())
        assert facts["run_id"] == rid and facts["members"] == ["s1", "s2"]
    assert json.loads((s2.state_dir / "runs" / rid / "run.json").read_text())["policy"] == (
        policy_digest(Policy.model_validate(dp_policy))
    )
    assert all(isinstance(r.get("epsilon"), float) and r["epsilon"] <= 8 for r in s2.records(rid))
    assert all("epsilon" not in r for r in s1.records(rid))
    assert not (s3.state_dir / "runs" / rid).exists()  # no worker at the refusing site
    for site in (s1, s2, s3):  # voted and ran a run: the daemon holds no torch, nor its memory
        assert "libtorch" not in site.maps(), site.name
        assert site.rss_mib() < 100, (site.name, site.rss_mib())
    # observability of s1: alive, ready, and metrics that parse
    assert _http(f"http://127.0.0.1:{port}/livez")[0] == 200
    assert _http(f"http://127.0.0.1:{port}/readyz") == (200, "ready\n")
    code, text = _http(f"http://127.0.0.1:{port}/metrics")
    assert code == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}
    runs = {s.labels["state"]: s.value for s in families["p2pfl_runs"].samples}
    assert runs["finished"] == 1
    assert any(
        s.value >= 2
        for s in families["p2pfl_round_duration_seconds"].samples
        if s.name.endswith("_count")
    )
    # the admin socket is the operator's alone
    assert stat.S_IMODE(os.stat(socket_path(s1.state_dir)).st_mode) == 0o600
    # the CLI reads the same daemon
    cli = p2pfl_cli("runs", "--site", str(s3.path), "--json")
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)[0]["votes"]["s3"]["reasons"][0]["code"] == "method_not_allowed"
    logs = p2pfl_cli("logs", rid, "--site", str(s1.path), "--tail", "5")
    assert logs.returncode == 0 and logs.stdout.strip(), logs.stderr


def test_too_few_accepting_sites_abort_the_run_and_no_worker_starts(sites):
    s1 = sites("s1")
    s2 = sites("s2", {"resources": {"max_rounds": 1}})
    rid = s1.ask("submit", spec=spec(quorum={"min_accept": 2}))["run_id"]
    for site in (s1, s2):
        run = site.wait_status(rid, {"aborted"}, 60)
        assert "1 of the 2 accepting sites needed" in run["why"], run
        assert not (site.state_dir / "runs" / rid).exists()
    assert s1.run(rid)["votes"]["s2"]["reasons"][0]["code"] == "too_many_rounds"


def test_a_run_aborted_for_too_few_votes_names_who_did_not_vote(sites):
    s1 = sites("s1")
    rid = s1.ask("submit", spec=spec(members=["s1", "ghost"], quorum={"min_accept": 2}))
    run = s1.wait_status(rid["run_id"], {"aborted"}, 60)
    assert run["why"].endswith("no vote in time from ghost"), run


def test_a_run_whose_quorum_is_out_of_reach_aborts_before_its_deadline(sites):
    """s2 refuses the method of a run that names s1 and s2 and needs both: s1, its proposer,
    aborts it as soon as it hears s2's reject, not at the 120 s deadline, and s2 takes that
    abort (a commit before the deadline is otherwise dropped)."""
    s1 = sites("s1")
    s2 = sites("s2", {"methods": {"allow": ["fedavg"]}})
    body = spec(members=["s1", "s2"], quorum={"min_accept": 2}, vote_deadline_s=120)
    rid = s1.ask("submit", spec=body)["run_id"]
    for site in (s1, s2):
        run = site.wait_status(rid, {"aborted"}, 60)
        assert "before the deadline, 1 of the 2 sites asked rejected it (s2)" in run["why"], run
        assert "early_commit" not in site.ask("status")["dropped"]
        assert not (site.state_dir / "runs" / rid).exists()


def test_the_proposer_dies_another_site_commits_and_a_late_site_votes(sites):
    """s1 proposes a run for s2 and s3 and is killed; s3's daemon starts only after the
    proposal (a site restarted during the vote) and votes on the retained spec; with no
    commit from s1, the first-ranked accepting site commits, and the run finishes."""
    s1 = sites("s1")
    s2 = sites("s2")
    s3 = sites("s3", start=False)
    rid = s1.ask("submit", spec=spec(members=["s2", "s3"], vote_deadline_s=8))["run_id"]
    s2.wait_status(rid, {"proposed"}, 30)
    s1.kill()
    s3.start()
    for site in (s2, s3):
        run = site.wait_status(rid, {"finished"}, 180)
        assert run["members"] == ["s2", "s3"]
    committer = json.loads((s2.state_dir / "runs" / rid / "run.json").read_text())["committer"]
    assert committer in ("s2", "s3")


def test_a_killed_worker_fails_its_run_at_that_site_only(sites):
    port = free_port()
    s1 = sites("s1")
    s2 = sites("s2")
    s3 = sites("s3", observability={"listen": f"127.0.0.1:{port}"})
    rid = s1.ask("submit", spec=spec(rounds=40))["run_id"]
    s3.wait_status(rid, {"running"}, 90)
    wait(lambda: len(s3.records(rid)) >= 1, 120, "s3's first round")
    os.kill(s3.worker_pid(rid), signal.SIGKILL)
    run = s3.wait_status(rid, {"failed"}, 60)
    assert "exited with" in run["why"]
    assert s3.proc.poll() is None  # the daemon stays up
    assert _http(f"http://127.0.0.1:{port}/readyz")[0] == 200
    for site in (s1, s2):
        assert site.wait_status(rid, {"finished"}, 240)["round"] == 40


def test_two_runs_at_once_and_a_third_waits_pending(sites):
    limits = {"max_concurrent_runs": 2}
    s1 = sites("s1", limits=limits)
    s2 = sites("s2", limits=limits)
    rids = [s1.ask("submit", spec=spec(name=f"run{i}"))["run_id"] for i in range(3)]
    pending: set[str] = set()

    def all_ended() -> bool:
        runs = s1.runs()
        if not set(rids) <= set(runs):  # a submitted spec comes back through the broker
            return False
        for rid in rids:
            if runs[rid]["status"] == "pending":
                assert "max_concurrent_runs 2" in runs[rid]["why"]
                pending.add(rid)
        running = [r for r in rids if runs[r]["status"] == "running"]
        assert len(running) <= 2
        return all(runs[r]["status"] == "finished" for r in rids)

    wait(all_ended, 300, "three runs to finish", lambda: s1.runs())
    assert pending, "the third run never waited as pending"
    wait(
        lambda: all((s2.run(rid) or {}).get("status") == "finished" for rid in rids),
        120,
        "the three runs to finish at s2",
        lambda: s2.runs(),
    )


def test_a_site_requiring_manual_approval_waits_for_its_operator(sites):
    s1 = sites("s1")
    s2 = sites("s2", {"approve": "manual"})
    rid = s1.ask("submit", spec=spec(vote_deadline_s=30))["run_id"]
    wait(
        lambda: (s2.run(rid) or {}).get("votes", {}).get("s2", {}).get("vote") == "pending",
        30,
        "s2's pending vote",
    )
    cli = p2pfl_cli("vote", rid, "--accept", "--site", str(s2.path))
    assert cli.returncode == 0, cli.stdout + cli.stderr
    wait(
        lambda: (s1.run(rid) or {}).get("votes", {}).get("s2", {}).get("vote") == "accept",
        30,
        "s2's accept",
    )


def test_drain_leaves_after_the_current_round_and_a_centralized_run_goes_on(sites):
    """s3 drains during a FedAvg run: it leaves after the round under way, the others finish.
    A round here takes 30-45 ms on a quiet machine: 200 of them outlast the drain's way (the
    test's poll, the admin socket, the daemon's 0.2 s watch, SIGTERM: s3 leaves after round
    7-15 here) with room for CI's load. A worker whose node absorbed the SIGTERM (Python
    3.11's wait_for) trained to round 200: background.stop_if_cancelled, cancel_and_wait."""
    rounds = 200
    s1, s2, s3 = sites("s1"), sites("s2"), sites("s3")
    body = spec(
        rounds=rounds,
        algorithm={"name": "fedavg", "params": {}},
        model={"name": "mlp"},
        timing={"round_timeout_s": 10, "startup_timeout_s": 30, "linger_s": 2},
    )
    rid = s1.ask("submit", spec=body)["run_id"]
    wait(lambda: len(s3.records(rid)) >= 2, 180, "s3's second round")
    s3.ask("drain")
    assert s3.proc.wait(120) == 0
    run = json.loads(
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import sqlite3,json,sys;"
                "db=sqlite3.connect(sys.argv[1]);"
                "print(json.dumps(db.execute('select status, why from runs').fetchone()))",
                str(s3.state_dir / "ledger.sqlite"),
            ],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    )
    assert run[0] == "cancelled" and run[1].startswith("drained after round"), run
    left_at = int(run[1].rsplit(" ", 1)[-1])
    assert len(s3.records(rid)) == left_at < rounds
    for site in (s1, s2):
        assert site.wait_status(rid, {"finished"}, 240)["round"] == rounds

    # every site's status as it told it (signed, retained): s1 sees s2 finish and s3 leave
    def told_statuses() -> dict:
        return {n: t["status"] for n, t in (s1.run(rid) or {}).get("sites", {}).items()}

    final = {"s1": "finished", "s2": "finished", "s3": "cancelled"}
    wait(lambda: told_statuses() == final, 60, "each site's final status at s1", told_statuses)
    told = s1.run(rid)["sites"]
    assert told["s3"]["why"] == run[1] and told["s3"]["round"] == left_at
    assert told["s1"]["metrics"]["test_acc"] == s1.records(rid)[-1]["test_acc"]
    for name in ("s1", "s2"):
        assert told[name]["round"] == rounds and told[name]["why"] == f"{rounds} rounds"
        assert 0 <= told[name]["metrics"]["test_acc"] <= 1
    shown = p2pfl_cli("runs", "--site", str(s1.path))
    assert shown.returncode == 0, shown.stderr
    lines = {ln.split(":")[0].strip(): ln for ln in shown.stdout.splitlines() if ":" in ln}
    assert "cancelled left (drained after round" in lines["s3"], shown.stdout
    assert f"finished ({rounds} rounds)  round {rounds}  acc " in lines["s2"], shown.stdout


def test_a_signed_federation_refuses_unsigned_messages(tmp_path):
    """With certs: TLS to the broker, every spec, vote and commit signed, and the run trains
    signed; an unsigned spec, even from a holder of a swarm certificate, is dropped and
    counted."""
    import asyncio

    import aiomqtt

    from p2pfl.launch.broker import BrokerTLS, MosquittoBroker
    from p2pfl.security.certs import make_swarm_certs
    from p2pfl.security.signing import tls_context
    from p2pfl.sites.consent import messages as M

    certs = tmp_path / "certs"
    make_swarm_certs(certs, "fed", ["s1", "s2", "s3"], ["127.0.0.1"])
    made: list[Site] = []
    with MosquittoBroker(workdir=tmp_path / "broker", tls=BrokerTLS(certs, None)) as broker:
        try:
            s1, s2 = (
                Site(tmp_path, name, broker.address, certs=str(certs)) for name in ("s1", "s2")
            )
            made += [s1.start(), s2.start()]
            assert s1.ask("status")["signed"]
            rid = s1.ask("submit", spec=spec())["run_id"]
            for site in (s1, s2):
                assert site.wait_status(rid, {"finished"}, 180)["members"] == ["s1", "s2"]
            topo = (s1.state_dir / "runs" / rid / "topology.yaml").read_text()
            assert "sign: true" in topo and "tls: true" in topo

            async def forge() -> None:  # s3 holds a certificate, and publishes unsigned
                s3 = M.SiteIdentity.from_certs(certs, "s3")
                bad = {"status": "finished", "why": "", "round": -1, "metrics": {}}
                async with aiomqtt.Client(
                    "127.0.0.1", broker.port, tls_context=tls_context(certs, "s3")
                ) as client:
                    for kind, run, body, identity in (
                        ("spec", "f" * 16, {"spec": {}}, None),
                        ("status", rid, bad, s3),  # signed, of a real run, malformed
                    ):
                        topic, payload = M.encode("fed", kind, run, "s3", body, identity)
                        await client.publish(topic, payload, qos=1, retain=True)

            asyncio.run(forge())
            wait(lambda: s2.ask("status")["dropped"].get("unsigned", 0) >= 1, 30, "the drop")
            wait(lambda: s2.ask("status")["dropped"].get("bad_body", 0) >= 1, 30, "bad status")
            assert "f" * 16 not in s2.runs()
            told = lambda: {n: t["status"] for n, t in s2.run(rid)["sites"].items()}  # noqa: E731
            finished = {"s1": "finished", "s2": "finished"}  # s3's malformed one is not kept
            wait(lambda: told() == finished, 30, "s1's and s2's statuses, signed", told)
        finally:
            for site in made:
                site.stop()


def test_a_site_leaves_when_its_policy_fails_at_a_round(sites):
    """Checked every round: s2 allows 2 s of training (max_hours); it leaves the run after
    the round that passes it, says why, and s1 trains on alone."""
    s1 = sites("s1")
    s2 = sites("s2", {"resources": {"max_hours": 2 / 3600}})
    rid = s1.ask("submit", spec=spec(rounds=400))["run_id"]
    run = s2.wait_status(rid, {"cancelled"}, 120)
    assert "over_time" in run["why"] and run["why"].startswith("policy at round"), run
    assert not run["why"].startswith("policy at round 0")
    assert s1.wait_status(rid, {"finished", "running"}, 60)["status"] in ("finished", "running")
    s1.ask("cancel", run_id=rid)  # its proposer stops it
    assert s1.wait_status(rid, {"cancelled"}, 30)["why"].startswith("cancelled by this site")


@pytest.mark.parametrize("vote_deadline_s", [6, 60], ids=["after_deadline", "before_deadline"])
def test_a_site_whose_state_was_reset_does_not_rejoin_an_old_run(sites, vote_deadline_s):
    """The broker keeps a finished run's spec, votes and commit. A site daemon restarted on
    an empty state_dir hears them, its own old accept among them, after the vote's deadline
    or before it: it holds no vote of its own, so it neither votes, nor commits, nor trains
    that run again."""
    import shutil

    s1, s2 = sites("s1"), sites("s2")
    rid = s1.ask("submit", spec=spec(vote_deadline_s=vote_deadline_s))["run_id"]
    s2.wait_status(rid, {"finished"}, 180)
    s2.stop()
    shutil.rmtree(s2.state_dir)
    s2.start()
    run = s2.wait_status(rid, {"aborted"}, 60)
    assert "holds no vote of its own" in run["why"]
    assert not (s2.state_dir / "runs" / rid).exists()
    assert "commits run" not in s2.log().split("stopped by signal")[-1]
