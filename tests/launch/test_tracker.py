"""Experiment tracking (p2pfl/launch/tracker.py): the follower of a run's records, the
per-round means, the TensorBoard and MLflow trackers, and a swarm run with ``--tracker``."""

from __future__ import annotations

import json
import logging
import signal
import statistics
import time
from pathlib import Path

import pytest

from p2pfl.check.load import load_topology
from p2pfl.cli import main
from p2pfl.config.schema import dump_topology
from p2pfl.launch import tracker as tracking
from p2pfl.launch.tracker import RecordFollower, RoundMeans, TrackedRun, export_run
from p2pfl.metrics import append_record, read_run


@pytest.fixture
def restore_signals():
    """``p2pfl swarm`` turns SIGINT and SIGTERM into KeyboardInterrupt; give pytest its own
    handlers back afterwards."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def rec(rnd: int, acc: float, sent: int = 100, recv: int = 50, **extra) -> dict:
    return {"round": rnd, "test_acc": acc, "bytes_sent": sent, "bytes_recv": recv, **extra}


def uapdfl(drift: float | None) -> dict:
    """A record's method facts (its ``method`` map): one numeric, one not."""
    return {"drift": drift, "h_peers": []}


# a synthetic finished run: d caught up past round 2, c has no train_loss in round 1
RECORDS = {
    "a": [
        rec(1, 0.5, 1000, 900, train_loss=1.5, dropout=True, method=uapdfl(None), t=100.0),
        rec(2, 0.6, 200, 300, train_loss=1.0, dropout=False, method=uapdfl(0.1), t=110.0),
        rec(3, 0.7, 200, 300, train_loss=0.8, dropout=False, method=uapdfl(0.2), t=120.0),
    ],
    "b": [
        rec(1, 0.4, 1000, 800, train_loss=1.6, dropout=True, method=uapdfl(None), t=101.0),
        rec(2, 0.55, 250, 350, train_loss=1.1, dropout=False, method=uapdfl(0.3), t=111.0),
        rec(3, 0.65, 250, 350, train_loss=0.9, dropout=True, method=uapdfl(0.4), t=121.0),
    ],
    "c": [
        rec(1, 0.3, 1000, 700, dropout=False, t=102.0),
        rec(2, 0.35, 300, 400, train_loss=1.2, dropout=False, t=112.0),
        rec(3, 0.45, 300, 400, train_loss=1.0, dropout=False, t=122.0),
    ],
    "d": [
        rec(1, 0.2, 1000, 600, train_loss=2.0, dropout=False, t=103.0),
        rec(3, 0.25, 400, 500, train_loss=1.3, dropout=False, t=123.0),
    ],
}


def write_run(run_dir: Path, records: dict[str, list[dict]] = RECORDS) -> Path:
    cfg = load_topology("topologies/synthetic.yaml", ["rounds=3"])
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_topology(cfg))
    for nid, recs in records.items():
        for r in recs:
            append_record(run_dir / "nodes" / f"{nid}.jsonl", r)
    return run_dir


def numeric(r: dict) -> dict[str, float]:
    """The numeric fields of ``r``, and its method's numeric facts as ``method.<fact>``."""
    fields = [*r.items(), *((f"method.{k}", v) for k, v in r.get("method", {}).items())]
    return {
        k: float(v)
        for k, v in fields
        if k not in ("round", "t") and isinstance(v, (int, float)) and v is not None
    }


def expected_scalars(logs: dict[str, list[dict]]) -> dict[str, dict[int, float]]:
    """Every tag the trackers should write for ``logs``, computed here from the records."""
    out: dict[str, dict[int, float]] = {}
    by_round: dict[int, list[dict[str, float]]] = {}
    for nid, recs in logs.items():
        for r in recs:
            for k, v in numeric(r).items():
                out.setdefault(f"node/{nid}/{k}", {})[r["round"]] = v
            by_round.setdefault(r["round"], []).append(numeric(r))
    cum = 0.0
    for rnd in sorted(by_round):
        ms = by_round[rnd]
        for key in {k for m in ms for k in m}:
            out.setdefault(f"mean/{key}", {})[rnd] = statistics.fmean(
                m[key] for m in ms if key in m
            )
        traffic = [m["bytes_sent"] + m["bytes_recv"] for m in ms]
        out.setdefault("mean/bytes_per_round", {})[rnd] = statistics.fmean(traffic)
        out.setdefault("swarm/nodes", {})[rnd] = len(ms)
        cum += sum(m["bytes_sent"] for m in ms)
        out.setdefault("swarm/bytes_sent_total", {})[rnd] = cum
    return out


def read_tensorboard(logdir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    out: dict[str, dict[int, float]] = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        steps = [e.step for e in events]
        assert len(steps) == len(set(steps)), f"{tag}: a step written twice: {steps}"
        out[tag] = {e.step: e.value for e in events}
    return out


def assert_scalars_match(got: dict[str, dict[int, float]], want: dict[str, dict[int, float]]):
    assert sorted(got) == sorted(want)
    for tag, steps in want.items():
        assert sorted(got[tag]) == sorted(steps), tag
        for step, value in steps.items():
            # TensorBoard keeps float32
            assert got[tag][step] == pytest.approx(value, rel=1e-6), (tag, step)


class ListTracker:
    """A tracker that keeps what it is given."""

    name = "list"

    def __init__(self):
        self.params = None
        self.logged: list[tuple[int, dict[str, float], float | None]] = []
        self.status = None

    def start(self, params):
        self.params = params

    def log(self, step, metrics, wall_time):
        self.logged.append((step, dict(metrics), wall_time))

    def flush(self):
        pass

    def close(self, status="FINISHED"):
        self.status = status

    def where(self):
        return "a list"

    def means(self) -> dict[int, dict[str, float]]:
        return {s: m for s, m, _ in self.logged if "swarm/nodes" in m}


# ----------------------------------------------------------------------------- follower


def test_follower_reads_only_new_complete_lines(tmp_path):
    path = tmp_path / "nodes" / "a.jsonl"
    path.parent.mkdir()
    follower = RecordFollower(tmp_path)
    assert follower.poll() == []
    line2 = json.dumps(rec(2, 0.6))
    path.write_text(json.dumps(rec(1, 0.5)) + "\n" + line2[:10])  # round 2 half written
    assert follower.poll() == [("a", rec(1, 0.5))]
    assert follower.poll() == []
    with open(path, "a") as f:
        f.write(line2[10:])  # whole now, but no newline yet
    assert follower.poll() == []
    with open(path, "a") as f:
        f.write("\n" + json.dumps(rec(3, 0.7)) + "\n")
    assert follower.poll() == [("a", rec(2, 0.6)), ("a", rec(3, 0.7))]
    append_record(tmp_path / "nodes" / "b.jsonl", rec(1, 0.4))  # a node that starts late
    assert follower.poll() == [("b", rec(1, 0.4))]
    assert follower.poll() == []


def test_follower_skips_malformed_lines_with_a_warning(tmp_path, caplog):
    path = tmp_path / "nodes" / "a.jsonl"
    path.parent.mkdir()
    lines = [json.dumps(rec(1, 0.5)), "{torn", "[1, 2]", '{"round": "2"}', json.dumps(rec(2, 0.6))]
    path.write_text("\n".join(lines) + "\n")
    follower = RecordFollower(tmp_path)
    with caplog.at_level(logging.WARNING, logger="p2pfl.launch.tracker"):
        assert follower.poll() == [("a", rec(1, 0.5)), ("a", rec(2, 0.6))]
    assert follower.skipped == 3
    # the tracker's warnings only: an earlier test's garbage (an asyncio future collected
    # now) may log here too
    assert [f"{path}:{n}: not a round record, skipped" for n in (2, 3, 4)] == [
        r.getMessage() for r in caplog.records if r.name == "p2pfl.launch.tracker"
    ]


def test_follower_reads_a_file_that_shrank_from_its_start(tmp_path):
    path = tmp_path / "nodes" / "a.jsonl"
    for r in (rec(1, 0.5), rec(2, 0.6)):
        append_record(path, r)
    follower = RecordFollower(tmp_path)
    assert len(follower.poll()) == 2
    path.unlink()  # a new run into the same directory
    append_record(path, rec(1, 0.9))
    assert follower.poll() == [("a", rec(1, 0.9))]


# ----------------------------------------------------------------------------- means


def test_a_round_mean_waits_for_every_running_node_and_covers_those_that_reported():
    means = RoundMeans()
    means.add("a", rec(1, 0.5, 100, 10, train_loss=1.0, t=5.0))
    means.add("b", rec(1, 0.3, 300, 30, t=7.0))  # no train_loss
    assert means.ready(["a", "b", "c"]) == []  # c runs and has not reported round 1
    (rnd, m, wall), *more = means.ready(["a", "b", "c"], live={"a", "b"})  # c has exited
    assert (rnd, wall, more) == (1, 7.0, [])
    assert m == {
        "mean/test_acc": pytest.approx(0.4),
        "mean/bytes_sent": 200.0,
        "mean/bytes_recv": 20.0,
        "mean/train_loss": 1.0,  # over the node that has it
        "mean/bytes_per_round": 220.0,
        "swarm/nodes": 2.0,
        "swarm/bytes_sent_total": 400.0,
    }
    assert means.ready(["a", "b", "c"], live={"a", "b"}) == []  # each round once

    means.add("a", rec(2, 0.6, 10, 1))
    means.add("b", rec(3, 0.7, 20, 2))  # b caught up past round 2
    assert means.ready(["a", "b"]) == [
        (
            2,
            {
                "mean/test_acc": 0.6,
                "mean/bytes_sent": 10.0,
                "mean/bytes_recv": 1.0,
                "mean/bytes_per_round": 11.0,
                "swarm/nodes": 1.0,
                "swarm/bytes_sent_total": 410.0,
            },
            None,
        )
    ]
    assert not means.add("b", rec(2, 0.9))  # late: its round's means are written
    [(rnd, m, _)] = means.rest()  # the end: round 3 though a never reported it
    assert rnd == 3 and m["swarm/nodes"] == 1.0 and m["swarm/bytes_sent_total"] == 430.0
    assert means.rest() == []


def test_a_tracked_run_logs_records_as_they_come_and_means_when_complete(tmp_path):
    cfg = load_topology("topologies/synthetic.yaml", ["rounds=2"])  # nodes a, b, c, d
    tracker = ListTracker()
    live = {"a", "b", "c", "d"}
    run = TrackedRun(tracker, cfg, tmp_path).start()
    run._live = lambda: live
    assert tracker.params["method"] == "uapdfl" and tracker.params["nodes"] == "4"
    assert tracker.params["rounds"] == "2" and tracker.params["seed"] == "0"
    for nid in "abc":
        append_record(tmp_path / "nodes" / f"{nid}.jsonl", rec(1, 0.5, t=1.0))
    assert run.poll() > 0
    assert [s for s, _, _ in tracker.logged] == [1, 1, 1] and tracker.means() == {}
    live.discard("d")  # d died before its first round
    run.poll()
    assert tracker.means()[1]["swarm/nodes"] == 3.0
    append_record(tmp_path / "nodes" / "a.jsonl", rec(2, 0.7, t=2.0))
    run.poll()
    assert 2 not in tracker.means()  # b and c still run round 2
    run.finish(130)
    assert tracker.means()[2]["mean/test_acc"] == 0.7 and tracker.status == "KILLED"


def test_following_polls_in_a_background_thread(tmp_path):
    cfg = load_topology("topologies/synthetic.yaml", ["rounds=1"])
    tracker = ListTracker()
    run = TrackedRun(tracker, cfg, tmp_path)
    run.follow(lambda: {"a"}, interval=0.05)  # the other nodes have exited
    append_record(tmp_path / "nodes" / "a.jsonl", rec(1, 0.5))
    deadline = time.monotonic() + 10
    while 1 not in tracker.means():
        assert time.monotonic() < deadline, "the thread logged nothing"
        time.sleep(0.05)
    run.finish()
    assert not run._thread.is_alive() and tracker.status == "FINISHED"
    assert len(tracker.logged) == 2  # a's record and the mean, each once


def test_a_tracker_that_fails_does_not_fail_the_run(tmp_path):
    class Broken(ListTracker):
        def log(self, step, metrics, wall_time):
            raise OSError("disk full")

    write_run(tmp_path)
    cfg = load_topology(tmp_path / "config.yaml")
    run = TrackedRun(Broken(), cfg, tmp_path).start()
    assert run.poll() == 0 and run.failed
    run.finish(0)
    assert run.tracker.status == "FAILED"


# ----------------------------------------------------------------------------- trackers


def test_tensorboard_export_writes_every_scalar(tmp_path, capsys):
    pytest.importorskip("tensorboard", reason="the tensorboard extra (in dev) is not installed")
    run_dir = write_run(tmp_path / "run")
    assert main(["track", str(run_dir), "--tracker", "tensorboard"]) == 0
    assert f"tensorboard --logdir {run_dir / 'tensorboard'}" in capsys.readouterr().err
    got = read_tensorboard(run_dir / "tensorboard")
    want = expected_scalars(RECORDS)
    assert_scalars_match(got, want)
    # spot checks of the contract, beside the computed expectation
    assert got["mean/test_acc"][2] == pytest.approx((0.6 + 0.55 + 0.35) / 3)  # d skipped 2
    assert got["mean/train_loss"][1] == pytest.approx((1.5 + 1.6 + 2.0) / 3)  # c has none
    assert got["mean/dropout"][3] == pytest.approx(0.25)
    assert sorted(got["node/a/method.drift"]) == [2, 3]  # the method's fact; null in round 1
    assert got["swarm/bytes_sent_total"][3] == 4000 + 750 + 1150
    # exporting again replaces the event files instead of adding a second copy
    assert main(["track", str(run_dir), "--tracker", "tensorboard"]) == 0
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1
    assert_scalars_match(read_tensorboard(run_dir / "tensorboard"), want)


@pytest.mark.parametrize("name", ["tensorboard", "mlflow"])
def test_a_missing_extra_fails_before_anything_starts(
    tmp_path, capsys, monkeypatch, restore_signals, name
):
    real = tracking.importlib.util.find_spec
    monkeypatch.setattr(
        tracking.importlib.util, "find_spec", lambda mod, *a: None if mod == name else real(mod)
    )
    out = tmp_path / "run"
    args = ["swarm", "topologies/synthetic.yaml", "--out", str(out), "--no-progress"]
    assert main([*args, "--tracker", name]) == 2
    err = capsys.readouterr().err
    assert f"pip install 'p2pfl[{name}]'" in err, err
    assert "Traceback" not in err
    assert not out.exists()  # no broker, no node, not even the run directory


def test_mlflow_export_logs_one_run_with_params_and_metrics(tmp_path, monkeypatch, capsys):
    pytest.importorskip(
        "mlflow", reason="the mlflow extra is not installed (pip install 'p2pfl[mlflow]')"
    )
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = write_run(tmp_path / "run")
    tracked = export_run(run_dir, "mlflow")
    uri = f"sqlite:///{(run_dir / 'mlflow.db').absolute()}"
    assert tracked.tracker.uri == uri and not tracked.failed
    client = MlflowClient(tracking_uri=uri)
    [exp] = [e for e in client.search_experiments() if e.name == "synthetic"]
    [run] = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["method"] == "uapdfl" and run.data.params["nodes"] == "4"
    assert run.data.params["rounds"] == "3" and run.data.params["seed"] == "0"
    want = expected_scalars(RECORDS)
    assert set(run.data.metrics) == set(want)
    for tag, steps in want.items():
        got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, tag)}
        assert got == pytest.approx(steps), tag
    assert not (Path.cwd() / "mlartifacts").exists()

    # MLFLOW_TRACKING_URI, when set, is where the run goes (here a file store, quicker to
    # create than a database, which MLflow 3 takes only with MLFLOW_ALLOW_FILE_STORE)
    elsewhere = (tmp_path / "elsewhere").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", elsewhere)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    tracked = export_run(run_dir, "mlflow")
    runs = MlflowClient(tracking_uri=elsewhere).search_runs(
        [MlflowClient(tracking_uri=elsewhere).get_experiment_by_name("synthetic").experiment_id]
    )
    assert [r.info.run_id for r in runs] == [tracked.tracker.run_id]


# ----------------------------------------------------------------------------- a swarm


@pytest.mark.integration
def test_a_swarm_with_the_tensorboard_tracker(tmp_path, capsys, restore_signals):
    pytest.importorskip("tensorboard", reason="the tensorboard extra (in dev) is not installed")
    out = tmp_path / "run"
    args = ["swarm", "topologies/synthetic.yaml", "--rounds", "2", "--out", str(out)]
    assert main([*args, "--no-progress", "--tracker", "tensorboard"]) == 0
    assert f"tensorboard --logdir {out / 'tensorboard'}" in capsys.readouterr().err
    logs = read_run(out)
    assert sorted(logs) == ["a", "b", "c", "d"]
    assert all([r["round"] for r in recs] == [1, 2] for recs in logs.values())
    got = read_tensorboard(out / "tensorboard")
    assert_scalars_match(got, expected_scalars(logs))
    for tag in ("mean/test_acc", "mean/bytes_per_round", "mean/round_s", "node/c/test_acc"):
        assert sorted(got[tag]) == [1, 2], tag
    curve = json.loads((out / "summary.json").read_text())["curve"]
    for point in curve:  # the same numbers as the run's summary
        assert got["mean/test_acc"][point["round"]] == pytest.approx(point["acc_mean"], rel=1e-6)
        assert got["swarm/bytes_sent_total"][point["round"]] == pytest.approx(
            point["bytes_sent"], rel=1e-6
        )
