"""Run directory layout, per-node JSONL records, the swarm summary and its plots.

``<run>/``
  ``config.yaml``            the resolved topology (after ``--set``)
  ``nodes/<id>.jsonl``       one line per round (see :data:`ROUND_FIELDS`)
  ``nodes/<id>.meta.json``   the node's data: sizes and label histograms
  ``label_histograms.json``  every node's train/test label histogram (written by the launcher)
  ``summary.json``           :func:`summarize`
  ``accuracy.png``           accuracy vs round and vs bytes sent (mean over nodes)
"""

from __future__ import annotations

import json
import math
import os
import statistics
import uuid
from pathlib import Path
from typing import Any

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
)


def node_log_path(run_dir: Path, node_id: str) -> Path:
    return Path(run_dir) / "nodes" / f"{node_id}.jsonl"


def node_meta_path(run_dir: Path, node_id: str) -> Path:
    return Path(run_dir) / "nodes" / f"{node_id}.meta.json"


def append_record(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line (flushed, so a live monitor and a crash both see it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record, separators=(",", ":")) + "\n")
        f.flush()


def write_text_atomic(path: Path, text: str) -> None:
    """Write via a uniquely named temporary file and rename: readers (and other nodes
    writing the same file at once) never see a torn file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


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
    mean per round with the cumulative bytes sent by all nodes up to it."""
    logs = read_run(run_dir)
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
                "acc_mean": statistics.fmean(by_round[r]),
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
    return {
        "algorithm": algorithm,
        "nodes": len(expected_nodes),
        "nodes_completed": len(completed),
        "nodes_incomplete": sorted(set(expected_nodes) - set(completed)),
        "rounds": rounds,
        "rounds_reached": max(by_round) if by_round else 0,
        "wall_s": wall_s,
        "bytes_sent_total": sum(rec["bytes_sent"] for recs in logs.values() for rec in recs),
        "bytes_recv_total": sum(rec["bytes_recv"] for recs in logs.values() for rec in recs),
        "dropout_rounds": sum(bool(rec.get("dropout")) for recs in logs.values() for rec in recs),
        "final": _stats(finals),
        "best_acc_mean": max((c["acc_mean"] for c in curve), default=float("nan")),
        "curve": curve,
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
