"""Helpers shared by the node integration tests: start node processes on a test broker,
wait for a node's round record, check a finished run directory."""

from __future__ import annotations

import json
import time
from pathlib import Path

from p2pfl.check.load import load_topology
from p2pfl.config.schema import dump_topology
from p2pfl.launch.swarm import spawn_worker
from p2pfl.metrics import ROUND_FIELDS, read_records

SUMMARY_FIELDS = (
    "algorithm",
    "nodes",
    "rounds",
    "wall_s",
    "bytes_sent_total",
    "final",
    "best_acc_mean",
)


def check_run_dir(
    out: Path, ids: list[str], rounds: int, *, may_skip: bool = False
) -> dict[str, list[dict]]:
    """Check a finished run directory (config, histograms, summary, one complete JSONL per
    node) and return each node's records. ``may_skip``: a node may have skipped rounds to
    catch up (asynchronous rounds on a loaded machine), so its rounds rise to the last one
    with gaps, as the summary's ``node-rounds skipped`` counts them."""
    assert (out / "config.yaml").exists()
    hists = json.loads((out / "label_histograms.json").read_text())
    assert sorted(hists) == sorted(ids)
    summary = json.loads((out / "summary.json").read_text())
    for key in SUMMARY_FIELDS:
        assert key in summary, key
    for key in ("acc_mean", "acc_min", "acc_max", "acc_std"):
        assert 0.0 <= summary["final"][key] <= 1.0
    assert summary["nodes"] == len(ids) and summary["rounds"] == rounds
    assert summary["nodes_completed"] == len(ids)
    logs = {}
    for nid in ids:
        recs = read_records(out / "nodes" / f"{nid}.jsonl")
        seen = [r["round"] for r in recs]
        if may_skip:
            assert seen == sorted(set(seen)) and seen[-1] == rounds and seen[0] >= 1, (nid, seen)
        else:
            assert seen == list(range(1, rounds + 1)), nid
        for rec in recs:
            for key in ROUND_FIELDS:
                assert key in rec, (nid, key)
        logs[nid] = recs
    assert summary["bytes_sent_total"] == sum(r["bytes_sent"] for v in logs.values() for r in v)
    return logs


def start_nodes(tmp_path: Path, broker, overrides: list[str], only: list[str] | None = None):
    """Start one node process per id of ``topologies/synthetic.yaml`` (with ``overrides``) on
    ``broker``; returns ``(config, run_dir, {node_id: process})``."""
    cfg = load_topology("topologies/synthetic.yaml", overrides)
    cfg = cfg.model_copy(
        update={"broker": cfg.broker.model_copy(update={"host": broker.host, "port": broker.port})}
    )
    out = tmp_path / "run"
    out.mkdir(exist_ok=True)
    path = out / "config.yaml"
    path.write_text(dump_topology(cfg))
    ids = only or cfg.node_ids
    workers = {nid: spawn_worker(path, [nid], broker.address, out, False) for nid in ids}
    return cfg, out, workers


def wait_round(out: Path, nid: str, round_no: int, timeout: float) -> None:
    """Wait until node ``nid`` has written its record for ``round_no`` (polls its JSONL)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        recs = read_records(out / "nodes" / f"{nid}.jsonl")
        if recs and recs[-1]["round"] >= round_no:
            return
        time.sleep(0.05)
    raise AssertionError(f"{nid} did not reach round {round_no} in {timeout} s")
