"""The dashboard's view of a run: the run directory's records and the broker's live state
merged into the JSON object ``/api/state`` returns (and the page draws).

A node's state, first match wins:

1. its presence is ``done``, or ``offline`` after the last round (its records or its
   presence's ``round`` say so): ``done``;
2. its presence is ``offline``: ``offline``;
3. its presence is ``online``: its latest phase (``training``, ``waiting``,
   ``aggregating``, ``evaluating``), or ``online`` before the first;
4. no presence heard (no broker, or the node never connected): ``done`` when it recorded
   the last round, ``offline`` when the run is finished without it, else ``unknown``.

Robustness (docs/design.md, "Robust aggregation"), from each node's latest record: per
node ``rejected`` (peer -> reason, this round's refusals), ``distrusted`` (peer -> the
first round it is drawn again), ``capped`` (peer -> the sample count it claimed),
``attack`` (the attack kinds it ran, only on an attacker's node), ``diverged`` (None, or
``{merged_from, rolled_back_to}``) and ``rollbacks`` (so far); ``edge_flags``: the
topology's edges either end distrusts or refused the other on, with who, until when and
the last reason; ``refusals``: the peers refused so far over every record. Records of
older runs carry none of it: no flags.

Every number in the snapshot is finite (JSON has no NaN).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Any

from p2pfl.dashboard.layout import edges, positions
from p2pfl.dashboard.live import LiveState
from p2pfl.dashboard.runstate import Robustness, RunState, finite

SCHEMA = 1
PULL_WINDOW_S = 10.0  # pull events sent to the page (it lights each for ~2 s)
DECISION_ROUNDS = 30  # UA-PDFL decisions of the latest rounds sent to the page


_geometry_cache: list[tuple[Any, dict[str, tuple[float, float]], list[list[str]]]] = []


def _geometry(cfg: Any) -> tuple[dict[str, tuple[float, float]], list[list[str]]]:
    """Positions and edges of ``cfg``'s graph, computed once per loaded config."""
    entry = _geometry_cache[0] if _geometry_cache else None
    if entry is None or entry[0] is not cfg:
        entry = (cfg, positions(cfg), [list(e) for e in edges(cfg)])
        _geometry_cache[:] = [entry]
    return entry[1], entry[2]


def _clean(obj: Any, depth: int = 0) -> Any:
    """``obj`` with every non-finite float as None (JSON-safe), nested at most 8 deep."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if depth > 8:
        return None
    if isinstance(obj, dict):
        return {str(k): _clean(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v, depth + 1) for v in obj]
    return obj


def _ids(value: Any, known: set[str]) -> list[str]:
    """The known node ids in a record's list field (anything else is dropped)."""
    if not isinstance(value, list):
        return []
    return [v for v in value if isinstance(v, str) and v in known]


def node_state(run: RunState, live: LiveState | None, node_id: str) -> str:
    """The state the page colours ``node_id`` by (the module docstring's rules)."""
    rounds = run.cfg.rounds if run.cfg is not None else 0
    complete = rounds > 0 and run.last_round(node_id) >= rounds
    pres = live.presence.get(node_id) if live is not None else None
    if pres is not None:
        finished = complete or (rounds > 0 and (pres.round or 0) >= rounds)
        if pres.status == "done" or (pres.status == "offline" and finished):
            return "done"
        if pres.status == "offline":
            return "offline"
        phase = live.phases.get(node_id) if live is not None else None
        return phase.phase if phase is not None else "online"
    if complete:
        return "done"
    return "offline" if run.finished else "unknown"


def _kind(run: RunState) -> str | None:
    """``centralized`` when records name an aggregator, ``decentralized`` when they hold
    a round's chosen peers, None before any record (p2pfl/rounds/rotation/centralized.py and
    p2pfl/rounds/gossip/decentralized.py write them)."""
    recs = [rec for nid_recs in run.records.values() for rec in nid_recs[-1:]]
    if any("aggregator" in rec for rec in recs):
        return "centralized"
    if any("chosen" in rec for rec in recs):
        return "decentralized"
    return None


def _aggregators(run: RunState, known: set[str]) -> list[dict[str, Any]]:
    """Each round's aggregator: the one most of that round's records name."""
    votes: dict[int, Counter[str]] = {}
    for recs in run.records.values():
        for rec in recs:
            agg = rec.get("aggregator")
            if isinstance(agg, str) and agg in known:
                votes.setdefault(rec["round"], Counter())[agg] += 1
    out = []
    for r, counter in sorted(votes.items()):
        agg, _ = counter.most_common(1)[0]
        attempts = {
            rec.get("attempt")
            for recs in run.records.values()
            for rec in recs
            if rec["round"] == r and isinstance(rec.get("attempt"), int)
        }
        out.append({"round": r, "node": agg, "attempt": max(attempts, default=0)})
    return out


def _decisions(run: RunState, known: set[str]) -> list[dict[str, Any]]:
    """UA-PDFL's choices per round and node (docs/algorithms.md, "UA-PDFL"): client-wise
    dropout (``dropout``, and whose whole model it adopted, ``dropout_peer``) or layer-wise
    personalization (``g`` from every peer pulled, ``h`` only from ``h_peers``; the last
    two are the method's facts, which :func:`~p2pfl.dashboard.runstate.kept_fields` takes
    from a record's ``method`` map or an older run's top level). Empty for methods that
    record none of them."""
    rows = []
    for nid in run.node_ids:
        for rec in run.records.get(nid, []):
            if "dropout_peer" not in rec and "h_peers" not in rec:
                continue
            pulled = rec.get("pulled") if isinstance(rec.get("pulled"), dict) else {}
            peer = rec.get("dropout_peer")
            rows.append(
                {
                    "round": rec["round"],
                    "node": nid,
                    "dropout": rec.get("dropout") is True,
                    "dropout_peer": peer if isinstance(peer, str) and peer in known else None,
                    "h_peers": _ids(rec.get("h_peers"), known),
                    "pulled": {
                        p: part
                        for p, part in pulled.items()
                        if p in known and isinstance(part, str) and len(part) <= 32
                    },
                }
            )
    if not rows:
        return []
    last = max(r["round"] for r in rows)
    return [r for r in rows if r["round"] > last - DECISION_ROUNDS]


def _last_pulls(run: RunState, known: set[str]) -> list[dict[str, Any]]:
    """The pulls of each node's latest record: the edges weights moved on last."""
    out = []
    for nid in run.node_ids:
        recs = run.records.get(nid)
        if not recs:
            continue
        rec = recs[-1]
        pulled = rec.get("pulled") if isinstance(rec.get("pulled"), dict) else {}
        for peer, part in sorted(pulled.items()):
            if peer in known and peer != nid and isinstance(part, str) and len(part) <= 32:
                out.append({"from": peer, "to": nid, "part": part, "round": rec["round"]})
    return out


def _robust_fields(rob: Robustness | None) -> dict[str, Any]:
    """A node's robustness facts for the page (the module docstring)."""
    if rob is None:
        rob = Robustness()
    out: dict[str, Any] = {
        "rejected": dict(rob.rejected),
        "distrusted": dict(rob.distrusted),
        "capped": dict(rob.capped),
        "diverged": rob.diverged,
        "rollbacks": rob.rollbacks,
    }
    if rob.attack is not None:
        out["attack"] = list(rob.attack)
    return out


def _edge_flags(run: RunState, edge_list: list[list[str]]) -> list[dict[str, Any]]:
    """The edges on which either end distrusts the other, or refused it in its latest
    record: ``{"edge": [a, b], "distrusted": bool, "refused": [{"by", "peer", "until"
    (the round it is drawn again; None: not distrusted), "round", "reason" (its last
    refusal of the peer, None: none recorded), "now" (refused in the latest record)}]}``."""
    out = []
    for a, b in edge_list:
        refused = []
        for by, peer in ((a, b), (b, a)):
            rob = run.robust.get(by)
            if rob is None or (peer not in rob.distrusted and peer not in rob.rejected):
                continue
            last = rob.last_refused.get(peer)
            refused.append(
                {
                    "by": by,
                    "peer": peer,
                    "until": rob.distrusted.get(peer),
                    "round": last[0] if last else None,
                    "reason": last[1] if last else None,
                    "now": peer in rob.rejected,
                }
            )
        if refused:
            distrusted = any(x["until"] is not None for x in refused)
            out.append({"edge": [a, b], "distrusted": distrusted, "refused": refused})
    return out


def _privacy_fields(run: RunState, nid: str) -> dict[str, Any]:
    """Under ``privacy.dp``: the node's ``epsilon`` after its last recorded round and
    whether its budget is spent (``dp_exhausted``); nothing for a run without DP."""
    eps = run.series(nid, "epsilon")
    if not eps:
        return {}
    recs = run.records.get(nid, [])
    spent = any(rec.get("dp_exhausted") is True for rec in recs)
    return {"epsilon": eps[-1][1], "dp_exhausted": spent}


def _series(run: RunState, key: str, scale: float = 1.0) -> dict[str, Any]:
    def pts(values: list[tuple[int, float]]) -> list[list[float]]:
        return [[r, round(v * scale, 6)] for r, v in values]

    return {
        "nodes": {nid: pts(run.series(nid, key)) for nid in run.node_ids},
        "mean": pts(run.mean_by_round(key)),
    }


def _summary(run: RunState) -> dict[str, Any] | None:
    s = run.summary
    if not run.finished or s is None:
        return None
    final = s.get("final") if isinstance(s.get("final"), dict) else {}
    return _clean(
        {
            "nodes_completed": s.get("nodes_completed"),
            "nodes": s.get("nodes"),
            "wall_s": finite(s.get("wall_s")),
            "acc_mean": finite(final.get("acc_mean")),
            "acc_std": finite(final.get("acc_std")),
            "best_acc_mean": finite(s.get("best_acc_mean")),
            "bytes_sent_total": s.get("bytes_sent_total"),
        }
    )


def build_snapshot(
    run: RunState,
    live: LiveState | None,
    *,
    broker: str | None = None,
    broker_note: str = "",
    now: float | None = None,
) -> dict[str, Any]:
    """The whole page's data. ``broker`` is the address observed (None: records only) and
    ``broker_note`` why, when there is none."""
    now = time.time() if now is None else now
    cfg = run.cfg
    known = set(run.node_ids)
    base: dict[str, Any] = {
        "schema": SCHEMA,
        "time": now,
        "run_dir": str(run.run_dir),
        "version": run.version,
        "broker": {
            "address": broker,
            "connected": bool(live is not None and live.connected),
            "note": live.note if live is not None and broker else broker_note,
            "dropped": dict(live.dropped) if live is not None else {},
        },
    }
    if cfg is None:
        return {**base, "status": run.config_error or "waiting for config.yaml", "nodes": []}
    pos, edge_list = _geometry(cfg)
    nodes = []
    for nid in cfg.node_ids:
        series = run.series(nid, "test_acc")
        phase = live.phases.get(nid) if live is not None else None
        nodes.append(
            {
                "id": nid,
                "x": pos[nid][0],
                "y": pos[nid][1],
                "state": node_state(run, live, nid),
                "round": run.last_round(nid),
                "acc": series[-1][1] if series else None,
                "phase_round": phase.round if phase is not None else None,
                **_robust_fields(run.robust.get(nid)),
                **_privacy_fields(run, nid),
            }
        )
    pulls = []
    if live is not None:
        t_live = live.clock()
        for p in live.recent_pulls(PULL_WINDOW_S):
            pulls.append(
                {
                    "seq": p.seq,
                    "age_s": round(t_live - p.at, 3),
                    "from": p.src,
                    "to": p.dst,
                    "part": p.part,
                    "bytes": p.nbytes,
                    "round": p.round,
                }
            )
    kind = _kind(run)
    current_agg = None
    if kind == "centralized" and live is not None:
        busy = [n["id"] for n in nodes if n["state"] == "aggregating"]
        current_agg = busy[0] if len(busy) == 1 else None
    return _clean(
        {
            **base,
            "status": "finished" if run.finished else "running",
            "swarm": cfg.name,
            "algorithm": cfg.algorithm.name,
            "kind": kind,
            "rounds": cfg.rounds,
            "nodes": nodes,
            "edges": edge_list,
            "edge_flags": _edge_flags(run, edge_list),
            "refusals": run.refusals,
            "series": {
                "acc": _series(run, "test_acc"),
                "mb_sent": _series(run, "bytes_sent", 1e-6),
                "round_s": _series(run, "round_s"),
            },
            "aggregators": _aggregators(run, known),
            "current_aggregator": current_agg,
            "decisions": _decisions(run, known),
            "pulls": pulls,
            "last_pulls": _last_pulls(run, known),
            "summary": _summary(run),
        }
    )
