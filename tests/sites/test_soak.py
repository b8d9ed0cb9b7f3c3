"""A short soak of the standing federation (README.md, "A standing federation"):
``scripts/soak_federation.py`` with three real site daemons, a real Mosquitto and six
short runs back to back, five of them hit by a fault each (a daemon SIGKILLed and
restarted, a worker SIGKILLed, the serving process SIGKILLed, the broker SIGKILLed and
restarted on its port, and the broker restarted while a daemon is down). Every run ends everywhere, the ledgers agree on every commit, no
process is left behind once the daemons stop, and the state_dirs stay small. The script
waits on the daemons' admin answers, each wait bounded; about three minutes on a loaded
2-core machine."""

from __future__ import annotations

import pytest

from p2pfl.launch.broker import have_mosquitto


def test_a_short_soak_ends_every_run_everywhere_and_leaves_nothing_behind(tmp_path, load_script):
    if not have_mosquitto():
        pytest.fail("mosquitto is not installed: apt-get install -y mosquitto")
    soak = load_script("soak_federation")
    cfg = soak.SoakConfig(
        out=tmp_path / "soak",
        runs=6,
        seed=1,
        broker="mosquitto",
        fault_rate=1.0,  # runs 2 to 6: one fault of each kind
        startup_timeout_s=20.0,  # a node whose peer was killed waits this long for it
        worker_window_s=2.0,  # killed while it starts: it has not ended yet
        run_timeout_s=150.0,
        settle_timeout_s=90.0,
        max_state_mb=4.0,
        max_run_mb=1.0,
    )
    report = soak.Soak(cfg, say=print).run()
    shown = soak.table(report) + "\n\n" + "\n\n".join(report["problems"])
    print(shown)
    assert report["faults_injected"] == {k: 1 for k in soak.FAULTS}, shown
    assert not report["stuck"], shown
    assert report["ledgers_agree"], shown
    assert not report["leftovers"], shown  # nothing outlives its daemon
    assert all(not f["survivors"] for f in report["faults"]), shown
    assert report["serving"]["status"] == 200, shown  # it serves a model after its faults
    finished = [r for r in report["runs"] if set(r["status"].values()) == {"finished"}]
    assert len(finished) >= 1 and report["runs"][0] in finished, shown
    assert not report["problems"], shown
