"""Where DP-SGD's accuracy goes, for nodes that train alone.

Each named node of a topology trains on its own shard for the topology's rounds, with no
peer, three times from the same initial model:

- ``plain``: the topology's training (``train_local``);
- ``clip``: DP-SGD with the clipping bound ``--max-grad-norm`` and no noise (σ = 0);
- ``dp``: DP-SGD with the σ that spends ``--epsilon`` (δ ``--delta``) over the run, planned
  as a node plans it (``plan_noise`` for the node's sampling rate and steps).

``plain − clip`` is what clipping costs, ``clip − dp`` what the noise costs. The nodes are
separate runs (``--jobs`` at a time); the table gives each node's final test accuracy and
the mean. A diagnostic for docs/algorithms.md "Differential privacy", not a benchmark of a
swarm: ``scripts/bench_privacy.py`` measures the swarm.

    python scripts/dp_cost_alone.py topologies/uapdfl-fmnist.yaml \\
        --data-root ../shared/data --nodes n0,n1,n2,n3 --max-grad-norm 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = ("plain", "clip", "dp")


def run_node(topology: str, overrides: list[str], node_id: str, args: dict) -> dict:
    """One node's three trainings: ``{variant: final test accuracy}`` and the σ used."""
    import torch

    from p2pfl.check.load import load_topology
    from p2pfl.learning.data import load_node_data
    from p2pfl.learning.dp_train import fix_model, train_private
    from p2pfl.learning.models import build_model
    from p2pfl.learning.train import evaluate, round_epochs, round_lr, train_local
    from p2pfl.privacy.accountant import plan_noise, sample_rate, steps_per_epoch

    torch.set_num_threads(1)
    cfg = load_topology(topology, overrides)
    data = load_node_data(cfg.dataset, cfg.node_ids, node_id, cfg.seed)
    n = len(data.train_y)
    q = sample_rate(cfg.training.batch_size, n)
    k = steps_per_epoch(q)
    steps = cfg.rounds * round_epochs(cfg.training, k) * k
    sigma = plan_noise(args["epsilon"], args["delta"], q, steps)
    out: dict = {"n": n, "q": q, "steps": steps, "sigma": sigma}
    for variant in VARIANTS:
        torch.manual_seed(cfg.seed)
        model, _ = fix_model(build_model(cfg.model, data.num_classes, data.input_shape))
        for r in range(1, cfg.rounds + 1):
            lr = round_lr(cfg.training, r)
            seed = cfg.seed * 100_003 + r
            if variant == "plain":
                train_local(model, data.train_x, data.train_y, cfg.training, lr, seed=seed)
            else:
                train_private(
                    model,
                    data.train_x,
                    data.train_y,
                    cfg.training,
                    lr,
                    noise_multiplier=0.0 if variant == "clip" else sigma,
                    max_grad_norm=args["max_grad_norm"],
                    q=q,
                    steps_per_epoch=k,
                    seed=seed,
                )
        out[variant] = evaluate(model, data.test_x, data.test_y)[0]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("topology", nargs="?", default="topologies/uapdfl-fmnist.yaml")
    ap.add_argument("--data-root", help="sets dataset.root")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--nodes", help="comma-separated node ids (default: the first four)")
    ap.add_argument("--epsilon", type=float, default=8.0)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--max-grad-norm", type=float, default=5.0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    overrides = ([f"dataset.root={args.data_root}"] if args.data_root else []) + args.set
    if args.nodes:
        nodes = [s for s in args.nodes.split(",") if s]
    else:
        from p2pfl.check.load import load_topology

        nodes = load_topology(args.topology, overrides).node_ids[:4]
    knobs = {"epsilon": args.epsilon, "delta": args.delta, "max_grad_norm": args.max_grad_norm}
    if args.jobs <= 1:
        per_node = {nid: run_node(args.topology, overrides, nid, knobs) for nid in nodes}
    else:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            futures = {
                nid: pool.submit(run_node, args.topology, overrides, nid, knobs) for nid in nodes
            }
            per_node = {nid: f.result() for nid, f in futures.items()}
    mean = {v: statistics.mean(r[v] for r in per_node.values()) for v in VARIANTS}
    print(f"{'node':>6} {'n':>5} {'σ':>6} " + " ".join(f"{v:>7}" for v in VARIANTS))
    for nid, r in per_node.items():
        accs = " ".join(f"{100 * r[v]:7.2f}" for v in VARIANTS)
        print(f"{nid:>6} {r['n']:>5} {r['sigma']:6.3f} {accs}")
    print(f"{'mean':>6} {'':>5} {'':>6} " + " ".join(f"{100 * mean[v]:7.2f}" for v in VARIANTS))
    print(
        f"clipping costs {100 * (mean['plain'] - mean['clip']):.2f} points, "
        f"the noise {100 * (mean['clip'] - mean['dp']):.2f} more"
    )
    if args.json:
        record = {"command": " ".join(sys.argv), **knobs, "nodes": per_node, "mean": mean}
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
