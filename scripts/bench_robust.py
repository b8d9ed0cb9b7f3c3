#!/usr/bin/env python
"""Robustness benchmark: every attack against every defence, through the real swarm.

Each run is one whole swarm (a private broker, node processes) of the base topology with a
partition, a node count, a method, a defence rule (``defence.rule``) and an attack (the
``attacks:`` section: the attack's spec on a fraction of the nodes, or on named nodes). Runs
go one after the other; each one's result is written to ``--json`` as soon as it is done,
and a run whose settings are already there is skipped (resume: rerun the same command).

Per run, over the HONEST nodes (every node not in ``cfg.attackers()``):

- ``acc_mean`` / ``acc_worst``: mean and minimum of each honest node's last ``test_acc``;
- ``delta_pts``: ``acc_mean`` minus the clean reference's mean final accuracy over the SAME
  honest nodes, in points (the clean run of the same partition, method, defence (or
  ``--reference-defence``), nodes, rounds and seed; negative: a drop);
- ``false_rejection``: over every round record of every honest node, the (record, honest
  peer) pairs in ``rejected`` divided by the honest peers whose states the record
  considered: decentralized records ``pulled ∪ rejected``; centralized records of the
  round's aggregator (``aggregator`` = own id) ``aggregated ∪ rejected``; other centralized
  records the aggregator whose result was applied (``received``) ``∪ rejected`` (a refused
  result names its aggregator in ``rejected``). The node itself is never counted.
  ``attacker_rejection`` is the same ratio over attacking peers (how often they were caught);
- ``asr`` (``label_flip_targeted``, and clean runs as the baseline confusion): each honest
  node's final model is reloaded (``p2pfl.export.load_model``) and run on its own test
  split (``load_node_data``); ASR = test samples of class SOURCE predicted as TARGET /
  test samples of class SOURCE, pooled over the honest nodes (Fashion-MNIST: 0 T-shirt/top
  → 2 Pullover).

``--fractions 0`` (or attack ``none``) is the clean run: one per (partition, method,
defence, seed), never one per attack; clean references are added to every grid
(``--no-reference`` leaves them out unless asked for). The ``aggregator`` attack (a node
that serves a NaN aggregate, ``{kind: nan, on: result}``) only runs with centralized
methods. The table shows medians over seeds.

    python scripts/bench_robust.py --grid acceptance --dry-run
    python scripts/bench_robust.py --grid acceptance --json results/bench_robust_acceptance.json
    python scripts/bench_robust.py --grid fmnist --partitions 0.5 --methods uapdfl \\
        --attacks nan,sign_flip,alie --defences clip,median --fractions 0.2 --rounds 10
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import re
import shlex
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from p2pfl.check.load import load_topology  # noqa: E402
from p2pfl.config.schema import DEFENCE_RULES  # noqa: E402
from p2pfl.metrics import write_json  # noqa: E402

SOURCE_CLASS, TARGET_CLASS = 0, 2  # Fashion-MNIST: T-shirt/top -> Pullover

# CLI attack name -> the attack's spec (without who attacks)
ATTACKS: dict[str, dict[str, Any]] = {
    "nan": {"kind": "nan"},
    "scale": {"kind": "scale", "factor": 100.0},
    "noise": {"kind": "noise"},
    "sign_flip": {"kind": "sign_flip"},
    "alie": {"kind": "alie"},
    "ipm": {"kind": "ipm"},
    "free_rider": {"kind": "free_rider"},
    "label_flip": {"kind": "label_flip"},
    "label_flip_targeted": {"kind": "label_flip", "source": SOURCE_CLASS, "target": TARGET_CLASS},
    "inflate_n": {"kind": "inflate_n"},
    "aggregator": {"kind": "nan", "on": "result"},
    "delay": {"kind": "delay"},
}
CENTRALIZED_ONLY = {"aggregator"}
CLEAN = "none"
DEFENCES = list(DEFENCE_RULES)
"""Each defence of a grid is a rule's name, with knobs in parentheses where wanted:
``clip(spread=2)`` runs ``defence.rule=clip`` with ``defence.spread=2``."""

GRIDS: dict[str, dict[str, Any]] = {
    # the acceptance setting: one attacker of 8, every method, the default defence
    "acceptance": {
        "topology": "topologies/synthetic.yaml",
        "set": ["edges=full"],
        "nodes": 8,
        "rounds": 15,
        "partitions": None,  # the topology's own (dirichlet(0.5))
        "methods": None,  # every registered method
        "attacks": [CLEAN, "nan", "scale", "noise", "sign_flip"],
        "defences": None,  # the default rule (DefenceConfig.rule)
        "fractions": [0.0],
        "attacker_nodes": ["n3"],
    },
    # the Fashion-MNIST grid
    "fmnist": {
        "topology": "topologies/uapdfl-fmnist.yaml",
        "set": [],
        "nodes": 20,
        "rounds": None,  # the topology's (20)
        "partitions": ["dirichlet(0.5)", "dirichlet(0.1)"],
        "methods": ["uapdfl", "fedavg", "dfedavgm"],
        "attacks": list(ATTACKS),
        "defences": DEFENCES,
        "fractions": [0.0, 0.1, 0.2, 0.3],
        "attacker_nodes": None,
    },
}

METRICS = (
    "acc_mean",
    "acc_worst",
    "delta_pts",
    "false_rejection",
    "attacker_rejection",
    "asr",
    "wall_s",
)


# ---------------------------------------------------------------------------- the grid
def split_list(text: str | None) -> list[str]:
    """``a,b(1,2),c`` -> ``[a, b(1,2), c]``: commas inside parentheses are kept."""
    if not text:
        return []
    return [p.strip() for p in re.split(r",(?![^(]*\))", text) if p.strip()]


def partition_spec(text: str) -> str:
    """``0.5`` / ``dir0.5`` / ``Dir(0.5)`` -> ``dirichlet(0.5)``; anything else as given."""
    t = text.strip()
    m = re.fullmatch(r"(?i)(?:dir(?:ichlet)?)?\(?([0-9.]+)\)?", t)
    return f"dirichlet({m.group(1)})" if m else t


def fraction_of(text: str) -> float:
    """``0.2`` or ``20%`` -> 0.2."""
    t = text.strip()
    v = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    if not 0 <= v <= 1:
        raise ValueError(f"fraction {text!r} is not in [0, 1]")
    return v


def clean_settings(s: dict[str, Any], defence: str | None = None) -> dict[str, Any]:
    """The clean counterpart of run settings ``s`` (no attack), with ``defence`` if given."""
    out = {**s, "attack": CLEAN, "fraction": 0.0, "attackers": None}
    if defence is not None:
        out["defence"] = defence
    return out


def expand_grid(
    *,
    topology: str,
    partitions: list[str],
    nodes: int,
    methods: list[str],
    defences: list[str],
    attacks: list[str],
    fractions: list[float],
    seeds: list[int],
    rounds: int,
    is_centralized: Callable[[str], bool],
    attacker_nodes: list[str] | None = None,
    train_per_node: int | None = None,
    extra: list[str] | None = None,
    reference: bool = True,
    reference_defence: str | None = None,
) -> list[dict[str, Any]]:
    """Every run of a grid, as settings dicts, in the order they run (seed, partition,
    method, defence; the clean run first, then fraction x attack). The clean run (fraction
    0, or attack ``none``) is one per (partition, method, defence, seed); it is added as the
    reference unless ``reference`` is False (then only when asked for), and so is the clean
    run of ``reference_defence``. ``aggregator`` runs only for centralized methods. With
    ``attacker_nodes``, the non-zero fractions give way to that one set of nodes."""
    unknown = [a for a in attacks if a != CLEAN and a not in ATTACKS]
    if unknown:
        raise ValueError(f"unknown attacks {unknown}; known: {', '.join([CLEAN, *ATTACKS])}")
    bad = [d for d in defences if defence_overrides(d) is None]
    if bad:
        raise ValueError(f"unknown defences {bad}; known: {', '.join(DEFENCES)}")
    hostile = [a for a in attacks if a != CLEAN]
    want_clean = reference or CLEAN in attacks or 0.0 in fractions
    if attacker_nodes:
        who: list[tuple[float, list[str] | None]] = [
            (len(attacker_nodes) / nodes, list(attacker_nodes))
        ]
    else:
        who = [(f, None) for f in sorted(set(fractions)) if f > 0]
    runs: list[dict[str, Any]] = []
    seen: set[str] = set()

    def add(s: dict[str, Any]) -> None:
        key = run_key(s)
        if key not in seen:
            seen.add(key)
            runs.append(s)

    for seed in seeds:
        for partition in partitions:
            for method in methods:
                for defence in defences:
                    base = {
                        "topology": topology,
                        "partition": partition,
                        "nodes": nodes,
                        "method": method,
                        "defence": defence,
                        "attack": CLEAN,
                        "fraction": 0.0,
                        "attackers": None,
                        "rounds": rounds,
                        "seed": seed,
                        "train_per_node": train_per_node,
                        "set": list(extra or []),
                    }
                    if want_clean:
                        add(base)
                        if reference_defence is not None:
                            add(clean_settings(base, reference_defence))
                    for fraction, named in who:
                        for attack in hostile:
                            if attack in CENTRALIZED_ONLY and not is_centralized(method):
                                continue
                            add(
                                {**base, "attack": attack, "fraction": fraction, "attackers": named}
                            )
    return runs


def run_key(settings: dict[str, Any]) -> str:
    """The resume key of a run: every setting, canonically ordered."""
    return json.dumps(settings, sort_keys=True, separators=(",", ":"))


def result_field() -> str:
    """The name ``AttackSpec`` gives "what the attacker corrupts" (``on`` in the issue;
    ``corrupts`` since ``on`` is a boolean to YAML 1.1)."""
    from p2pfl.config.schema import AttackSpec

    return next((f for f in ("corrupts", "on") if f in AttackSpec.model_fields), "on")


def attack_override(attack: str, fraction: float, attackers: list[str] | None) -> str:
    """The ``attacks=[...]`` override of one attack (a YAML flow sequence)."""
    spec = copy.deepcopy(ATTACKS[attack])
    if "on" in spec:
        spec[result_field()] = spec.pop("on")
    if attackers:
        spec["nodes"] = list(attackers)
    else:
        spec["fraction"] = fraction
    return "attacks=" + yaml.safe_dump([spec], default_flow_style=True, width=10**6).strip()


def overrides_of(
    settings: dict[str, Any], base_method: str, data_root: str | None = None
) -> list[str]:
    """The ``--set`` overrides that turn the base topology into run ``settings``."""
    s = settings
    out = [*s["set"], f"nodes={s['nodes']}", f"dataset.partition={s['partition']}"]
    if s["method"] != base_method:
        out += [f"algorithm.name={s['method']}", "algorithm.params={}"]
    out += [*defence_overrides(s["defence"]), f"rounds={s['rounds']}", f"seed={s['seed']}"]
    if s["train_per_node"]:
        out.append(f"dataset.train_per_node={s['train_per_node']}")
    if s["attack"] != CLEAN:
        out.append(attack_override(s["attack"], s["fraction"], s["attackers"]))
    else:
        out.append("attacks=[]")
    if data_root:
        out.append(f"dataset.root={data_root}")
    return out


def defence_overrides(defence: str) -> list[str] | None:
    """The overrides of a grid's defence, ``rule`` or ``rule(knob=value, …)`` (None when
    the rule is unknown or a knob malformed)."""
    m = re.fullmatch(r"([a-z_]+)(?:\((.*)\))?", defence)
    if m is None or m.group(1) not in DEFENCES:
        return None
    out = [f"defence.rule={m.group(1)}"]
    for knob in filter(None, (m.group(2) or "").split(",")):
        name, eq, value = knob.strip().partition("=")
        if not eq or not re.fullmatch(r"[a-z_]+", name) or not value:
            return None
        out.append(f"defence.{name}={value}")
    return out


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "", text.replace("(", "").replace(")", "")) or "x"


def fraction_label(s: dict[str, Any]) -> str:
    if s["attack"] == CLEAN:
        return "0%"
    if s["attackers"]:
        return f"{len(s['attackers'])}/{s['nodes']} ({','.join(s['attackers'])})"
    return f"{100 * s['fraction']:g}%"


def run_dir_of(out: Path, s: dict[str, Any]) -> Path:
    who = "+".join(s["attackers"]) if s["attackers"] else f"{100 * s['fraction']:g}pct"
    attack = CLEAN if s["attack"] == CLEAN else f"{s['attack']}-{who}"
    setting = f"n{s['nodes']}-r{s['rounds']}" + (
        f"-t{s['train_per_node']}" if s["train_per_node"] else ""
    )
    return (
        out
        / slug(Path(s["topology"]).stem)
        / f"{slug(s['partition'])}-{setting}"
        / s["method"]
        / s["defence"]
        / slug(attack)
        / f"seed{s['seed']}"
    )


# ---------------------------------------------------------------------------- metrics
def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and v == v and v not in (float("inf"), float("-inf"))


def considered_peers(rec: dict[str, Any], own: str) -> set[str]:
    """The peers whose states a round record ``rec`` of node ``own`` considered (see the
    module's docstring): admitted or refused."""
    rejected = set(rec.get("rejected") or {})
    if "aggregator" in rec or "aggregated" in rec:  # centralized
        if rec.get("aggregator") == own:
            peers = set(rec.get("aggregated") or []) | rejected
        else:
            agg = rec.get("aggregator")
            peers = ({agg} if agg and rec.get("received") else set()) | rejected
    else:
        peers = set(rec.get("pulled") or {}) | rejected
    peers.discard(own)
    return peers


def rejection_counts(
    records: dict[str, list[dict[str, Any]]],
    honest: set[str],
    peers_of_interest: set[str],
    field: str = "rejected",
) -> tuple[int, int]:
    """Over the honest nodes' records: (pairs (record, peer) in the record's ``field``
    (``rejected``, or ``clipped`` under ``centered_clip``), pairs considered), peers
    restricted to ``peers_of_interest``."""
    hit = considered = 0
    for nid in sorted(honest):
        for rec in records.get(nid, []):
            peers = considered_peers(rec, nid) & peers_of_interest
            considered += len(peers)
            hit += len(peers & set(rec.get(field) or {}))
    return hit, considered


def distrust_count(records: dict[str, list[dict[str, Any]]], honest: set[str]) -> int:
    """Over the honest nodes' records: (record, honest peer) pairs in ``distrusted``."""
    return sum(
        len(set(rec.get("distrusted") or {}) & (honest - {nid}))
        for nid in sorted(honest)
        for rec in records.get(nid, [])
    )


def run_metrics(
    records: dict[str, list[dict[str, Any]]], node_ids: list[str], attackers: Iterable[str]
) -> dict[str, Any]:
    """A run's metrics from its records (``{node: [round records]}``) over the honest
    nodes: final accuracy mean and worst, false-rejection rate of honest peers and the
    rejection rate of attacking peers (None where nothing was considered)."""
    bad = set(attackers)
    honest = {n for n in node_ids if n not in bad}
    finals = {}
    for nid in sorted(honest):
        recs = records.get(nid) or []
        if recs and _finite(recs[-1].get("test_acc")):
            finals[nid] = float(recs[-1]["test_acc"])
    fr_n, fr_d = rejection_counts(records, honest, honest)
    ar_n, ar_d = rejection_counts(records, honest, bad)
    fc_n, _ = rejection_counts(records, honest, honest, "clipped")
    return {
        "honest_nodes": len(honest),
        "honest_reported": len(finals),
        "attackers": sorted(bad),
        "acc_mean": statistics.fmean(finals.values()) if finals else None,
        "acc_worst": min(finals.values()) if finals else None,
        "acc_final": finals,
        "false_rejections": fr_n,
        "honest_considered": fr_d,
        "false_rejection": fr_n / fr_d if fr_d else None,
        "honest_clipped": fc_n,
        "false_distrust": distrust_count(records, honest),
        "attacker_rejections": ar_n,
        "attacker_considered": ar_d,
        "attacker_rejection": ar_n / ar_d if ar_d else None,
        "rounds_reached": min((len(records.get(n) or []) for n in honest), default=0),
    }


def asr_counts(pred: Any, labels: Any, source: int, target: int) -> tuple[int, int]:
    """(samples of class ``source`` predicted as ``target``, samples of class ``source``)."""
    src = labels == source
    return int((src & (pred == target)).sum()), int(src.sum())


def attack_success(
    run_dir: Path, cfg: Any, honest: list[str], source: int, target: int
) -> dict[str, Any]:
    """The targeted label flip's success over the honest nodes: each one's final model
    reloaded and run on its own test split; pooled."""
    import torch

    from p2pfl.export import load_model
    from p2pfl.learning.data import load_node_data

    hits = total = 0
    per_node: dict[str, list[int]] = {}
    for nid in honest:
        try:
            model = load_model(run_dir, nid)
        except Exception as exc:  # a node that left no model: counted as missing
            per_node[nid] = []
            print(f"ASR: {nid}: no model ({exc})", file=sys.stderr)
            continue
        data = load_node_data(cfg.dataset, cfg.node_ids, nid, cfg.seed)
        with torch.no_grad():
            pred = torch.cat([model(xb).argmax(1) for xb in data.test_x.split(500)])
        h, n = asr_counts(pred, data.test_y, source, target)
        per_node[nid] = [h, n]
        hits, total = hits + h, total + n
    return {
        "asr": hits / total if total else None,
        "asr_hits": hits,
        "asr_source_samples": total,
        "asr_per_node": per_node,
        "asr_source": source,
        "asr_target": target,
    }


def _median(values: Iterable[Any]) -> float | None:
    vals = [float(v) for v in values if _finite(v)]
    return statistics.median(vals) if vals else None


def clean_mean_over(reference: dict[str, Any], nodes: Iterable[str]) -> float | None:
    """The clean reference's final accuracy, averaged over ``nodes`` (the attacked run's
    honest nodes, so both sides average the same nodes)."""
    finals = reference["metrics"].get("acc_final") or {}
    vals = [finals[n] for n in nodes if _finite(finals.get(n))]
    return statistics.fmean(vals) if vals else None


def with_deltas(runs: list[dict[str, Any]], reference_defence: str | None) -> None:
    """Set each run's ``clean_acc_mean`` (its clean reference's final accuracy over this
    run's honest nodes) and ``delta_pts`` (``acc_mean`` minus that, in points; None without
    a reference)."""
    by_key = {r["key"]: r for r in runs}
    for r in runs:
        m = r["metrics"]
        ref = by_key.get(run_key(clean_settings(r["settings"], reference_defence)))
        b = clean_mean_over(ref, m.get("acc_final") or {}) if ref else None
        a = m.get("acc_mean")
        m["clean_acc_mean"] = b
        m["delta_pts"] = 100 * (a - b) if _finite(a) and _finite(b) else None
        r["reference"] = ref["key"] if ref else None


def medians_over_seeds(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per setting (everything but the seed): the medians of :data:`METRICS`."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        s = {k: v for k, v in r["settings"].items() if k != "seed"}
        groups.setdefault(run_key(s), []).append(r)
    rows = []
    for key, members in groups.items():
        row = {"key": key, "settings": json.loads(key)}
        row["seeds"] = sorted(m["settings"]["seed"] for m in members)
        for metric in METRICS:
            row[metric] = _median(
                m.get("wall_s") if metric == "wall_s" else m["metrics"].get(metric) for m in members
            )
        row["exit_codes"] = sorted({m.get("exit_code") for m in members}, key=str)
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------- the table
def _pct(v: float | None, digits: int = 1) -> str:
    return "—" if v is None else f"{100 * v:.{digits}f}"


def render(rows: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=title)
    cols = (
        "method",
        "partition",
        "defence",
        "attack",
        "fraction",
        "seeds",
        "honest acc mean",
        "worst",
        "Δ vs clean (pts)",
        "false rej %",
        "attacker rej %",
        "ASR %",
        "wall",
    )
    for col in cols:
        table.add_column(col, justify="left" if col in cols[:5] else "right")
    for row in rows:
        s = row["settings"]
        delta = row["delta_pts"]
        failed = any(c not in (0, None) for c in row.get("exit_codes", []))
        table.add_row(
            s["method"],
            s["partition"],
            s["defence"],
            s["attack"] + (" [red](exit≠0)[/]" if failed else ""),
            fraction_label(s),
            ",".join(str(x) for x in row["seeds"]),
            _pct(row["acc_mean"], 2),
            _pct(row["acc_worst"], 2),
            "—" if delta is None or s["attack"] == CLEAN else f"{delta:+.2f}",
            _pct(row["false_rejection"]),
            _pct(row["attacker_rejection"]),
            _pct(row["asr"]),
            "—" if row["wall_s"] is None else f"{row['wall_s']:.0f} s",
        )
    return table


# ---------------------------------------------------------------------------- running
def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def machine_of(device: str) -> str:
    where = f"{platform.node()}: {platform.machine()}, {_cores()} cores"
    if device.startswith("cuda"):
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "unavailable"
        return f"{where}, training on {device} ({gpu})"
    return f"{where}, training on the CPU"


def load_results(path: Path) -> dict[str, Any]:
    if path.is_file():
        doc = json.loads(path.read_text())
        doc.setdefault("runs", [])
        return doc
    return {"runs": []}


def done_keys(doc: dict[str, Any]) -> set[str]:
    """The keys of the runs already measured (those with metrics)."""
    return {r["key"] for r in doc.get("runs", []) if r.get("metrics") is not None}


def config_of(s: dict[str, Any], args: argparse.Namespace) -> tuple[Any, list[str]]:
    """Run ``s``'s topology (validated) and the overrides that made it from the base."""
    topology = ROOT / s["topology"]
    base = load_topology(topology)
    root = args.data_root if base.dataset.name != "synthetic" and args.data_root else None
    if root:
        root = str(Path(root).resolve())
    overrides = overrides_of(s, base.algorithm.name, root)
    return load_topology(topology, overrides), overrides


def one_run(
    s: dict[str, Any],
    args: argparse.Namespace,
    console: Console,
) -> dict[str, Any]:
    """Run one swarm of settings ``s`` and measure it."""
    from p2pfl.launch.swarm import run_swarm
    from p2pfl.metrics import node_log_path, read_records

    cfg, overrides = config_of(s, args)
    run_dir = run_dir_of(Path(args.out), s)
    if run_dir.exists():  # a run cut short before: start afresh
        shutil.rmtree(run_dir)
    attackers = sorted(cfg.attackers())
    t0 = time.monotonic()
    code, summary = run_swarm(
        cfg, run_dir, nodes_per_process=args.nodes_per_process, progress=False, console=console
    )
    wall = time.monotonic() - t0
    records = {nid: read_records(node_log_path(run_dir, nid)) for nid in cfg.node_ids}
    metrics = run_metrics(records, cfg.node_ids, attackers)
    asr_s = None
    if s["attack"] in ("label_flip_targeted", CLEAN):
        t1 = time.monotonic()
        honest = [n for n in cfg.node_ids if n not in attackers]
        metrics.update(attack_success(run_dir, cfg, honest, SOURCE_CLASS, TARGET_CLASS))
        asr_s = round(time.monotonic() - t1, 2)
    return {
        "key": run_key(s),
        "settings": s,
        "overrides": overrides,
        "run_dir": str(run_dir),
        "exit_code": code,
        "nodes_completed": summary.get("nodes_completed"),
        "wall_s": round(wall, 2),
        "asr_s": asr_s,
        "metrics": metrics,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def finish(doc: dict[str, Any], path: Path, reference_defence: str | None) -> list[dict[str, Any]]:
    """Recompute the deltas and medians of ``doc`` and write it."""
    with_deltas(doc["runs"], reference_defence)
    doc["medians"] = medians_over_seeds(doc["runs"])
    write_json(path, doc)
    return doc["medians"]


DEFINITIONS = {
    "honest": "nodes not in cfg.attackers()",
    "acc_mean/acc_worst": "mean / min over honest nodes of their last record's test_acc",
    "delta_pts": "100 * (acc_mean - the mean final test_acc, over the same honest nodes, of "
    "the clean run with the same settings but no attack (same defence, or "
    "--reference-defence), same seed)",
    "false_rejection": "over honest nodes' records: (record, honest peer) pairs in rejected / "
    "honest peers considered (decentralized: pulled | rejected; centralized aggregator "
    "record: aggregated | rejected; other centralized records: the applied aggregator "
    "(received) | rejected); own id excluded",
    "attacker_rejection": "the same ratio over attacking peers",
    "honest_clipped": "over honest nodes' records: (record, honest peer) pairs in clipped "
    "(centered_clip pulled the state onto its bound; it still counted)",
    "false_distrust": "over honest nodes' records: (record, honest peer) pairs in distrusted",
    "asr": "pooled over honest nodes: test samples of class source predicted as target / "
    "test samples of class source, final models reloaded (label_flip_targeted, and clean "
    "runs as the baseline)",
}


def build_plan(args: argparse.Namespace) -> tuple[list[dict[str, Any]], str, dict[str, Any]]:
    """The runs of the command line: the preset's values where a flag is not given."""
    from p2pfl.algorithms import CentralizedAlgorithm, get_algorithm, known_algorithms

    preset = GRIDS[args.grid]
    topology = args.topology or preset["topology"]
    base = load_topology(ROOT / topology)
    methods = split_list(args.methods) or preset["methods"] or known_algorithms()
    for m in methods:
        get_algorithm(m)  # a ValueError naming the known methods
    partitions = [partition_spec(p) for p in split_list(args.partitions)] or (
        preset["partitions"] or [base.dataset.partition]
    )
    defences = split_list(args.defences) or preset["defences"]
    if not defences:
        from p2pfl.config.schema import DefenceConfig

        defences = [DefenceConfig().rule]
    attacks = split_list(args.attacks) or preset["attacks"]
    fractions = (
        [fraction_of(f) for f in split_list(args.fractions)]
        if args.fractions
        else preset["fractions"]
    )
    attacker_nodes = (
        split_list(args.attacker_nodes) if args.attacker_nodes else preset["attacker_nodes"]
    )
    if args.fractions and not args.attacker_nodes:
        attacker_nodes = None  # fractions given: they choose the attackers
    nodes = args.nodes or preset["nodes"] or len(base.nodes)
    rounds = args.rounds or preset["rounds"] or base.rounds
    extra = [*preset["set"], *args.set]
    seeds = [int(x) for x in split_list(args.seeds)]
    plan = expand_grid(
        topology=topology,
        partitions=partitions,
        nodes=nodes,
        methods=methods,
        defences=defences,
        attacks=attacks,
        fractions=fractions,
        seeds=seeds,
        rounds=rounds,
        is_centralized=lambda m: issubclass(get_algorithm(m), CentralizedAlgorithm),
        attacker_nodes=attacker_nodes,
        train_per_node=args.train_per_node,
        extra=extra,
        reference=not args.no_reference,
        reference_defence=args.reference_defence,
    )
    return plan, topology, base


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grid", choices=sorted(GRIDS), default="fmnist", help="preset (fmnist)")
    ap.add_argument("--topology", help="base topology (default: the grid's)")
    ap.add_argument("--data-root", default="../shared/data", help="sets dataset.root")
    ap.add_argument("--partitions", help="e.g. 0.5,0.1 (Dirichlet alphas) or dirichlet(0.5)")
    ap.add_argument("--nodes", type=int, help="node count")
    ap.add_argument("--fractions", help="malicious fractions, e.g. 0,0.1,0.2,0.3 (0: clean)")
    ap.add_argument("--attacker-nodes", help="these attackers instead of fractions, e.g. n3")
    ap.add_argument("--methods", help="comma-separated methods")
    ap.add_argument("--attacks", help=f"comma-separated, of: {', '.join([CLEAN, *ATTACKS])}")
    ap.add_argument("--defences", help=f"comma-separated, of: {', '.join(DEFENCES)}")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    ap.add_argument("--train-per-node", type=int, help="shrink each node's training shard")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--nodes-per-process", type=int, help="default: about one process a core")
    ap.add_argument("--reference-defence", help="Δ vs the clean run of this defence")
    ap.add_argument("--no-reference", action="store_true", help="no clean references")
    ap.add_argument("--out", default="runs/bench_robust", help="run directories go here")
    ap.add_argument("--json", default="results/bench_robust.json")
    ap.add_argument("--dry-run", action="store_true", help="list the runs, run nothing")
    args = ap.parse_args(argv)
    console = Console()
    try:
        plan, topology, base = build_plan(args)
    except ValueError as exc:
        ap.error(str(exc))
    path = Path(args.json)
    doc = load_results(path)
    done = done_keys(doc)
    todo = [s for s in plan if run_key(s) not in done]
    if args.dry_run:
        invalid = 0
        for i, s in enumerate(plan, 1):
            mark = "done" if run_key(s) in done else "todo"
            try:  # every run's topology is built and validated, so a bad one shows now
                config_of(s, args)
            except Exception as exc:
                invalid += 1
                mark = f"INVALID: {exc}"
            console.print(
                f"{i:4d} [{mark}] {s['method']} {s['partition']} defence={s['defence']} "
                f"attack={s['attack']} fraction={fraction_label(s)} nodes={s['nodes']} "
                f"rounds={s['rounds']} seed={s['seed']} -> {run_dir_of(Path(args.out), s)}",
                highlight=False,
                markup=False,
                soft_wrap=True,
            )
        console.print(
            f"{len(plan)} runs, {len(todo)} to do, {len(plan) - len(todo)} done"
            + (f", {invalid} invalid" if invalid else ""),
            highlight=False,
        )
        return 1 if invalid else 0
    cfg0 = load_topology(ROOT / topology, list(args.set))
    doc.setdefault("commands", []).append(shlex.join(["python", *sys.argv]))
    doc["machine"] = machine_of(cfg0.training.device)
    doc["definitions"] = DEFINITIONS
    doc["targeted"] = {"source": SOURCE_CLASS, "target": TARGET_CLASS}
    doc["attacks"] = ATTACKS
    console.print(f"{len(plan)} runs, {len(todo)} to do ({len(plan) - len(todo)} in {path})")
    failures = 0
    for i, s in enumerate(todo, 1):
        label = (
            f"[{i}/{len(todo)}] {s['method']} {s['partition']} {s['defence']} "
            f"{s['attack']} {fraction_label(s)} seed {s['seed']}"
        )
        try:
            result = one_run(s, args, console)
        except Exception as exc:  # one bad run must not lose the others
            failures += 1
            console.print(f"[red]{label}: failed: {exc!r}[/]")
            continue
        doc["runs"] = [r for r in doc["runs"] if r["key"] != result["key"]] + [result]
        finish(doc, path, args.reference_defence)
        m = result["metrics"]
        console.print(
            f"{label}: honest acc {_pct(m['acc_mean'], 2)} (worst {_pct(m['acc_worst'], 2)}), "
            f"false rej {_pct(m['false_rejection'])}%, {result['wall_s']:.0f} s",
            highlight=False,
        )
    medians = finish(doc, path, args.reference_defence)
    wanted = {run_key({k: v for k, v in s.items() if k != "seed"}) for s in plan}
    rows = [r for r in medians if r["key"] in wanted]
    title = f"robustness: {topology} (honest nodes; medians over seeds)"
    console.print(render(rows, title))
    console.print(f"wrote {path}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
