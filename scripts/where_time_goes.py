#!/usr/bin/env python
"""Where a swarm's node processes spend their time: a py-spy raw profile into buckets.

Record a run with py-spy following the launcher's node processes, e.g.::

    py-spy record --nonblocking --subprocesses --rate 50 --format raw -o prof.txt -- \\
        python scripts/bench_scale.py --nodes 1000 --repeats 1

then ``python scripts/where_time_goes.py prof.txt --rate 50 [--json out.json]`` prints, for
each bucket, the seconds of samples (summed over threads: concurrent training threads add
up) and its share. Only stacks under a child process of the profiled command count (the
node processes, not the launcher). A stack goes to the first bucket, in the order below,
one of whose patterns it holds (a tuple of patterns: all of them).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

BUCKETS: list[tuple[str, list[str | tuple[str, ...]]]] = [
    # an import inside a round's training is on that round's clock (an emulated slower
    # device stretches it by 1 / speed): p2pfl.learning.train.load_optimizer_machinery
    ("training: imports", [("train_local (", "_find_and_load (")]),
    ("start-up: reading the data", ["load_arrays (", "load_node_data ("]),
    (
        "start-up: checks (check_model/check_topology)",
        ["check_model (", "check_topology (", "check_inputs ("],
    ),
    ("start-up: model and method", ["Node._load ("]),
    ("start-up: imports", ["_find_and_load ("]),
    ("checkpoint: fingerprint", ["config_fingerprint ("]),
    ("checkpoint: state copy", ["Checkpoint.take ("]),
    ("checkpoint: write (fsync)", ["save_checkpoint ("]),
    ("records (jsonl append)", ["RecordLog.append (", "RecordLog.flush ("]),
    ("training", ["train_local (", "train_private ("]),
    ("after_train (representations)", ["after_train ("]),
    ("evaluation", ["evaluate ("]),
    (
        "merge-before copy",
        ["DecentralizedRounds._merge (p2pfl/rounds/gossip/decentralized.py);Method.checkpoint ("],
    ),
    ("rollback copy", ["LocalTraining._trained (p2pfl/services/training.py);Method.checkpoint ("]),
    ("snapshot copy", ["Method.snapshot ("]),
    ("merge (method, defence)", [".merge (", "._merge ("]),
    ("admission", ["Robustness.admit ("]),
    ("plan (divergences)", [".plan ("]),
    ("wire: status publishes", ["publish_status ("]),
    (
        "wire: encode/decode, publish, receive",
        ["codec.py", "mqtt_lane.py", "paho/", "aiomqtt/", "receive.py", "direct", "exchange.py"],
    ),
]


def bucket(stack: str) -> str:
    """The bucket of one py-spy stack (frames joined by ``;``, line numbers dropped)."""
    for name, patterns in BUCKETS:
        for p in patterns:
            if all(part in stack for part in ((p,) if isinstance(p, str) else p)):
                return name
    if "_worker (concurrent" in stack:
        return "other (worker threads)"
    return "other (event loop, asyncio)"


def where(path: Path, rate: float) -> dict[str, dict[str, float]]:
    """``{bucket: {"cpu_s", "share"}}`` and ``"total"``, from a py-spy raw profile."""
    counts: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if stack.count("process ") < 2:  # the profiled command itself, not a node process
            continue
        counts[bucket(re.sub(r":\d+\)", ")", stack))] += int(n)
    total = sum(counts.values()) or 1
    out = {
        k: {"cpu_s": round(v / rate, 1), "share": round(v / total, 3)}
        for k, v in counts.most_common()
    }
    out["total"] = {"cpu_s": round(total / rate, 1), "share": 1.0}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", type=Path, help="py-spy record --format raw output")
    ap.add_argument("--rate", type=float, default=100.0, help="py-spy's --rate (default 100)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    res = where(args.profile, args.rate)
    for name, v in res.items():
        print(f"{v['cpu_s']:8.1f} s {100 * v['share']:5.1f} %  {name}")
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
