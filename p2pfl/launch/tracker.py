"""Experiment tracking: a run's round records, fed to TensorBoard or MLflow.

The run directory's records (``nodes/<id>.jsonl``, :mod:`p2pfl.metrics`) are the single
source of truth: a tracker is a sink fed from them, never from a node, so it works the same
for every method and for nodes in other processes, and a finished run can be exported after
the fact (``p2pfl track RUN_DIR --tracker NAME``). ``p2pfl swarm --tracker NAME`` follows the
records while the swarm runs (a thread polling every second) and flushes at the end.

What is logged, with step = round and the record's wall time (``t``):

- ``node/<id>/<field>``: every numeric field of a node's record (``round`` and ``t`` aside;
  a boolean as 0/1, e.g. ``dropout``; a missing, ``null`` or non-finite field is skipped),
  and as ``node/<id>/method.<fact>`` every numeric fact of the method's under the record's
  ``method`` map (e.g. ``method.density``, ``method.agg_high_fraction``);
- ``mean/<field>``: the mean of that field over the nodes that reported the round (and have
  the field); ``mean/bytes_per_round``: the mean of ``bytes_sent + bytes_recv`` (one node's
  traffic in the round);
- ``swarm/nodes``: how many nodes reported the round; ``swarm/bytes_sent_total``: the bytes
  sent by all nodes up to and including the round (``summary.json``'s ``curve``).

A round's means are written once, when every node that is still running has reported that
round or a later one (a node that caught up past a round never reports it), and at the end
for the rounds left. A record that arrives for a round whose means are written already is
logged for its node only.

Trackers (optional extras; a missing one is a :class:`TrackerError` when the tracker is
made, before any node starts):

- ``tensorboard`` (``pip install 'p2pfl[tensorboard]'``): event files in
  ``RUN_DIR/tensorboard/``, written with tensorboard's own event writer (no torch); the event
  files of an earlier run into the same directory are replaced.
- ``mlflow`` (``pip install 'p2pfl[mlflow]'``): one MLflow run per swarm run in the
  experiment named after the swarm, with the configuration's method, rounds, nodes, seed,
  dataset, partition, model and ``algorithm.<knob>`` as params; the tracking URI is
  ``MLFLOW_TRACKING_URI`` when set, else a SQLite store ``RUN_DIR/mlflow.db``.

Once started, a tracker never fails a run: an error while logging is reported and the swarm
goes on.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any, Protocol

from rich.markup import escape

from p2pfl.config.schema import TopologyConfig
from p2pfl.errors import P2PFLError
from p2pfl.metrics import METHOD_KEY

log = logging.getLogger(__name__)

TRACKERS = ("tensorboard", "mlflow")
SKIPPED_FIELDS = ("round", "t")
TB_DIR = "tensorboard"
MLFLOW_DB = "mlflow.db"
MLFLOW_ARTIFACTS = "mlartifacts"


class TrackerError(P2PFLError, RuntimeError):
    """A tracker that cannot be used: its optional extra is not installed, or it could not
    start (an MLflow tracking server out of reach)."""


# ----------------------------------------------------------------------------- records


class RecordFollower:
    """Reads a run's ``nodes/*.jsonl`` incrementally: each :meth:`poll` returns the records
    completed since the previous one, in file order per node.

    A partial last line (a record being written) waits for its newline; a complete line
    that is not a JSON object with an integer ``round`` is skipped with a warning; a file
    that shrank (a new run into the same directory) is read again from its start; a file
    that cannot be read is tried again at the next poll."""

    def __init__(self, run_dir: Path):
        self.nodes_dir = Path(run_dir) / "nodes"
        self._offset: dict[Path, int] = {}  # bytes consumed: up to the last complete line
        self._lineno: dict[Path, int] = {}  # lines consumed, for the messages
        self.skipped = 0  # malformed lines seen so far

    def poll(self) -> list[tuple[str, dict[str, Any]]]:
        """``[(node_id, record)]`` completed since the last poll."""
        out: list[tuple[str, dict[str, Any]]] = []
        for path in sorted(self.nodes_dir.glob("*.jsonl")):
            out.extend((path.stem, rec) for rec in self._read(path))
        return out

    def _read(self, path: Path) -> Iterator[dict[str, Any]]:
        offset = self._offset.get(path, 0)
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size < offset:
                    log.info("%s shrank: reading it again from the start", path)
                    offset = 0
                    self._lineno[path] = 0
                f.seek(offset)
                data = f.read()
        except OSError as exc:
            log.debug("%s: not read this time: %s", path, exc)
            return
        end = data.rfind(b"\n") + 1  # complete lines only; a partial one waits
        self._offset[path] = offset + end
        for line in data[:end].splitlines():
            self._lineno[path] = lineno = self._lineno.get(path, 0) + 1
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:  # JSONDecodeError and UnicodeDecodeError
                rec = None
            rnd = rec.get("round") if isinstance(rec, dict) else None
            if not isinstance(rnd, int) or isinstance(rnd, bool):
                self.skipped += 1
                log.warning("%s:%d: not a round record, skipped", path, lineno)
                continue
            yield rec


def record_metrics(rec: dict[str, Any]) -> dict[str, float]:
    """The numeric fields of a record as floats, and the numeric facts of its ``method``
    map as ``method.<fact>`` (see the module's docstring)."""
    out = {}
    facts = rec.get(METHOD_KEY)
    method = facts.items() if isinstance(facts, dict) else ()
    fields = [(k, v) for k, v in rec.items() if k not in SKIPPED_FIELDS]
    for key, value in [*fields, *((f"{METHOD_KEY}.{k}", v) for k, v in method)]:
        if not isinstance(value, (int, float)):
            continue
        value = float(value)
        if math.isfinite(value):
            out[key] = value
    return out


class RoundMeans:
    """The swarm's per-round metrics (``mean/...``, ``swarm/...``) from the nodes' records.

    :meth:`add` each record as it comes; :meth:`ready` returns the rounds that every running
    node has passed, in order, each once; :meth:`rest` the rounds still open (at the end)."""

    def __init__(self) -> None:
        self._open: dict[int, dict[str, dict[str, float]]] = {}  # round -> node -> metrics
        self._wall: dict[int, float] = {}  # round -> latest record time
        self.latest: dict[str, int] = {}  # node -> the highest round it reported
        self.done_through = 0  # the highest round whose means are written
        self.bytes_sent_total = 0.0

    def add(self, node: str, rec: dict[str, Any]) -> bool:
        """Take ``rec`` (with an integer ``round``) of ``node``; False when its round's means
        are written already (the record then counts for its node only)."""
        rnd = rec["round"]
        self.latest[node] = max(self.latest.get(node, 0), rnd)
        if rnd <= self.done_through:
            log.debug("%s: round %d arrived after its means were written", node, rnd)
            return False
        self._open.setdefault(rnd, {})[node] = record_metrics(rec)  # a repeat: the latest
        t = rec.get("t")
        if isinstance(t, (int, float)) and math.isfinite(t):
            self._wall[rnd] = max(self._wall.get(rnd, t), t)
        return True

    def ready(
        self, expected: Collection[str], live: Collection[str] | None = None
    ) -> list[tuple[int, dict[str, float], float | None]]:
        """``[(round, metrics, wall time)]`` for the open rounds that every node of
        ``expected`` still running (in ``live``; all of them when ``live`` is None) has
        reported or passed; a node that exited does not hold a round back."""
        waiting = [n for n in expected if live is None or n in live]
        out = []
        for rnd in sorted(self._open):
            if any(self.latest.get(n, 0) < rnd for n in waiting):
                break  # a later round is not complete either
            out.append(self._close(rnd))
        return out

    def rest(self) -> list[tuple[int, dict[str, float], float | None]]:
        """Every round still open, in order (the end of a run)."""
        return [self._close(rnd) for rnd in sorted(self._open)]

    def _close(self, rnd: int) -> tuple[int, dict[str, float], float | None]:
        by_node = self._open.pop(rnd)
        sums: dict[str, list[float]] = {}
        for metrics in by_node.values():
            for key, value in metrics.items():
                sums.setdefault(key, []).append(value)
        out = {f"mean/{key}": sum(vals) / len(vals) for key, vals in sums.items()}
        traffic = [
            m["bytes_sent"] + m["bytes_recv"]
            for m in by_node.values()
            if "bytes_sent" in m and "bytes_recv" in m
        ]
        if traffic:
            out["mean/bytes_per_round"] = sum(traffic) / len(traffic)
        self.bytes_sent_total += sum(sums.get("bytes_sent", []))
        out["swarm/nodes"] = float(len(by_node))
        out["swarm/bytes_sent_total"] = self.bytes_sent_total
        self.done_through = max(self.done_through, rnd)
        return rnd, out, self._wall.pop(rnd, None)


# ----------------------------------------------------------------------------- trackers


class Tracker(Protocol):
    """A sink of scalars: :meth:`start` once, :meth:`log` per step, :meth:`close` once."""

    name: str

    def start(self, params: dict[str, str]) -> None:
        """Open the sink (files, an MLflow run) and record the run's ``params``."""

    def log(self, step: int, metrics: dict[str, float], wall_time: float | None) -> None:
        """Record ``metrics`` (tag → value) at ``step`` (the round); ``wall_time`` in
        seconds since the epoch, now when None."""

    def flush(self) -> None:
        """Make what was logged visible to readers."""

    def close(self, status: str = "FINISHED") -> None:
        """Flush and close; ``status``: FINISHED, FAILED or KILLED."""

    def where(self) -> str:
        """Where the metrics are and how to look at them, for the user."""


def _require(module: str, extra: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise TrackerError(
            f"--tracker {extra} needs the {module} package: pip install 'p2pfl[{extra}]'"
        )


class TensorBoardTracker:
    """TensorBoard event files in ``RUN_DIR/tensorboard/`` (``tensorboard --logdir``)."""

    name = "tensorboard"

    def __init__(self, run_dir: Path):
        _require("tensorboard", "tensorboard")
        self.logdir = Path(run_dir) / TB_DIR
        self._writer: Any = None

    def start(self, params: dict[str, str]) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.logdir.mkdir(parents=True, exist_ok=True)
        for old in self.logdir.glob("events.out.tfevents.*"):  # an earlier run's
            old.unlink()
        self._writer = EventFileWriter(str(self.logdir))

    def log(self, step: int, metrics: dict[str, float], wall_time: float | None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=tag, simple_value=v) for tag, v in metrics.items()]
        event = Event(wall_time=wall_time or time.time(), step=step, summary=Summary(value=values))
        self._writer.add_event(event)

    def flush(self) -> None:
        self._writer.flush()

    def close(self, status: str = "FINISHED") -> None:
        self._writer.close()

    def where(self) -> str:
        return f"tensorboard --logdir {self.logdir}"


class MLflowTracker:
    """One MLflow run per swarm run (named after the run directory), in the experiment
    ``experiment``. The tracking URI is ``MLFLOW_TRACKING_URI`` when set, else a SQLite
    store ``RUN_DIR/mlflow.db`` (artifacts, if any, in ``RUN_DIR/mlartifacts``): MLflow 3
    refuses a file store (``mlruns/``) unless ``MLFLOW_ALLOW_FILE_STORE`` is set."""

    name = "mlflow"

    def __init__(self, run_dir: Path, experiment: str):
        _require("mlflow", "mlflow")
        self.run_dir = Path(run_dir).absolute()
        self.experiment = experiment
        self.env_uri = os.environ.get("MLFLOW_TRACKING_URI")
        self.uri = self.env_uri or f"sqlite:///{self.run_dir / MLFLOW_DB}"
        self.run_id: str | None = None
        self._client: Any = None

    def start(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        try:
            client = MlflowClient(tracking_uri=self.uri)
            exp = client.get_experiment_by_name(self.experiment)
            if exp is not None:
                exp_id = exp.experiment_id
            else:  # in a store of its own, the artifacts stay in the run directory too
                where = None if self.env_uri else (self.run_dir / MLFLOW_ARTIFACTS).as_uri()
                exp_id = client.create_experiment(self.experiment, artifact_location=where)
            run = client.create_run(
                exp_id, run_name=self.run_dir.name, tags={"p2pfl.run_dir": str(self.run_dir)}
            )
            client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in params.items()])
        except Exception as exc:  # a server out of reach, a store it cannot write
            raise TrackerError(f"MLflow at {self.uri}: {exc}") from exc
        self._client, self.run_id = client, run.info.run_id

    def log(self, step: int, metrics: dict[str, float], wall_time: float | None) -> None:
        from mlflow.entities import Metric

        ms = int((wall_time or time.time()) * 1000)
        batch = [Metric(key, value, ms, step) for key, value in metrics.items()]
        for i in range(0, len(batch), 1000):  # MLflow's limit per batch
            self._client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def flush(self) -> None:
        pass  # every batch is written when logged

    def close(self, status: str = "FINISHED") -> None:
        self._client.set_terminated(self.run_id, status)

    def where(self) -> str:
        if self.env_uri:
            return (
                f"MLflow at {self.uri}, experiment {self.experiment!r}, run {self.run_dir.name!r}"
            )
        return f"mlflow ui --backend-store-uri {self.uri}"


def make_tracker(name: str, run_dir: Path, cfg: TopologyConfig) -> Tracker:
    """The tracker called ``name`` (one of :data:`TRACKERS`) for ``run_dir``; raises
    :class:`TrackerError` naming the pip extra when its package is not installed."""
    if name == "tensorboard":
        return TensorBoardTracker(run_dir)
    if name == "mlflow":
        return MLflowTracker(run_dir, cfg.name)
    raise TrackerError(f"unknown tracker {name!r}: one of {', '.join(TRACKERS)}")


def run_params(cfg: TopologyConfig) -> dict[str, str]:
    """A run's parameters for a tracker: what tells runs apart."""
    params = {
        "swarm": cfg.name,
        "method": cfg.algorithm.name,
        "rounds": cfg.rounds,
        "nodes": len(cfg.node_ids),
        "seed": cfg.seed,
        "dataset": cfg.dataset.name,
        "partition": cfg.dataset.partition,
        "model": cfg.model.name,
    }
    params.update({f"algorithm.{k}": v for k, v in sorted(cfg.algorithm.params.items())})
    return {k: str(v) for k, v in params.items()}


# ----------------------------------------------------------------------------- a tracked run


def _status(code: int) -> str:
    return "FINISHED" if code == 0 else ("KILLED" if code == 130 else "FAILED")


class TrackedRun:
    """A run's records fed to a tracker: :meth:`follow` while the nodes run (a background
    thread that starts the tracker, then polls every ``interval`` seconds, so a slow start,
    such as MLflow creating its database, does not hold the swarm back), :meth:`finish` at
    the end (the records left, the means of the rounds left, then the tracker closed). With
    no tracker every method does nothing. Once the run is under way, an error of the
    tracker is reported (once) and tracking stops; it is never raised."""

    def __init__(
        self,
        tracker: Tracker | None,
        cfg: TopologyConfig,
        run_dir: Path,
        console: Any = None,
    ):
        self.tracker = tracker
        self.expected = list(cfg.node_ids)
        self.params = run_params(cfg)
        self.follower = RecordFollower(run_dir)
        self.means = RoundMeans()
        self.console = console
        self.started = False
        self.failed = False  # the tracker raised: reported, and nothing more is logged
        self._live: Callable[[], Collection[str] | None] = lambda: None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> TrackedRun:
        """Start the tracker now (raises :class:`TrackerError` when it cannot start)."""
        with self._lock:
            if self.tracker is not None and not self.started and not self.failed:
                self.tracker.start(self.params)
                self.started = True
        return self

    def follow(
        self, live: Callable[[], Collection[str] | None] | None = None, interval: float = 1.0
    ) -> None:
        """Start the tracker and poll, in a background thread, every ``interval`` seconds;
        ``live()`` gives the ids of the nodes still running (None: all of them), whose
        rounds hold a mean back."""
        if self.tracker is None or self._thread is not None:
            return
        self._live = live or (lambda: None)
        self._thread = threading.Thread(
            target=self._loop, args=(interval,), name="p2pfl-tracker", daemon=True
        )
        self._thread.start()

    def _loop(self, interval: float) -> None:
        try:
            self.start()
        except Exception as exc:
            self._failed(exc)
            return
        while not self._stop.wait(interval):
            self.poll()

    def poll(self, final: bool = False) -> int:
        """Log the records completed since the last poll and the means of the rounds now
        complete (every round left, when ``final``); returns how many scalars it logged."""
        with self._lock:
            if not self.started or self.failed:
                return 0
            try:
                # who is running is asked before the files are read: a node that writes
                # its last record and exits in between is then still waited for
                live = None if final else self._live()
                steps = []
                for node, rec in self.follower.poll():
                    self.means.add(node, rec)
                    metrics = {f"node/{node}/{k}": v for k, v in record_metrics(rec).items()}
                    steps.append((rec["round"], metrics, rec.get("t")))
                rounds = self.means.rest() if final else self.means.ready(self.expected, live)
                steps.extend(rounds)
                for step, metrics, wall in steps:
                    if metrics:
                        self.tracker.log(step, metrics, wall)
                if steps:
                    self.tracker.flush()
                return sum(len(m) for _, m, _ in steps)
            except Exception as exc:  # a tracker never fails a run
                self._failed(exc)
                return 0

    def finish(self, code: int = 0, wait_s: float = 120.0) -> None:
        """Stop following, log what is left and close the tracker (status from the exit
        ``code``: 0 FINISHED, 130 KILLED, else FAILED). Waits up to ``wait_s`` for a
        tracker still starting or logging."""
        if self.tracker is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=wait_s)
            if self._thread.is_alive():
                self._say(f"[red]tracking ({self.tracker.name}): no answer in {wait_s:.0f} s[/]")
                return
        self.poll(final=True)
        if not self.started:
            return
        try:
            self.tracker.close("FAILED" if self.failed else _status(code))
        except Exception as exc:
            self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        if not self.failed:
            self._say(f"[red]tracking ({self.tracker.name}) failed: {escape(str(exc))}[/]")
            log.debug("tracking failed", exc_info=exc)
        self.failed = True

    def _say(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text, highlight=False, soft_wrap=True)
        else:
            log.info("%s", text)


def open_tracking(
    name: str | None, cfg: TopologyConfig, run_dir: Path, console: Any = None
) -> TrackedRun:
    """The launcher's tracking of a run: with ``name`` None, one that does nothing; else
    the tracker made now, before any node starts (a missing extra is a
    :class:`TrackerError` here), and started by :meth:`TrackedRun.follow`."""
    tracker = make_tracker(name, run_dir, cfg) if name else None
    run = TrackedRun(tracker, cfg, run_dir, console)
    if tracker is not None:
        run._say(f"[bold]tracking[/] {tracker.name}: {escape(tracker.where())}")
    return run


def export_run(run_dir: Path, name: str, console: Any = None) -> TrackedRun:
    """Feed a finished run directory's records to the tracker ``name`` (``p2pfl track``):
    its ``config.yaml`` gives the nodes and the params. Raises :class:`TrackerError` when
    the tracker cannot start. Returns the finished tracking."""
    from p2pfl.check.load import load_topology

    run_dir = Path(run_dir)
    cfg = load_topology(run_dir / "config.yaml")
    tracking = open_tracking(name, cfg, run_dir, console)
    tracking.start()
    tracking.finish()
    return tracking
