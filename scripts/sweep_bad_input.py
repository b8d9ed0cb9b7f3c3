"""Bad-input sweep: run ``p2pfl validate``, ``swarm`` and ``node`` on bad input, as a user
would, and classify what each prints.

Each case writes its own files into a scratch directory (a topology with one thing wrong,
a corrupt data file, a binary file, a bad flag, ...), runs the real command line
(``python -m p2pfl.cli``) with a timeout, and classifies the outcome:

- ``clean``: a non-zero exit, no traceback, and the output names what the case expects:
  the file (the topology, the node file or the data file) and the field or flag at fault;
- ``traceback``: a Python traceback was printed;
- ``vague``: a non-zero exit without a traceback, but the output does not say what and
  where (one of the expected names is missing);
- ``late``: ``swarm`` failed only after starting its broker or nodes (the checks must run
  before anything starts);
- ``hang`` / ``zero-exit``: the command ran past the timeout, or accepted the bad input.

A few ``control`` cases (valid input) must exit 0, so that a harness that fails every
command cannot pass. Prints a table and writes ``results/sweep_bad_input.json``.

    python scripts/sweep_bad_input.py [--jobs 2] [--only SUBSTRING] [--timeout 120]

The exit status is 0 when every bad case is clean and every control passes.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
DELETE = object()

BASE: dict[str, Any] = {
    "name": "sweep",
    "seed": 0,
    "rounds": 2,
    "algorithm": {"name": "fedavg"},
    "dataset": {
        "name": "synthetic",
        "partition": "iid",
        "num_classes": 4,
        "input_shape": [1, 8, 8],
        "synthetic_train": 200,
        "synthetic_test": 100,
    },
    "model": {"name": "mlp", "hidden": 16},
    "training": {"epochs": 1, "batch_size": 20},
    "nodes": ["a", "b", "c", "d"],
    "edges": "ring",
    "timing": {"round_timeout_s": 10, "startup_timeout_s": 10, "linger_s": 1},
}
OWN_DATA = {
    "dataset": {
        "name": "csv",
        "root": "data/{id}.csv",
        "partition": "none",
        "label": "label",
        "classes": 2,
    },
}
USER_MODELS = """
from torch import nn


def mlp(num_classes, input_shape):
    return nn.Sequential(nn.Linear(input_shape[0], 8), nn.ReLU(), nn.Linear(8, num_classes))
"""
PNG = bytes.fromhex(  # a 1x1 grey PNG
    "89504e470d0a1a0a0000000d49484452000000010000000108000000003a7e9b55"
    "0000000a49444154789c636800000082008177cd72b60000000049454e44ae426082"
)
GOOD_CSV = "age,dose,label\n1.0,2.0,0\n2.0,1.0,1\n3.0,0.5,0\n4.0,3.0,1\n5.0,1.5,0\n6.0,1.0,1\n"


@dataclass
class Case:
    """One bad command: ``argv`` after ``p2pfl``; ``expect``: what its output must name."""

    name: str
    argv: list[str]
    expect: list[str]
    control: bool = False  # valid input: must exit 0

    @property
    def command(self) -> str:
        return self.argv[0]


@dataclass
class Result:
    name: str
    command: str
    argv: list[str]
    outcome: str
    code: int | None
    seconds: float
    missing: list[str] = field(default_factory=list)
    message: str = ""


class Workspace:
    """The scratch directory the cases write their files into."""

    def __init__(self, root: Path):
        self.root = root
        (root / "data").mkdir()
        for node in ("a", "b", "c", "d"):
            (root / "data" / f"{node}.csv").write_text(GOOD_CSV)
        (root / "sweep_models.py").write_text(USER_MODELS)
        self._runs = 0

    @property
    def run(self) -> Path:
        """A fresh run directory for each command (cases run in parallel)."""
        self._runs += 1
        return self.root / f"run-{self._runs}"

    def topology(self, slug: str, changes: dict[str, Any] | None = None, base=None) -> str:
        """``BASE`` (or ``base``) with dotted ``changes`` (``DELETE`` removes a key),
        written to ``<slug>.yaml``; returns its path."""
        cfg = copy.deepcopy(base if base is not None else BASE)
        for dotted, value in (changes or {}).items():
            *parents, key = dotted.split(".")
            cur = cfg
            for p in parents:
                cur = cur.setdefault(p, {})
            if value is DELETE:
                cur.pop(key, None)
            else:
                cur[key] = value
        path = self.root / f"{slug}.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return str(path)

    def own(self, slug: str, changes: dict[str, Any] | None = None) -> str:
        """A topology on the nodes' own CSV files (``data/<id>.csv``) and a user model."""
        base = {**copy.deepcopy(BASE), **copy.deepcopy(OWN_DATA)}
        base["model"] = {"name": "sweep_models:mlp"}
        return self.topology(slug, changes, base)

    def raw(self, name: str, content: bytes | str) -> str:
        path = self.root / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return str(path)

    def swarm(self, path: str, *more: str) -> list[str]:
        return ["swarm", path, "--out", str(self.run), "--no-progress", *more]

    def node(self, path: str, *more: str) -> list[str]:
        if "--id" not in more and "--node-config" not in more:
            more = ("--id", "a", *more)
        return ["node", path, "--out", str(self.run), "--broker", "127.0.0.1:1", "--no-rich", *more]


def make_cases(ws: Workspace) -> list[Case]:
    t, own, raw = ws.topology, ws.own, ws.raw
    binary = bytes(range(128, 256)) * 8
    cases: list[Case] = []

    def add(name: str, argv: list[str], *expect: str, control: bool = False) -> None:
        cases.append(Case(name, argv, list(expect), control))

    # ---- controls: valid input must pass
    add("control: validate", ["validate", t("control")], "ok", control=True)
    add("control: validate own data", ["validate", own("control-own")], "ok", control=True)

    # ---- the file itself
    missing = str(ws.root / "nope.yaml")
    add("missing file (validate)", ["validate", missing], missing, "cannot read")
    add("missing file (swarm)", ws.swarm(missing), missing, "cannot read")
    add("missing file (node)", ws.node(missing), missing, "cannot read")
    add("a directory (validate)", ["validate", str(ws.root / "data")], "data", "directory")
    p = raw("empty.yaml", "")
    add("empty file (validate)", ["validate", p], p, "name", "nodes")
    p = raw("binary.yaml", binary)
    add("binary file (validate)", ["validate", p], p, "not a text file")
    add("binary file (swarm)", ws.swarm(p), p, "not a text file")
    add("binary file (node)", ws.node(p), p, "not a text file")
    p = raw("list.yaml", "- a\n- b\n")
    add("YAML list at top (validate)", ["validate", p], p, "mapping")
    p = raw("scalar.yaml", "42\n")
    add("YAML scalar at top (swarm)", ws.swarm(p), p, "mapping")
    p = raw("broken.yaml", "name: x\nnodes: [a, b\nrounds: 3\n")
    add("invalid YAML (validate)", ["validate", p], p, "invalid YAML", "line")
    p = raw("nul.yaml", "name: x\x00\nnodes: 2\n")
    add("NUL byte in text (validate)", ["validate", p], p, "invalid YAML")
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
    for i, prev in zip("bcdefgh", "abcdefg", strict=True):
        bomb += f"{i}: &{i} [{', '.join([f'*{prev}'] * 10)}]\n"
    p = raw("bomb.yaml", bomb + "name: x\nnodes: 2\n")
    add("YAML alias bomb (validate)", ["validate", p], p, "aliases")

    # ---- the schema: unknown fields, wrong types, out of range
    p = t("unknown-top", {"round": 3})
    add("unknown top-level field", ["validate", p], p, "round", "unknown field", "'rounds'?")
    p = t("unknown-nested", {"training.epoch": 3})
    add(
        "unknown nested field (swarm)",
        ws.swarm(p),
        p,
        "training.epoch",
        "unknown field",
        "did you mean 'epochs'?",
    )
    p = t("rounds-type", {"rounds": "five"})
    add("rounds not a number", ["validate", p], p, "rounds")
    p = t("nodes-type", {"nodes": {"a": 1}})
    add("nodes a mapping (node)", ws.node(p), p, "nodes")
    p = t("nodes-zero", {"nodes": 0})
    add("nodes: 0", ["validate", p], p, "nodes")
    p = t("nodes-huge", {"nodes": 100_000_000})
    add("nodes: 100000000 (validate)", ["validate", p], p, "nodes", "bound")
    add("nodes: 100000000 (swarm)", ws.swarm(p), p, "nodes", "bound")
    add("nodes: 100000000 (node)", ws.node(p), p, "nodes", "bound")
    p = t("nodes-dup", {"nodes": ["a", "b", "a"]})
    add("duplicate node ids", ["validate", p], p, "nodes", "duplicate")
    p = t("edges-unknown", {"edges": [["a", "z"]]})
    add("edge to an unknown node", ["validate", p], p, "edges", "'z'")
    p = t("edges-full-huge", {"nodes": 5000, "edges": "full"})
    add("full graph over 5000 nodes", ["validate", p], p, "edges", "bound")
    p = t("rounds-huge", {"rounds": 10**12})
    add("rounds: 10^12 (swarm)", ws.swarm(p), p, "rounds")
    p = t("epochs-huge", {"training.epochs": 10**9})
    add("training.epochs: 10^9", ["validate", p], p, "training.epochs")
    p = t("batch-zero", {"training.batch_size": 0})
    add("training.batch_size: 0 (node)", ws.node(p), p, "training.batch_size")
    p = t("lr-nan", {"training.lr": float("nan")})
    add("training.lr: .nan", ["validate", p], p, "training.lr")
    p = t("timeout-inf", {"timing.round_timeout_s": float("inf")})
    add("timing.round_timeout_s: .inf (swarm)", ws.swarm(p), p, "timing.round_timeout_s")
    p = t("hidden-huge", {"model.hidden": 10**9})
    add("model.hidden: 10^9", ["validate", p], p, "model.hidden")
    p = t("synthetic-huge", {"dataset.synthetic_train": 10**12})
    add("dataset.synthetic_train: 10^12 (swarm)", ws.swarm(p), p, "synthetic_train")
    p = t("shape-huge", {"dataset.input_shape": [1, 100000, 100000]})
    add("dataset.input_shape too large", ["validate", p], p, "input_shape")
    p = t("shape-empty", {"dataset.input_shape": []})
    add("dataset.input_shape: []", ["validate", p], p, "input_shape")
    p = t("partition-bad", {"dataset.partition": "dirichlet(-1)"})
    add("dirichlet(-1)", ["validate", p], p, "dataset.partition")
    p = t("dataset-unknown", {"dataset.name": "imagenet22k"})
    add("unknown dataset (node)", ws.node(p), p, "dataset.name", "imagenet22k")
    p = t("model-unknown", {"model.name": "gpt"})
    add("unknown model", ["validate", p], p, "model.name", "gpt")
    p = t("method-typo", {"algorithm.name": "fedavgg"})
    add("mistyped method", ["validate", p], p, "algorithm", "did you mean 'fedavg'")
    p = t("method-unknown", {"algorithm.name": "fedmagic"})
    add("unknown method (swarm)", ws.swarm(p), p, "algorithm", "fedmagic")
    p = t("knob-unknown", {"algorithm.params": {"frac": 0.5}})
    add("unknown method knob", ["validate", p], p, "params.frac")
    p = t("knob-huge", {"algorithm.name": "uapdfl", "algorithm.params": {"com": 10**9}})
    add("uapdfl com: 10^9", ["validate", p], p, "params.com")
    p = t("seed-negative", {"seed": -1})
    add("seed: -1 (node)", ws.node(p), p, "seed")
    p = t("broker-bad", {"broker": "nohost"})
    add("broker without a port", ["validate", p], p, "broker")
    p = t("device-bad", {"training.device": "gpu9"})
    add("training.device: gpu9 (swarm)", ws.swarm(p), p, "training.device", "gpu9")
    p = t("device-absent", {"training.device": "cuda:7"})
    add("training.device: cuda:7 (swarm)", ws.swarm(p), p, "training.device", "cuda:7")
    p = t("message-huge", {"max_message_mb": 100000})
    add("max_message_mb: 100000", ["validate", p], p, "max_message_mb")

    # ---- privacy, secure aggregation, timing, security, defence, attacks
    p = t("dp-both", {"privacy": {"dp": {"noise_multiplier": 1.0, "target_epsilon": 8}}})
    add("privacy.dp: noise and target", ["validate", p], p, "privacy.dp")
    p = t("dp-delta", {"privacy": {"dp": {"noise_multiplier": 1.0, "delta": 2}}})
    add("privacy.dp.delta: 2 (swarm)", ws.swarm(p), p, "privacy.dp.delta")
    p = t("dp-rounds-huge", {"privacy": {"dp": {"target_epsilon": 8, "rounds": 10**9}}})
    add("privacy.dp.rounds: 10^9", ["validate", p], p, "privacy.dp.rounds")
    p = t("secagg-decentral", {"algorithm.name": "uapdfl", "privacy": {"secagg": True}})
    add("secagg with a decentralized method", ["validate", p], p, "privacy.secagg")
    p = t("secagg-two", {"nodes": ["a", "b"], "defence.rule": "mean", "privacy": {"secagg": True}})
    add("secagg with 2 nodes (swarm)", ws.swarm(p), p, "nodes", "at least 3")
    p = t("secagg-k-huge", {"privacy": {"secagg": True, "secagg_neighbours": 10**8}})
    add("secagg_neighbours: 10^8", ["validate", p], p, "privacy.secagg_neighbours")
    p = t("quorum-decentral", {"algorithm.name": "uapdfl", "timing.quorum": 0.5})
    add("timing.quorum with uapdfl (swarm)", ws.swarm(p), p, "timing.quorum")
    p = t("async-central", {"timing.mode": "async"})
    add("timing.mode: async with fedavg (node)", ws.node(p), p, "timing.mode")
    p = t("staleness-huge", {"timing.max_staleness": 10**12})
    add("timing.max_staleness: 10^12", ["validate", p], p, "timing.max_staleness")
    p = t("max-age-zero", {"security": {"sign": True, "max_age_s": 0}})
    add("security.max_age_s: 0", ["validate", p], p, "security.max_age_s")
    p = t("bulyan-small", {"defence": {"rule": "bulyan", "f": 1}})
    add("bulyan on 4 nodes (swarm)", ws.swarm(p), p, "defence.rule")
    p = t("attack-unknown", {"attacks": [{"kind": "scale", "nodes": ["zz"]}]})
    add("attack on an unknown node", ["validate", p], p, "attacks[0].nodes", "zz")

    # ---- the data and the model (the checks swarm and node must run before starting)
    gone = str(ws.root / "no-such-dir")
    p = t("root-missing", {"dataset.name": "fashionmnist", "dataset.root": gone})
    add("missing data root (validate)", ["validate", p], p, "dataset.root", gone)
    add("missing data root (swarm)", ws.swarm(p), p, "dataset.root", gone)
    add("missing data root (node)", ws.node(p), p, "dataset.root", gone)
    fm = ws.root / "fmnist" / "FashionMNIST" / "raw"
    fm.mkdir(parents=True)
    for name in (
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    ):
        (fm / name).write_bytes(b"\x00\x01garbage" * 7)
    p = t("fmnist-corrupt", {"dataset.name": "fashionmnist", "dataset.root": str(fm.parents[1])})
    add("corrupt Fashion-MNIST files (validate)", ["validate", p], p, "dataset.root")
    add("corrupt Fashion-MNIST files (swarm)", ws.swarm(p), p, "dataset.root")
    zip_path = raw("garbage.zip", b"PK\x03\x04" + os.urandom(2048))
    p = t("zip-garbage", {"dataset.name": "imagefolder", "dataset.root": zip_path})
    add("garbage zip (validate)", ["validate", p], p, "dataset.root", "garbage.zip")
    add("garbage zip (swarm)", ws.swarm(p), p, "dataset.root", "garbage.zip")
    add("garbage zip (node)", ws.node(p), p, "dataset.root", "garbage.zip")
    good_zip = ws.root / "one-class.zip"
    with zipfile.ZipFile(good_zip, "w") as zf:
        for split in ("train", "test"):
            for cls in ("cat", "dog"):
                zf.writestr(f"{split}/{cls}/{cls}.png", PNG)
        zf.writestr("train/cat/broken.png", b"not a png at all")
    p = t("zip-bad-image", {"dataset.name": "imagefolder", "dataset.root": str(good_zip)})
    add("zip with a corrupt image (swarm)", ws.swarm(p), p, "dataset.root", "broken.png")
    npz = ws.root / "npz"
    npz.mkdir()
    for node in "abcd":
        (npz / f"{node}.npz").write_bytes(os.urandom(512))
    p = own("npz-corrupt", {"dataset.name": "npz", "dataset.root": str(npz / "{id}.npz")})
    add("corrupt npz own data (validate)", ["validate", p], p, "dataset.root", "a.npz")
    add("corrupt npz own data (node)", ws.node(p, "--id", "c"), p, "dataset.root", "c.npz")
    p = own("csv-label", {"dataset.label": "outcome"})
    add("CSV without the label column (swarm)", ws.swarm(p), p, "dataset.label", "outcome")
    p = t("shape-cnn", {"model.name": "cnn", "dataset.input_shape": [1, 2, 2]})
    add(
        "input shape the model cannot take (validate)",
        ["validate", p],
        p,
        "model.name",
        "[1, 2, 2]",
    )
    add("input shape the model cannot take (swarm)", ws.swarm(p), p, "model.name", "[1, 2, 2]")
    add("input shape the model cannot take (node)", ws.node(p), p, "model.name", "[1, 2, 2]")
    p = own("user-model-missing", {"model.name": "sweep_modelz:mlp"})
    add("user model that does not import (swarm)", ws.swarm(p), p, "model.name", "sweep_modelz")

    # ---- command-line flags
    good = t("flags")
    add("--set without '=' (validate)", ["validate", good, "--set", "rounds"], good, "--set")
    add("--set nodes=100000000 (swarm)", ws.swarm(good, "--set", "nodes=100000000"), good, "nodes")
    add("--set on a scalar (validate)", ["validate", good, "--set", "rounds.x=1"], good, "rounds")
    add("--rounds 0 (swarm)", ws.swarm(good, "--rounds", "0"), "--rounds")
    add("--rounds abc (swarm)", ws.swarm(good, "--rounds", "abc"), "--rounds", "abc")
    add("--timeout -1 (swarm)", ws.swarm(good, "--timeout", "-1"), "--timeout")
    add(
        "--nodes-per-process 0 (swarm)",
        ws.swarm(good, "--nodes-per-process", "0"),
        "--nodes-per-process",
    )
    add("--broker nonsense (swarm)", ws.swarm(good, "--broker", "nonsense"), "--broker", "nonsense")
    add("--broker-kind foo (swarm)", ws.swarm(good, "--broker-kind", "foo"), "--broker-kind", "foo")
    add(
        "--dashboard-port 70000 (swarm)",
        ws.swarm(good, "--dashboard-port", "70000"),
        "--dashboard-port",
    )
    add("mistyped command", ["swarn", good], "unknown command 'swarn'", "did you mean 'swarm'?")
    add("--method unknown (validate)", ["validate", good, "--method", "fedzzz"], good, "fedzzz")
    add(
        "--data-root missing (validate)",
        ["validate", own("flags-own"), "--data-root", gone],
        "dataset.root",
        gone,
    )
    add("--id unknown (node)", ws.node(good, "--id", "zz"), good, "nodes", "zz")
    add("--broker :99999 (node)", ws.node(good, "--broker", "h:99999"), "--broker")
    add("--device bogus (node)", ws.node(good, "--device", "bogus"), good, "--device", "bogus")
    nc = raw("node-binary.yaml", binary)
    add("--node-config binary (node)", ws.node(good, "--node-config", nc), nc, "not a text file")
    nc = raw("node-unknown.yaml", "id: a\ndata_rot: x\n")
    add("--node-config unknown field (node)", ws.node(good, "--node-config", nc), nc, "data_rot")
    nc = raw("node-broker.yaml", "id: a\nbroker: nohost\n")
    add("--node-config bad broker (node)", ws.node(good, "--node-config", nc), nc, "broker")
    nc = raw("node-threads.yaml", "id: a\nthreads: 100000000\n")
    add("--node-config threads: 10^8 (node)", ws.node(good, "--node-config", nc), nc, "threads")
    return cases


STARTED = re.compile(r"^(broker \S+ on |swarm \S+: \d+ nodes in )", re.M)


def run_case(case: Case, ws: Workspace, timeout: float) -> Result:
    env = {
        **os.environ,
        "COLUMNS": "400",  # rich: one line per message
        "PYTHONPATH": os.pathsep.join([str(ws.root), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "P2PFL_CACHE": str(ws.root / "cache"),  # decoded datasets stay in the scratch dir
    }
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "p2pfl.cli", *case.argv],
        cwd=ws.root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        text=True,
        errors="replace",
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # swarm stops what it started on SIGTERM
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        code = None
    seconds = time.monotonic() - t0
    flat = " ".join(out.split())
    missing = [e for e in case.expect if " ".join(e.split()).lower() not in flat.lower()]
    if code is None:
        outcome = "hang"
    elif case.control:
        outcome = "control-ok" if code == 0 and not missing else "control-failed"
    elif code == 0:
        outcome = "zero-exit"
    elif "Traceback (most recent call last)" in out:
        outcome = "traceback"
    elif case.command == "swarm" and STARTED.search(out):
        outcome = "late"
    elif missing:
        outcome = "vague"
    else:
        outcome = "clean"
    return Result(case.name, case.command, case.argv, outcome, code, seconds, missing, message(out))


def message(out: str) -> str:
    """The line a user reads first: the first error line, else the last line."""
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    for ln in lines:
        if "error" in ln.lower() or "Error" in ln:
            return ln
    return lines[-1] if lines else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=2, help="cases run at once (2)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per case (120)")
    ap.add_argument("--only", help="run the cases whose name contains this")
    ap.add_argument("--out", default=str(ROOT / "results" / "sweep_bad_input.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="p2pfl-sweep-") as tmp:
        ws = Workspace(Path(tmp))
        cases = [c for c in make_cases(ws) if not args.only or args.only in c.name]
        t0 = time.monotonic()
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            results = list(pool.map(lambda c: run_case(c, ws, args.timeout), cases))
        wall = time.monotonic() - t0
    counts: dict[str, int] = {}
    for r in results:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    width = max(len(r.name) for r in results)
    print(f"{'case':<{width}}  {'command':<8} {'outcome':<14} {'exit':>4} {'s':>5}  message")
    for r in results:
        text = r.message if len(r.message) <= 110 else r.message[:107] + "..."
        if r.missing:
            text = f"[missing {r.missing}] {text}"
        print(
            f"{r.name:<{width}}  {r.command:<8} {r.outcome:<14} {str(r.code):>4} "
            f"{r.seconds:5.1f}  {text}"
        )
    bad = [r for r in results if not r.outcome.startswith("control")]
    by_command = {
        cmd: sum(r.command == cmd for r in bad) for cmd in sorted({r.command for r in bad})
    }
    print(
        f"\n{len(bad)} bad-input cases ({', '.join(f'{n} {c}' for c, n in by_command.items())}), "
        f"{len(results) - len(bad)} controls, {wall:.0f} s: "
        + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "cases": len(bad),
        "controls": len(results) - len(bad),
        "by_command": by_command,
        "counts": counts,
        "wall_s": round(wall, 1),
        "results": [asdict(r) | {"seconds": round(r.seconds, 2)} for r in results],
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written {out}")
    ok = all(r.outcome in ("clean", "control-ok") for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
