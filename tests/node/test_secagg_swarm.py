"""Secure aggregation (``privacy.secagg``) on the rotating aggregator, with node processes on
a real broker: the same FedAvg model as the plain run, a member killed after masking, the
aggregator killed mid-protocol."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from swarm_helpers import start_nodes

from p2pfl.launch.swarm import stop_workers
from p2pfl.metrics import read_records
from p2pfl.node.checkpoint import checkpoint_path, load_checkpoint
from p2pfl.privacy.secagg import tolerance

pytestmark = pytest.mark.one_broker  # the protocol is the node's: one broker is enough

NODES = [f"n{i}" for i in range(8)]
BASE = [
    "algorithm.name=fedavg",
    "algorithm.params={}",
    f"nodes=[{', '.join(NODES)}]",
    "model.name=mlp",
    "dataset.synthetic_train=800",
    "dataset.synthetic_test=200",
    "defence.rule=mean",
    "timing.round_timeout_s=10",
    "timing.aggregator_timeout_s=30",
    "timing.linger_s=3",
]
SECAGG = ["privacy.secagg=true"]


def _records(out: Path, nid: str) -> list[dict]:
    return read_records(out / "nodes" / f"{nid}.jsonl")


def _run(tmp_path: Path, broker, overrides: list[str], timeout: float = 90):
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg, out, workers = start_nodes(tmp_path, broker, [*BASE, *overrides])
    try:
        for nid in cfg.node_ids:
            assert workers[nid].proc.wait(timeout=timeout) == 0, workers[nid].log_path.read_text()
    finally:
        stop_workers(list(workers.values()), grace=2)
    return cfg, out


def _tensors(obj, prefix=""):
    """Every floating tensor of a checkpoint's method state, by path."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj} if obj.is_floating_point() else {}
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_tensors(v, f"{prefix}/{k}"))
    return out


def test_secagg_gives_the_plain_fedavg_model(tmp_path, broker):
    """8 nodes, 3 rounds, the same seed: with secure aggregation every node's final model
    equals the plain run's to within the fixed point's tolerance (the masks cancel exactly in
    Z_2^64), and so do the test accuracies; records carry the protocol's facts."""
    rounds = ["rounds=3"]
    _, plain = _run(tmp_path / "plain", broker, rounds)
    _, secure = _run(tmp_path / "secure", broker, [*rounds, *SECAGG])
    tol = 1e-5 + 100 * tolerance(len(NODES))
    for nid in NODES:
        a, b = _records(plain, nid), _records(secure, nid)
        assert [r["round"] for r in b] == [1, 2, 3]
        for ra, rb in zip(a, b, strict=True):
            assert abs(ra["test_acc"] - rb["test_acc"]) < 1e-9, (nid, ra["round"])
            assert abs(ra["test_loss"] - rb["test_loss"]) < 1e-4, (nid, ra["round"])
            assert sorted(rb["aggregated"]) == NODES
            assert rb["secagg"]["member"]["step"] == "revealed", rb["secagg"]
        ma = _tensors(load_checkpoint(checkpoint_path(plain, nid)).method)
        mb = _tensors(load_checkpoint(checkpoint_path(secure, nid)).method)
        assert ma and sorted(ma) == sorted(mb)
        for k in ma:
            assert torch.allclose(ma[k].double(), mb[k].double(), atol=tol, rtol=0), (nid, k)
    for nid in NODES:
        for rec in _records(secure, nid):
            if rec["aggregator"] == nid:
                sa = rec["secagg"]
                assert sa["masked"] == NODES and sa["dropped"] == [], sa
                assert sa["t"] == 5 and sa["k"] == 7, sa
