"""Replay a decentralized swarm in one process, round by round, without a broker.

A research tool for a method's decision rules (UA-PDFL's default divergence rule was chosen
with it: README.md, "UA-PDFL's divergence rule"): the same data shards, initial model, peer
draws, merges and training as the node daemon, in the same order of random draws, so a
healthy swarm's accuracies come out to the last digit (``quick``'s UA-PDFL with the fixed
``th_I`` 0.1: 87.35 both ways) in a fraction of the time (no processes, no broker, no
serialisation). Every node hears every drawn peer; nothing fails, nothing is late: faults and
timing need the real swarm (``p2pfl swarm``). One timing effect remains: in the last round the
daemon leaves neighbours that already finished (presence ``done``) out of its draw, so that
round may draw other peers than the replay.

    python scripts/replay_decentralized.py topologies/uapdfl-fmnist.yaml \\
        --set "dataset.partition=dirichlet(5)" --set algorithm.params.kappa=1.5
    python scripts/replay_decentralized.py topologies/diversifed-fmnist.yaml --set nodes=20 \\
        --set rounds=10 --set training.epochs=2 --set algorithm.name=uapdfl \\
        --set "algorithm.params={}" --json runs/replay.json

Methods that train before they exchange (``exchange_after_training``, e.g. DFedAvgM) and
centralized methods are not replayed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from p2pfl.algorithms import get_algorithm  # noqa: E402
from p2pfl.algorithms.build import node_method, node_seed  # noqa: E402
from p2pfl.check.load import load_topology  # noqa: E402
from p2pfl.config.schema import TopologyConfig  # noqa: E402
from p2pfl.config.topology import neighbours  # noqa: E402
from p2pfl.learning.data import load_node_data  # noqa: E402
from p2pfl.learning.train import evaluate, round_lr, train_local  # noqa: E402
from p2pfl.metrics import METHOD_KEY, write_json  # noqa: E402


def _build_nodes(cfg: TopologyConfig) -> dict[str, dict[str, Any]]:
    """Each node's data and method, built as the daemon builds them (``node_method``)."""
    cls = get_algorithm(cfg.algorithm.name)
    refused = f"{cfg.algorithm.name}: only decentralized merge-then-train methods are replayed"
    if cls.kind != "decentralized":
        raise SystemExit(refused)
    nodes = {}
    for nid in cfg.node_ids:
        data = load_node_data(cfg.dataset, cfg.node_ids, nid, cfg.seed)
        rng = np.random.default_rng(node_seed(cfg.seed, nid))
        alg = node_method(cls, cfg, nid, data, rng, torch.device("cpu"))
        if alg.exchange_after_training:  # the class's order, or its params' (UA-PDFL)
            raise SystemExit(refused)
        nodes[nid] = {"alg": alg, "data": data, "rng": rng, "neighbours": neighbours(cfg, nid)}
    return nodes


def replay(cfg: TopologyConfig, progress: bool = False) -> dict[str, Any]:
    """Run ``cfg.rounds`` rounds; returns the mean-accuracy curve and every node's records
    (round, test_acc, chosen peers, dropout, and the facts the method logged under
    ``method``, as the swarm's records have them)."""
    torch.set_num_threads(cfg.training.threads)
    nodes = _build_nodes(cfg)
    curve: list[float] = []
    records: dict[str, list[dict[str, Any]]] = {nid: [] for nid in nodes}
    for r in range(1, cfg.rounds + 1):
        t0 = time.perf_counter()
        snapshots = {nid: nd["alg"].snapshot() for nid, nd in nodes.items()}
        gossip = {nid: nd["alg"].gossip() for nid, nd in nodes.items()}
        accs = []
        for nid, nd in nodes.items():
            alg = nd["alg"]
            chosen = alg.choose_peers(nd["neighbours"]) if gossip[nid] is not None else []
            heard = {p: gossip[p] for p in chosen if gossip[p] is not None}
            plan, facts = alg.plan(heard)
            pulled = {p: alg.select(snapshots[p], part) for p, part in plan.items()}
            merged = alg.merge(heard, pulled)
            train_local(
                alg.model,
                nd["data"].train_x,
                nd["data"].train_y,
                cfg.training,
                round_lr(cfg.training, r),
                extra_loss=alg.extra_loss(),
                loss_fn=alg.loss_fn(),
                step_hook=alg.step_hook(),
                seed=int(nd["rng"].integers(2**31)),
            )
            after = alg.after_train() or {}
            acc, _ = evaluate(alg.model, nd["data"].test_x, nd["data"].test_y)
            accs.append(acc)
            # the swarm's record layout (p2pfl/services/bundle.py, round_record): the method's
            # facts under "method", the states its merge left out in "rejected"
            merged = dict(merged)
            rejected = merged.pop("rejected", None)
            method = {**(facts or {}), **merged, **after}
            records[nid].append(
                {
                    "round": r,
                    "test_acc": acc,
                    "chosen": chosen,
                    "dropout": method.get("dropout") is True,
                    "rejected": rejected if isinstance(rejected, dict) else {},
                    METHOD_KEY: method,
                }
            )
        curve.append(statistics.fmean(accs))
        if progress:
            print(f"round {r}: mean acc {curve[-1]:.4f} ({time.perf_counter() - t0:.1f} s)")
    return {"final_acc_mean": curve[-1], "curve": curve, "records": records}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("topology", type=Path)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--data-root", help="sets dataset.root")
    ap.add_argument("--json", type=Path, help="write the curve and per-node records here")
    args = ap.parse_args(argv)
    extra = [*args.set, *([f"dataset.root={args.data_root}"] if args.data_root else [])]
    cfg = load_topology(args.topology, extra)
    out = replay(cfg, progress=True)
    print(f"final mean accuracy: {100 * out['final_acc_mean']:.2f}")
    if args.json:
        write_json(args.json, {"topology": str(args.topology), "overrides": extra, **out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
