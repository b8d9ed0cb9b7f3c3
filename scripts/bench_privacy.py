"""What DP-SGD buys and costs: membership inference against the nodes' served models, and
the accuracy of UA-PDFL, FedAvg and Local with ``privacy.dp`` at ε ∈ {1, 4, 8} against no DP
(docs/algorithms.md, "Differential privacy").

    python scripts/bench_privacy.py --data-root ../shared/data --json results/bench_privacy.json
    python scripts/bench_privacy.py --quick --data-root ../shared/data \\
        --json results/bench_privacy.json --resume                            # 8 nodes, 8 rounds
    python scripts/bench_privacy.py --from-json results/bench_privacy.json  # the table again

**Runs.** Every method of ``--methods`` runs once per privacy setting (no DP, then each ε of
``--epsilons``, as ``privacy.dp: {target_epsilon: ε, delta: --delta, max_grad_norm:
--max-grad-norm}``) as a real swarm, on a suite of ``topologies/suites.yaml`` (default
``uapdfl-fmnist-a0.5``: ``topologies/uapdfl-fmnist.yaml``, Fashion-MNIST, 20 nodes of 300
train / 100 test samples, Dirichlet(0.5), CNN, 20 rounds, full graph) with one seed. The
runs reuse ``scripts/bench_accuracy.py`` (its suites, its overrides, its ``run_one``).
``--rounds`` / ``--nodes`` shrink the setting, ``--quick`` is a named preset of both
(8 nodes, 8 rounds; 8 nodes draw another Dirichlet partition than 20); ``--label`` names a
setting of one's own (e.g. ``--set training.epochs=5``). Every run carries its preset
(``suite``, ``quick``, ``n4-r2``, or the label) in the table and the JSON, so a shrunk run is
never presented as the suite's setting, and Δ compares runs of one preset only. Accuracy: the final mean test accuracy over nodes (the
summary's ``final.acc_mean``); ε spent: the largest over nodes of each node's last recorded
``epsilon`` (composed over its whole run, for ``delta``).

**The attack** (Yeom et al., 2018, "Privacy risk in machine learning", the loss-threshold
adversary): a record is called a member of a model's training set iff the model's
cross-entropy on it is below a threshold τ. The target is what a node serves at the end of
its run: ``nodes/<id>.safetensors`` loaded by :func:`p2pfl.load_model`. Its members are
the node's own training shard (what its DP-SGD steps sample from); its non-members an equal
number of records of the same label histogram, class by class, drawn from the rest of the
node's own Dirichlet shard: Fashion-MNIST training records that the partition gave this node
and the ``train_per_node`` cap left out, so no node of the swarm trained on them, and within
a class they are exchangeable with the members (the cap draws its members uniformly within
each class). Two numbers per model, advantage = TPR − FPR:

* **Yeom**: τ = the model's mean loss over its whole training shard (Yeom's adversary, who
  knows the expected training loss); τ does not look at the non-members, so the estimate is
  unbiased. The acceptance line uses it.
* **best**: the largest TPR − FPR over every threshold, chosen after seeing which records
  are members: an upper bound for this attack family on these samples, biased upwards by
  sampling noise. ``null`` is its mean when the member labels are shuffled (no signal at
  all, 200 permutations): read ``best`` against it.

Each node's model is attacked with its own members; the table gives the target node's
(``--target``, default ``n0``) and the mean over all nodes weighted by their sample counts
(one node's 300 + 300 records leave a standard error of about 0.04 on an advantage, the
mean over 20 nodes about 0.01).

**Acceptance**, printed as PASS / FAIL lines: UA-PDFL at ε = 8 loses at most 5
points of accuracy against no DP; the Yeom advantage (mean over nodes) of UA-PDFL at ε = 8 is
below 0.05. Writes ``--json`` with ``meta.commands`` (every command that produced the file;
``--resume`` keeps the runs of an earlier file with the same settings, appends its
command and keeps the meta fields this script does not write, such as hand-written
``notes``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_accuracy import SUITES, load_suites, run_one  # noqa: E402

from p2pfl.metrics import privacy_summary, read_records, write_json  # noqa: E402

METHOD_NAMES = {"uapdfl": "UA-PDFL", "fedavg": "FedAvg", "local": "Local"}
PRESETS: dict[str, dict[str, int | None]] = {
    "suite": {"nodes": None, "rounds": None},  # the suite's own topology
    "quick": {"nodes": 8, "rounds": 8},
}
NULL_PERMUTATIONS = 200
ACCEPT_MAX_DROP = 5.0  # points, UA-PDFL at ε = 8 against no DP
ACCEPT_MAX_ADVANTAGE = 0.05  # Yeom advantage with DP at ε = 8
ACCEPT_EPSILON = 8.0


# --------------------------------------------------------------------------- the attack


def threshold_advantage(members: np.ndarray, nonmembers: np.ndarray, tau: float) -> float:
    """TPR − FPR of the rule "member iff loss < ``tau``": the fraction of ``members`` whose
    loss is below ``tau`` minus that of ``nonmembers``. In [−1, 1]; 0 for empty inputs."""
    m = np.asarray(members, dtype=np.float64)
    n = np.asarray(nonmembers, dtype=np.float64)
    if m.size == 0 or n.size == 0:
        return 0.0
    return float(np.mean(m < tau) - np.mean(n < tau))


def best_threshold_advantage(members: np.ndarray, nonmembers: np.ndarray) -> tuple[float, float]:
    """The largest TPR − FPR of "member iff loss < τ" over every τ, and a τ that reaches it
    (the midpoint between two consecutive distinct losses, or beyond the extremes). At least
    0 (a τ below every loss calls nobody a member). Ties are handled: records of equal loss
    are always on the same side of τ."""
    m = np.asarray(members, dtype=np.float64)
    n = np.asarray(nonmembers, dtype=np.float64)
    if m.size == 0 or n.size == 0:
        return 0.0, float("-inf")
    values = np.unique(np.concatenate([m, n]))  # sorted distinct losses
    # the rule with τ just above values[j] calls every loss ≤ values[j] a member
    tpr = np.searchsorted(np.sort(m), values, side="right") / m.size
    fpr = np.searchsorted(np.sort(n), values, side="right") / n.size
    gaps = tpr - fpr
    j = int(np.argmax(gaps))
    if gaps[j] <= 0:
        return 0.0, float(values[0] - 1.0)
    tau = (values[j] + values[j + 1]) / 2 if j + 1 < values.size else values[j] + 1.0
    return float(gaps[j]), float(tau)


def null_best_advantage(
    members: np.ndarray,
    nonmembers: np.ndarray,
    rng: np.random.Generator,
    permutations: int = NULL_PERMUTATIONS,
) -> float:
    """The mean of :func:`best_threshold_advantage` over ``permutations`` shuffles of the
    member / non-member labels (same sizes): what the best-threshold advantage reads on these
    sample sizes when membership carries no signal."""
    m = np.asarray(members, dtype=np.float64)
    pooled = np.concatenate([m, np.asarray(nonmembers, dtype=np.float64)])
    if m.size == 0 or pooled.size == m.size or permutations <= 0:
        return 0.0
    out = []
    for _ in range(permutations):
        perm = rng.permutation(pooled)
        out.append(best_threshold_advantage(perm[: m.size], perm[m.size :])[0])
    return float(np.mean(out))


def matched_nonmembers(
    labels: np.ndarray, members: np.ndarray, pool: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Equal-size member and non-member index sets with the same label histogram: per class,
    as many of ``pool`` (indices never trained on) as there are ``members``, drawn at random;
    where the pool has fewer of a class, members of that class are dropped at random to
    match. Returns ``(members_used, nonmembers)``, both sorted int64."""
    labels = np.asarray(labels)
    members = np.asarray(members, dtype=np.int64)
    pool = np.setdiff1d(np.asarray(pool, dtype=np.int64), members)
    keep_m: list[np.ndarray] = []
    keep_n: list[np.ndarray] = []
    for c in np.unique(labels[members]):
        mine = members[labels[members] == c]
        theirs = pool[labels[pool] == c]
        k = min(mine.size, theirs.size)
        keep_m.append(rng.permutation(mine)[:k])
        keep_n.append(rng.permutation(theirs)[:k])
    return _sorted_cat(keep_m), _sorted_cat(keep_n)


def _sorted_cat(parts: list[np.ndarray]) -> np.ndarray:
    return np.sort(np.concatenate(parts)).astype(np.int64) if parts else np.zeros(0, np.int64)


def attack_summary(
    train_losses: np.ndarray,
    member_losses: np.ndarray,
    nonmember_losses: np.ndarray,
    rng: np.random.Generator,
) -> dict[str, float | int]:
    """One model's attack: Yeom's τ (the mean of ``train_losses``, the model's loss over its
    whole training shard) and its advantage on the matched sets, the best advantage over all
    thresholds with its τ, and the best advantage's no-signal level (``null``)."""
    tau = float(np.mean(train_losses)) if len(train_losses) else float("nan")
    best, best_tau = best_threshold_advantage(member_losses, nonmember_losses)
    return {
        "n": int(len(member_losses)),
        "tau_yeom": tau,
        "adv_yeom": threshold_advantage(member_losses, nonmember_losses, tau),
        "adv_best": best,
        "tau_best": best_tau,
        "adv_best_null": null_best_advantage(member_losses, nonmember_losses, rng),
        "loss_members": float(np.mean(member_losses)) if len(member_losses) else float("nan"),
        "loss_nonmembers": (
            float(np.mean(nonmember_losses)) if len(nonmember_losses) else float("nan")
        ),
    }


def pooled(per_node: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The per-node advantages' mean over nodes, weighted by each node's sample count."""
    total = sum(r["n"] for r in per_node.values())
    if total == 0:
        return {"adv_yeom": float("nan"), "adv_best": float("nan"), "adv_best_null": float("nan")}
    return {
        k: sum(r[k] * r["n"] for r in per_node.values()) / total
        for k in ("adv_yeom", "adv_best", "adv_best_null")
    }


# ------------------------------------------------------------------ the run's served models


def node_indices(cfg: Any, arrays: Any, node_id: str) -> tuple[np.ndarray, np.ndarray]:
    """Indices into the training arrays of node ``node_id``'s training shard (its members)
    and of its whole Dirichlet shard, as :func:`p2pfl.learning.data.load_node_data` draws
    them (the partition, then the ``train_per_node`` cap with the same generator); checked
    against ``load_node_data`` itself, so a change there stops the benchmark instead of
    attacking the wrong records."""
    import torch

    from p2pfl.learning.data import load_node_data
    from p2pfl.learning.partition import partition_indices, stable_rng, subsample_like

    ds = cfg.dataset
    ids = cfg.node_ids
    k, i, c = len(ids), ids.index(node_id), arrays.num_classes
    spec = ds.partition.strip().replace(" ", "")
    shard = partition_indices(arrays.train_y, k, spec, cfg.seed, c, ds.min_samples, salt=ds.name)[i]
    idx = shard
    if ds.train_per_node is not None and len(idx) > ds.train_per_node:
        rng = stable_rng(cfg.seed, ds.name, spec, k, i, "cap")
        idx = subsample_like(arrays.train_y, idx, ds.train_per_node, c, rng)
    data = load_node_data(ds, ids, node_id, cfg.seed)
    same = torch.equal(arrays.to_tensor(arrays.train_x, idx), data.train_x) and np.array_equal(
        np.asarray(arrays.train_y[idx]), data.train_y.numpy()
    )
    if not same:
        raise SystemExit(
            f"{node_id}: the training shard rebuilt here differs from load_node_data's "
            "(p2pfl.learning.data changed how it draws shards?): not attacking the wrong records"
        )
    return np.asarray(idx, dtype=np.int64), np.asarray(shard, dtype=np.int64)


def per_sample_loss(model: Any, x: Any, y: Any, batch: int = 1000) -> np.ndarray:
    """Cross-entropy of ``model`` (eval mode, no gradient) on every row of ``x``."""
    import torch
    import torch.nn.functional as F

    out = []
    with torch.no_grad():
        for s in range(0, len(y), batch):
            logits = model(x[s : s + batch])
            out.append(F.cross_entropy(logits, y[s : s + batch], reduction="none"))
    return torch.cat(out).double().numpy() if out else np.zeros(0)


def attack_run(run_dir: Path, seed: int) -> dict[str, Any]:
    """Membership inference against every node's served model of a finished run
    (``nodes/<id>.safetensors`` by :func:`p2pfl.load_model`), each on its own members and
    matched non-members (module docstring). Per node: :func:`attack_summary`, the loaded
    model's accuracy on the node's test split (``served_acc``) and on its members."""
    import torch

    import p2pfl
    from p2pfl.check.load import load_topology
    from p2pfl.learning.data import load_arrays

    cfg = load_topology(run_dir / "config.yaml")
    arrays = load_arrays(cfg.dataset, cfg.seed)
    per_node: dict[str, dict[str, Any]] = {}
    for j, nid in enumerate(cfg.node_ids):
        members, shard = node_indices(cfg, arrays, nid)
        rng = np.random.default_rng([seed, j, 28])
        used, non = matched_nonmembers(arrays.train_y, members, shard, rng)
        model = p2pfl.load_model(run_dir, nid)

        def xy(idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
            y = torch.from_numpy(np.asarray(arrays.train_y[idx], dtype=np.int64))
            return arrays.to_tensor(arrays.train_x, idx), y

        train_losses = per_sample_loss(model, *xy(members))
        member_losses = train_losses[np.searchsorted(members, used)]
        nonmember_losses = per_sample_loss(model, *xy(non))
        result = attack_summary(train_losses, member_losses, nonmember_losses, rng)
        from p2pfl.learning.data import load_node_data

        data = load_node_data(cfg.dataset, cfg.node_ids, nid, cfg.seed)
        with torch.no_grad():
            served = (model(data.test_x).argmax(1) == data.test_y).float().mean().item()
            train_acc = (model(data.train_x).argmax(1) == data.train_y).float().mean().item()
        per_node[nid] = {**result, "served_acc": served, "train_acc": train_acc}
    return {"per_node": per_node, "mean": pooled(per_node)}


# ------------------------------------------------------------------------------ the grid


def dp_overrides(epsilon: float | None, args: argparse.Namespace) -> list[str]:
    """The ``--set`` overrides of one privacy setting (none without DP)."""
    if epsilon is None:
        return []
    dp = {
        "target_epsilon": float(epsilon),
        "delta": float(args.delta),
        "max_grad_norm": float(args.max_grad_norm),
    }
    return [f"privacy={json.dumps({'dp': dp})}", *args.dp_set]


def eps_tag(epsilon: float | None) -> str:
    return "nodp" if epsilon is None else f"eps{epsilon:g}"


def run_metrics(run_dir: Path, node_ids: list[str]) -> dict[str, Any]:
    """Accuracy and ε of a finished run from its nodes' records: the final mean test
    accuracy over nodes (percent) and :func:`p2pfl.metrics.privacy_summary`."""
    logs = {nid: read_records(run_dir / "nodes" / f"{nid}.jsonl") for nid in node_ids}
    finals = [recs[-1]["test_acc"] for recs in logs.values() if recs]
    eps = privacy_summary(logs)
    rejected = sum(len(r.get("rejected") or []) for recs in logs.values() for r in recs)
    return {
        "acc": 100.0 * float(np.mean(finals)) if finals else float("nan"),
        "nodes_completed": len(finals),
        "rounds_reached": max((recs[-1]["round"] for recs in logs.values() if recs), default=0),
        "epsilon_max": None if eps is None else eps["max"],
        "epsilon_per_node": None if eps is None else eps["per_node"],
        "exhausted": None if eps is None else eps["exhausted"],
        "rejected": rejected,
    }


def one_cell(
    method: str, epsilon: float | None, args: argparse.Namespace, console: Console
) -> dict[str, Any]:
    """One swarm run (``bench_accuracy.run_one``) and the attack on its served models."""
    from p2pfl.check.load import load_topology

    suites, _ = load_suites(Path(args.suites))
    suite = suites[args.suite]
    spec = suite.methods[method]
    sets = [*args.set, *([f"nodes={args.nodes}"] if args.nodes else [])]
    ns = argparse.Namespace(
        rounds=args.rounds,
        data_root=args.data_root,
        set=[*sets, *dp_overrides(epsilon, args)],
        out=str(Path(args.out) / args.preset / eps_tag(epsilon)),
        nodes_per_process=args.nodes_per_process,
    )
    run_dir = Path(ns.out) / args.suite / method / f"seed{args.seed}"  # run_one's
    t0 = time.monotonic()
    if args.reuse and (run_dir / "summary.json").exists():
        console.print(f"reusing {run_dir}")
        summary = json.loads((run_dir / "summary.json").read_text())
        code = 0
    else:
        summary = run_one(args.suite, suite, method, spec, args.seed, ns, console)
        code = summary.get("exit_code", 1)
    cfg = load_topology(run_dir / "config.yaml")
    metrics = run_metrics(run_dir, cfg.node_ids)
    mi = attack_run(run_dir, args.seed)
    return {
        "preset": args.preset,
        "method": method,
        "epsilon_target": epsilon,
        "run_dir": str(run_dir),
        "exit_code": code,
        "wall_s": summary.get("wall_s"),
        "bench_s": time.monotonic() - t0,
        "nodes": len(cfg.node_ids),
        "rounds": cfg.rounds,
        **preset_of(args),
        "dp": None if cfg.dp is None else cfg.dp.model_dump(mode="json"),
        **metrics,
        "mi": mi,
    }


Key = tuple[str, str, float | None]


def by_key(runs: list[dict[str, Any]]) -> dict[Key, dict[str, Any]]:
    """The runs by (preset, method, ε target)."""
    return {(r["preset"], r["method"], r["epsilon_target"]): r for r in runs}


def ordered(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The table's order: the suite's presets first (``suite``, then labels that start with
    it), then the quick ones, then the others; within one, methods as ``METHOD_NAMES`` lists
    them, no DP first and then ε from the loosest."""
    presets = ["suite", "quick"]
    methods = list(METHOD_NAMES)

    def key(r: dict[str, Any]) -> tuple[int, str, int, str, float]:
        p, m, e = r["preset"], r["method"], r["epsilon_target"]
        family = next((i for i, name in enumerate(presets) if p.startswith(name)), len(presets))
        return (
            family,
            p,
            methods.index(m) if m in methods else len(methods),
            m,
            float("-inf") if e is None else -e,
        )

    return sorted(runs, key=key)


def acceptance(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's two acceptance lines for UA-PDFL at ε = 8, per preset that ran UA-PDFL,
    each ``{preset, name, ok, value, bound}`` (``ok`` None when a run it needs is missing).
    The issue's setting is the ``suite`` preset; others are indications only."""
    cells = by_key(runs)
    out = []
    for preset in dict.fromkeys(r["preset"] for r in ordered(runs) if r["method"] == "uapdfl"):
        base = cells.get((preset, "uapdfl", None))
        dp = cells.get((preset, "uapdfl", ACCEPT_EPSILON))
        drop = None if base is None or dp is None else base["acc"] - dp["acc"]
        adv = None if dp is None else dp["mi"]["mean"]["adv_yeom"]
        eps = f"ε={ACCEPT_EPSILON:g}"
        out += [
            {
                "preset": preset,
                "name": f"UA-PDFL at {eps} loses ≤ {ACCEPT_MAX_DROP:g} points vs no DP",
                "value": drop,
                "bound": ACCEPT_MAX_DROP,
                "ok": None if drop is None else drop <= ACCEPT_MAX_DROP,
            },
            {
                "preset": preset,
                "name": f"UA-PDFL at {eps}: MI advantage (Yeom, mean over nodes) "
                f"< {ACCEPT_MAX_ADVANTAGE:g}",
                "value": adv,
                "bound": ACCEPT_MAX_ADVANTAGE,
                "ok": None if adv is None else adv < ACCEPT_MAX_ADVANTAGE,
            },
        ]
    return out


def render(result: dict[str, Any]) -> Table:
    """The table of a result: one row per (method, ε target)."""
    meta = result["meta"]
    target = meta["target"]
    title = (
        f"DP-SGD on {meta['suite']} (seed {meta['seed']}, δ {meta['delta']:g}, "
        f"max_grad_norm {meta.get('max_grad_norm', 1.0):g} unless the preset says; "
        "preset suite: the suite's topology, "
        f"quick: {PRESETS['quick']['nodes']} nodes, {PRESETS['quick']['rounds']} rounds)"
    )
    caption = (
        "acc: final mean test accuracy over nodes (%); Δ: against the method's no-DP run "
        "(points). MI: loss-threshold attack (Yeom et al. 2018), advantage TPR−FPR; "
        "Yeom: τ = the model's mean training loss (unbiased); best: max over all τ "
        f"(upper bound, biased up: null = its level with shuffled labels); {target}: the "
        "target node's served model; mean: over all nodes' served models."
    )
    table = Table(title=title, caption=caption)
    cols = (
        "preset",
        "method",
        "ε target",
        "ε spent (max)",
        "acc",
        "Δ acc",
        f"MI Yeom {target}",
        f"MI best {target} (null)",
        "MI Yeom mean",
        "MI best mean (null)",
        "wall",
    )
    for col in cols:
        table.add_column(col, justify="left" if col in ("preset", "method") else "right")
    cells = by_key(result["runs"])
    for r in ordered(result["runs"]):
        base = cells.get((r["preset"], r["method"], None))
        delta = "—" if base is None or base is r else f"{r['acc'] - base['acc']:+.2f}"
        eps = r["epsilon_max"]
        tgt = r["mi"]["per_node"].get(target, {})
        mean = r["mi"]["mean"]
        exhausted = len(r.get("exhausted") or [])
        table.add_row(
            f"{r['preset']} ({r['nodes']}×{r['rounds']})",
            METHOD_NAMES.get(r["method"], r["method"]),
            "∞ (no DP)" if r["epsilon_target"] is None else f"{r['epsilon_target']:g}",
            "—" if eps is None else f"{eps:.2f}" + (f" ({exhausted} exh.)" if exhausted else ""),
            f"{r['acc']:.2f}",
            delta,
            f"{tgt['adv_yeom']:.3f}" if tgt else "—",
            f"{tgt['adv_best']:.3f} ({tgt['adv_best_null']:.3f})" if tgt else "—",
            f"{mean['adv_yeom']:.3f}",
            f"{mean['adv_best']:.3f} ({mean['adv_best_null']:.3f})",
            f"{r['wall_s']:.0f} s" if r.get("wall_s") is not None else "—",
        )
    return table


def print_result(result: dict[str, Any], console: Console) -> None:
    console.print(render(result))
    for line in result["acceptance"]:
        verdict = {True: "PASS", False: "FAIL", None: "N/A "}[line["ok"]]
        value = "not run" if line["value"] is None else f"{line['value']:.3f}"
        console.print(
            f"{verdict}  [{line['preset']}] {line['name']}: {value} (bound {line['bound']:g})",
            markup=False,
        )
    for r in ordered(result["runs"]):
        if r["epsilon_target"] is None and r["mi"]["mean"]["adv_yeom"] < ACCEPT_MAX_ADVANTAGE:
            console.print(
                f"note: [{r['preset']}] {METHOD_NAMES.get(r['method'], r['method'])} without DP "
                f"is already below {ACCEPT_MAX_ADVANTAGE:g} (Yeom): little there for DP to "
                "protect",
                markup=False,
            )


def _machine() -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{platform.node()}: {platform.machine()}, {cores} cores, training on the CPU"


def preset_of(args: argparse.Namespace) -> dict[str, Any]:
    """What defines a preset beyond its nodes and rounds: the overrides of every run, those
    of its DP runs, and the clipping bound."""
    return {"set": list(args.set), "dp_set": list(args.dp_set), "max_grad_norm": args.max_grad_norm}


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """What every run of one result file shares (``--resume`` checks it); a preset's runs
    also share ``--set``, ``--dp-set`` and ``--max-grad-norm`` (:func:`preset_of`)."""
    return {
        "suite": args.suite,
        "seed": args.seed,
        "delta": args.delta,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default="uapdfl-fmnist-a0.5", help="a suite of suites.yaml")
    ap.add_argument("--suites", default=str(SUITES), help="the suites file (bench_accuracy's)")
    ap.add_argument("--methods", default="uapdfl,fedavg,local")
    ap.add_argument("--epsilons", default="1,4,8", help="target ε of the DP runs")
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--max-grad-norm", type=float, default=1.0, help="privacy.dp.max_grad_norm")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="preset: 8 nodes, 8 rounds")
    ap.add_argument("--nodes", type=int, help="nodes (default: the suite's, or the preset's)")
    ap.add_argument("--rounds", type=int, help="rounds (default: the suite's, or the preset's)")
    ap.add_argument(
        "--label",
        help="name this invocation's preset (default: suite, quick, or e.g. n4-r2); a preset "
        "is one setting: its runs share --nodes, --rounds and --set",
    )
    ap.add_argument("--target", default="n0", help="the node whose served model is attacked")
    ap.add_argument("--data-root", help="sets dataset.root")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument(
        "--dp-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override for the DP runs only (e.g. training.batch_size=100)",
    )
    ap.add_argument("--nodes-per-process", type=int, default=5)
    ap.add_argument("--out", default="runs/bench_privacy")
    ap.add_argument("--json", help="result file")
    ap.add_argument("--resume", action="store_true", help="keep --json's runs of equal settings")
    ap.add_argument("--reuse", action="store_true", help="attack finished run dirs again")
    ap.add_argument("--from-json", help="only render the table of a result file")
    args = ap.parse_args(argv)
    console = Console()
    if args.from_json:
        print_result(json.loads(Path(args.from_json).read_text()), console)
        return 0
    preset = PRESETS["quick" if args.quick else "suite"]
    args.nodes = args.nodes or preset["nodes"]
    args.rounds = args.rounds or preset["rounds"]
    args.preset = "quick" if args.quick else "suite"
    if (args.nodes, args.rounds) != (preset["nodes"], preset["rounds"]):
        sizes = [f"n{args.nodes}" if args.nodes else "", f"r{args.rounds}" if args.rounds else ""]
        args.preset = "-".join(x for x in sizes if x)  # e.g. n4-r2: neither preset
    if args.label:
        args.preset = args.label
    suites, _ = load_suites(Path(args.suites))
    if args.suite not in suites:
        ap.error(f"unknown suite {args.suite!r}")
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in suites[args.suite].methods]
    if unknown:
        ap.error(f"methods {unknown} are not in suite {args.suite!r}")
    epsilons: list[float | None] = [
        None,
        *sorted((float(e) for e in args.epsilons.split(",")), reverse=True),
    ]
    command = shlex.join(["python", "scripts/bench_privacy.py", *(argv or sys.argv[1:])])
    runs: list[dict[str, Any]] = []
    commands = [command]
    wall_before = 0.0
    kept_meta: dict[str, Any] = {}  # what an earlier file's meta holds beyond ours (notes)
    path = Path(args.json) if args.json else None
    if args.resume and path is not None and path.exists():
        old = json.loads(path.read_text())
        if old["meta"]["settings"] != settings_of(args):
            ap.error(f"--resume: {path} was run with other settings: {old['meta']['settings']}")
        runs = old["runs"]
        mine = preset_of(args)
        clash = [
            r
            for r in runs
            if r["preset"] == args.preset and any(r.get(k) != v for k, v in mine.items())
        ]
        if clash:
            old_preset = {k: clash[0].get(k) for k in mine}
            ap.error(f"--resume: preset {args.preset!r} of {path} ran with {old_preset}")
        commands = [*old["meta"]["commands"], command]
        wall_before = float(old["meta"].get("wall_s", 0.0))
        kept_meta = dict(old["meta"])
    t0 = time.monotonic()

    def result() -> dict[str, Any]:
        suite = suites[args.suite]
        meta = {
            "commands": commands,
            "machine": _machine(),
            "suite": args.suite,
            "topology": suite.topology,
            "presets": {"quick": PRESETS["quick"], "suite": "the suite's topology"},
            "seed": args.seed,
            "delta": args.delta,
            "max_grad_norm": 1.0,  # the default; each run has its own
            "target": args.target,
            "attack": "loss threshold (Yeom et al. 2018); members: the node's training "
            "shard; non-members: the same label histogram from the rest of its Dirichlet "
            "shard (never trained on by any node)",
            "settings": settings_of(args),
            "wall_s": time.monotonic() - t0 + wall_before,  # this file's invocations
            "swarm_s": sum(r.get("wall_s") or 0.0 for r in runs),  # the swarms alone
        }
        meta.update({k: v for k, v in kept_meta.items() if k not in meta})
        return {"meta": meta, "runs": ordered(runs), "acceptance": acceptance(runs)}

    done = {(r["preset"], r["method"], r["epsilon_target"]) for r in runs}
    for eps in epsilons:  # no DP first, then the loosest ε: the acceptance cells come early
        for method in methods:
            if (args.preset, method, eps) in done:
                continue
            cell = one_cell(method, eps, args, console)
            runs.append(cell)
            console.print(
                f"{method} {eps_tag(eps)}: acc {cell['acc']:.2f}, ε {cell['epsilon_max']}, "
                f"MI Yeom mean {cell['mi']['mean']['adv_yeom']:.3f}, "
                f"{cell['wall_s'] or 0:.0f} s"
            )
            if path is not None:
                write_json(path, result())
    final = result()
    if path is not None:
        write_json(path, final)
    print_result(final, console)
    if path is not None:
        console.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
