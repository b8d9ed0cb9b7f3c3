"""Run directory layout, per-node JSONL records, the swarm summary and its plots.

``<run>/``
  ``config.yaml``            the resolved topology (after ``--set``)
  ``nodes/<id>.jsonl``       one line per round (see :data:`ROUND_FIELDS`; the method's
                             own facts under :data:`METHOD_KEY`, :func:`method_facts`)
  ``nodes/<id>.meta.json``   the node's data: sizes and label histograms
  ``label_histograms.json``  every node's train/test label histogram (written by the launcher)
  ``summary.json``           :func:`summarize`
  ``accuracy.png``           accuracy vs round and vs bytes sent (mean over nodes)
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from p2pfl.files import write_bytes_atomic

log = logging.getLogger(__name__)

# a round record's fields every driver writes (p2pfl/services/bundle.py, ``round_record``;
# README.md, "Run directory")
ROUND_FIELDS = (
    "round",
    "test_acc",
    "train_loss",
    "train_s",
    "comm_s",
    "bytes_sent",
    "bytes_recv",
    "peers",
    "dropout",
    "method",
)
# everything the method returned in a round (its plan, merge, after_train, apply and
# server-rule facts) is one map under this key of the record, never beside the driver's
# fields; ``dropout`` (UA-PDFL's client-wise dropout) is also copied to the top level, where
# summaries count it. Records of older runs have the method's facts at the top level.
METHOD_KEY = "method"


def method_facts(rec: dict[str, Any]) -> dict[str, Any]:
    """What the method recorded in the round record ``rec``: its :data:`METHOD_KEY` map, or,
    for a record of an older run (without one), the record itself, whose top level held the
    method's facts then. Read a fact with ``method_facts(rec).get(name)``."""
    facts = rec.get(METHOD_KEY)
    return facts if isinstance(facts, dict) else rec


def node_log_path(run_dir: Path, node_id: str) -> Path:
    return Path(run_dir) / "nodes" / f"{node_id}.jsonl"


def node_meta_path(run_dir: Path, node_id: str) -> Path:
    return Path(run_dir) / "nodes" / f"{node_id}.meta.json"


def append_record(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line, whole or not at all: on a failed write (a full disk, an I/O
    error) the file is cut back to where it was and the ``OSError`` is raised. The line is
    flushed and fsynced, so a live monitor and a crash both see every completed record."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        start = os.fstat(fd).st_size
        try:
            view = memoryview(line)
            while view:  # os.write may write less than asked (a disk filling up)
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except OSError:
            with contextlib.suppress(OSError):  # leave no torn line behind
                os.ftruncate(fd, start)
            raise
    finally:
        os.close(fd)


class RecordLog:
    """A node's round records on disk (``nodes/<id>.jsonl``) that survive a full or failing
    disk: a record that cannot be written stays in memory (:attr:`pending`) and is written,
    in order, on the next :meth:`append` or :meth:`flush`; the failure is logged, never
    raised, so training goes on."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.pending: list[dict[str, Any]] = []
        self.failures = 0  # writes that failed so far

    def append(self, record: dict[str, Any]) -> bool:
        """Queue ``record`` and write everything queued; True when nothing is left pending."""
        self.pending.append(record)
        return self.flush()

    def flush(self) -> bool:
        """Write the queued records in order; True when none is left pending."""
        while self.pending:
            try:
                append_record(self.path, self.pending[0])
            except OSError as exc:
                self.failures += 1
                log.warning(
                    "%s: %d record(s) kept in memory, not written yet: %s",
                    self.path,
                    len(self.pending),
                    exc,
                )
                return False
            self.pending.pop(0)
        return True


def write_text_atomic(path: Path, text: str) -> None:
    """:func:`~p2pfl.files.write_bytes_atomic` of ``text`` (UTF-8)."""
    write_bytes_atomic(path, text.encode())


def write_json(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2))


def read_records(path: Path) -> list[dict[str, Any]]:
    """All complete JSON lines of a node log (a torn last line is ignored)."""
    out = []
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def read_run(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """``{node_id: [records]}`` for every ``nodes/*.jsonl`` of a run."""
    return {p.stem: read_records(p) for p in sorted((Path(run_dir) / "nodes").glob("*.jsonl"))}


def _stats(values: list[float]) -> dict[str, float]:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return {
            "acc_mean": float("nan"),
            "acc_min": float("nan"),
            "acc_max": float("nan"),
            "acc_std": float("nan"),
        }
    return {
        "acc_mean": statistics.fmean(vals),
        "acc_min": min(vals),
        "acc_max": max(vals),
        "acc_std": statistics.pstdev(vals) if len(vals) > 1 else 0.0,
    }


def _mean_of_numbers(values: list[Any]) -> float:
    """The mean of the numbers among ``values`` (a task without accuracy records None)."""
    nums = [v for v in values if isinstance(v, (int, float))]
    return statistics.fmean(nums) if nums else float("nan")


def _summarizable(rec: Any) -> bool:
    return (
        isinstance(rec, dict)
        and isinstance(rec.get("round"), int)
        and (
            isinstance(rec.get("test_acc"), (int, float))
            or (rec.get("test_acc") is None and isinstance(rec.get("test_loss"), (int, float)))
        )
        and isinstance(rec.get("bytes_sent"), int)
        and isinstance(rec.get("t"), (int, float))
    )


def summarize(
    run_dir: Path,
    *,
    algorithm: str,
    expected_nodes: list[str],
    rounds: int,
    wall_s: float | None = None,
) -> dict[str, Any]:
    """The swarm summary from the node logs.

    ``final`` is over each node's last recorded round; ``best_acc_mean`` is the best, over
    rounds, of the mean accuracy of the nodes that reported that round; ``curve`` holds that
    mean per round with the cumulative bytes sent by all nodes up to it;
    ``rounds_skipped`` counts the node-rounds nodes skipped (:func:`skipped_rounds`)."""
    # records from another version or a hand-edited file: keep what has the summary's fields
    logs = {nid: [r for r in recs if _summarizable(r)] for nid, recs in read_run(run_dir).items()}
    finals = [recs[-1]["test_acc"] for recs in logs.values() if recs]
    by_round: dict[int, list[float]] = {}
    bytes_by_round: dict[int, int] = {}
    for recs in logs.values():
        for rec in recs:
            by_round.setdefault(rec["round"], []).append(rec["test_acc"])
            bytes_by_round[rec["round"]] = bytes_by_round.get(rec["round"], 0) + rec["bytes_sent"]
    curve = []
    cum = 0
    for r in sorted(by_round):
        cum += bytes_by_round[r]
        curve.append(
            {
                "round": r,
                "acc_mean": _mean_of_numbers(by_round[r]),
                "bytes_sent": cum,
                "nodes": len(by_round[r]),
            }
        )
    if wall_s is None:
        starts = [recs[0]["t"] - recs[0].get("round_s", 0) for recs in logs.values() if recs]
        ends = [recs[-1]["t"] for recs in logs.values() if recs]
        wall_s = (max(ends) - min(starts)) if starts else 0.0
    # a node that joined late has fewer records but still reached the last round
    completed = [n for n in expected_nodes if logs.get(n) and logs[n][-1]["round"] >= rounds]
    summary = {
        "algorithm": algorithm,
        "nodes": len(expected_nodes),
        "nodes_completed": len(completed),
        "nodes_incomplete": sorted(set(expected_nodes) - set(completed)),
        "rounds": rounds,
        "rounds_reached": max(by_round) if by_round else 0,
        "wall_s": wall_s,
        "bytes_sent_total": sum(rec["bytes_sent"] for recs in logs.values() for rec in recs),
        "bytes_recv_total": sum(rec.get("bytes_recv", 0) for recs in logs.values() for rec in recs),
        "dropout_rounds": sum(bool(rec.get("dropout")) for recs in logs.values() for rec in recs),
        "final": _stats(finals),
        "best_acc_mean": max((c["acc_mean"] for c in curve), default=float("nan")),
        "curve": curve,
    }
    summary["rounds_skipped"] = skipped_rounds(logs)
    metrics = metric_summary(logs)
    if metrics:  # a task's own metrics (evaluation.metrics): other summaries are unchanged
        summary["metrics"] = metrics
    defence = defence_summary(logs)
    if defence is not None:  # a run whose defence refused or clipped a state only
        summary["defence"] = defence
    privacy = privacy_summary(logs)
    if privacy is not None:  # a run under privacy.dp only: other summaries are unchanged
        summary["epsilon"] = privacy
    return summary


TASK_FIELDS_SKIPPED = ("test_acc", "test_loss")
"""The test fields every record has; a task's other ``test_<name>`` fields are its metrics."""


def metric_summary(logs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """``{test_<metric>: {"mean", "min", "max"}}`` over each node's last record, for every
    metric of the task beyond accuracy (``evaluation.metrics``: ``test_auc``,
    ``test_c_index``…) and ``test_loss`` where the task reports no accuracy; empty for a
    run of the default task (accuracy alone)."""
    finals = [recs[-1] for recs in logs.values() if recs]
    names = sorted(
        {k for rec in finals for k in rec if k.startswith("test_") and k not in TASK_FIELDS_SKIPPED}
    )
    if names and any(rec.get("test_acc") is None for rec in finals):
        names.append("test_loss")
    out: dict[str, dict[str, float]] = {}
    for name in names:
        vals = [rec.get(name) for rec in finals]
        vals = [float(v) for v in vals if isinstance(v, (int, float)) and math.isfinite(v)]
        if vals:
            out[name] = {"mean": statistics.fmean(vals), "min": min(vals), "max": max(vals)}
    return out


def skipped_rounds(logs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The node-rounds the nodes skipped: for each node, the rounds from 1 to its last
    recorded one that it has no record of (it joined a swarm under way or caught up with
    its neighbours: docs/wire.md, "Rounds and catch-up"; it never trained them). ``total``
    over all nodes and ``per_node`` (only the nodes that skipped some). A run with a
    non-zero total trained fewer node-rounds than it was set to, by an amount that depends
    on the machine's load; rounds after a node's last record (a node that stopped early)
    count under ``nodes_incomplete``, not here."""
    per_node: dict[str, int] = {}
    for nid, recs in logs.items():
        done = {rec["round"] for rec in recs if rec["round"] >= 1}
        missing = max(done, default=0) - len(done)
        if missing > 0:
            per_node[nid] = missing
    return {"total": sum(per_node.values()), "per_node": dict(sorted(per_node.items()))}


def skipped_note(summary: dict[str, Any]) -> str | None:
    """One line naming the node-rounds a run skipped (its summary's ``rounds_skipped``), or
    None when it skipped none (or the summary, of an older run, does not say)."""
    skipped = summary.get("rounds_skipped")
    if not isinstance(skipped, dict) or not skipped.get("total"):
        return None
    per_node = skipped.get("per_node") or {}
    nodes = ", ".join(f"{nid} {n}" for nid, n in per_node.items())
    planned = summary.get("nodes", 0) * summary.get("rounds", 0)
    of = f" of {planned}" if planned else ""
    return (
        f"{skipped['total']}{of} node-rounds skipped (nodes that fell behind caught up or "
        f"joined late, untrained in those rounds; the result depends on the machine's load): "
        f"{nodes}"
    )


def defence_summary(logs: dict[str, list[dict[str, Any]]]) -> dict[str, Any] | None:
    """What the nodes refused and clipped over the run (the records' ``rejected`` and
    ``clipped``): ``refused`` (every refusal, by admission, the rule or the method),
    ``refused_peers`` (peer → how many times), ``clipped`` and ``clipped_peers`` alike;
    None when nothing was refused or clipped."""
    refused: Counter[str] = Counter()
    clipped: Counter[str] = Counter()
    for recs in logs.values():
        for rec in recs:
            for field, counts in (("rejected", refused), ("clipped", clipped)):
                value = rec.get(field)
                if isinstance(value, dict):
                    counts.update(str(p) for p in value)
    if not refused and not clipped:
        return None
    return {
        "refused": sum(refused.values()),
        "refused_peers": dict(sorted(refused.items())),
        "clipped": sum(clipped.values()),
        "clipped_peers": dict(sorted(clipped.items())),
    }


def defence_note(summary: dict[str, Any]) -> str | None:
    """One line naming the states the run's nodes refused (and clipped), or None when
    they refused none (a clipping alone is not worth a warning: the state counted)."""
    d = summary.get("defence")
    if not isinstance(d, dict) or not d.get("refused"):
        return None
    peers = ", ".join(f"{p} {n}x" for p, n in (d.get("refused_peers") or {}).items())
    line = (
        f"{d['refused']} peer states refused by the nodes' defences (the rounds went on "
        f"without them; each record's `rejected` says why): {peers}"
    )
    if d.get("clipped"):
        line += f"; {d['clipped']} pulled within the bound"
    return line


def privacy_summary(logs: dict[str, list[dict[str, Any]]]) -> dict[str, Any] | None:
    """Under ``privacy.dp``: each node's ε after its last recorded round (``per_node``),
    their ``max`` and ``mean``, and the nodes whose budget ran out (``exhausted``); None
    when no record carries ``epsilon``."""
    last: dict[str, float] = {}
    exhausted = set()
    for nid, recs in logs.items():
        for rec in recs:
            eps = rec.get("epsilon")
            if isinstance(eps, (int, float)) and not isinstance(eps, bool):
                last[nid] = float(eps)
            if rec.get("dp_exhausted") is True:
                exhausted.add(nid)
    if not last:
        return None
    return {
        "max": max(last.values()),
        "mean": statistics.fmean(last.values()),
        "per_node": dict(sorted(last.items())),
        "exhausted": sorted(exhausted),
    }


def plot_summary(summary: dict[str, Any], path: Path) -> None:
    """Accuracy vs round and accuracy vs cumulative bytes sent (mean over nodes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = summary["curve"]
    if not curve:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    rounds = [c["round"] for c in curve]
    acc = [c["acc_mean"] for c in curve]
    mb = [c["bytes_sent"] / 1e6 for c in curve]
    a.plot(rounds, acc, marker="o")
    a.set_xlabel("round")
    a.set_ylabel("mean test accuracy")
    b.plot(mb, acc, marker="o")
    b.set_xlabel("MB sent (all nodes)")
    b.set_ylabel("mean test accuracy")
    fig.suptitle(f"{summary['algorithm']} — {summary['nodes']} nodes")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
