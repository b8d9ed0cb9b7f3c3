#!/usr/bin/env python
"""Serving benchmark (docs/design.md, "A site's own models"): ``POST /v1/predict`` of
``p2pfl serve``, one row per request, on one machine.

For each model, the hospitals example's ``HospitalMLP`` (a patient record as JSON, from the
example's ``data/new-patients.csv``) and the digits example's ``DigitsCNN`` (one 8x8 PNG
image's bytes, from its ``data/holdout/``), with ``--clients`` concurrent clients (default 1
and 16: threads, each with its own keep-alive ``http.client.HTTPConnection``, spread evenly
over ``--client-processes`` client processes, each its own interpreter: 16 threads in one
process wait on one GIL, and that wait, not the server's, showed in the p99):

1. **idle machine**: latency p50 and p99 (ms, request sent to answer read), throughput
   (answers/s over ``--duration`` s, after ``--warmup`` s not counted) and errors (non-200
   or a failed connection: must be 0);
2. **while a training cycle runs**: the same while ``p2pfl swarm`` of an example topology
   (``--train-example``, default digits-cnn: 4 nodes) trains on the same machine at
   ``--train-nice`` (default: ``limits.worker_nice``'s, as a site daemon's workers train) on
   ``--train-cpus`` (default: any; a site's ``limits.worker_cpus``), one swarm
   per repeat for all its under-training windows (``--train-rounds``, default 2000, more
   than the windows need: a digits round takes about 0.1 s here, so a 5-round swarm would
   be mostly start-up and linger, not training; it is stopped after the last window, and
   another started should one end early); the node-rounds it finished inside each window
   are recorded (``--no-training`` skips this).

The models are the script's own: each example's ``make_data.py`` and a short ``p2pfl swarm``
(``--model-rounds`` rounds) in a temp copy of the example, unless ``--models-dir`` holds run
directories ``hospitals/`` and ``digits-cnn/``; each goes into a ``ModelStore`` (node
hospital-a's, node n0's), is promoted, and is served by ``python -m p2pfl serve --site ...
--listen 127.0.0.1:PORT``, a process of its own (server and clients share no GIL), with the
site's ``serving.workers`` (``--workers``) and ``serving.cpus`` (``--serve-cpus``). Also
recorded: the server's CPU ms per answer (``/proc``), and, in this process, the time of the
server's predict path without HTTP (``ModelServer.predict``) and of the model's forward pass
alone, and one client's p50 through a ``ModelServer`` in this process (``http_p50_ms``):
what the rest of the latency is.

Prints a table (model, clients, training, p50 ms, p99 ms, req/s, errors) and writes ``--json``:
every repeat's figures, their medians over ``--repeats``, and the machine (cpu count, torch
version and threads).

    python scripts/bench_serving.py --repeats 3 --duration 10 --json results/serving/bench.json
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import multiprocessing
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pfl.cpu_set import parse_cpus, pin  # noqa: E402
from p2pfl.sites.daemon.site_file import WORKER_NICE  # noqa: E402

HERE = Path(__file__).resolve().parents[1]
SITE_OF = {"hospitals": "hospital-a", "digits-cnn": "n0"}
"""The node whose model each example's site serves (the store's site name)."""
MODELS = ("hospitals", "digits-cnn")


# ----------------------------------------------------------------------------- models
def copy_example(name: str, work: Path) -> Path:
    """A copy of ``examples/NAME`` with its data made (the repository's copy stays clean)."""
    dest = work / "examples" / name
    if not dest.is_dir():
        shutil.copytree(
            HERE / "examples" / name, dest, ignore=shutil.ignore_patterns("runs", "data")
        )
        subprocess.run([sys.executable, "make_data.py"], cwd=dest, check=True, capture_output=True)
    return dest


def swarm_cmd(example: Path, rounds: int, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "p2pfl",
        "swarm",
        str(example / "topology.yaml"),
        "--rounds",
        str(rounds),
        "--out",
        str(out),
        "--no-progress",
    ]


def train(example: Path, rounds: int, out: Path) -> Path:
    t0 = time.monotonic()
    done = subprocess.run(swarm_cmd(example, rounds, out), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"p2pfl swarm {example.name} failed:\n{done.stdout[-3000:]}")
    print(f"trained {example.name}: {rounds} rounds in {time.monotonic() - t0:.1f} s -> {out}")
    return out


def last_round(run: Path, node: str) -> int | None:
    path = run / "nodes" / f"{node}.jsonl"
    with contextlib.suppress(OSError, ValueError, IndexError):
        return json.loads(path.read_text().splitlines()[-1]).get("round")
    return None


def site_file(work: Path, name: str, run: Path, serving: dict) -> Path:
    """A site whose store serves ``run``'s model of the example's node, with ``serving``'s
    fields (``runtime``, ``workers``, ``cpus``)."""
    from p2pfl.sites.models.store import ModelStore

    site = SITE_OF[name]
    root = work / "sites" / name
    store = ModelStore(root / "state", site)
    entry = store.add(run, f"bench-{name}", round_no=last_round(run, site))
    store.promote(entry.id, "bench_serving")
    path = root / "site.yaml"
    body = {
        "site": site,
        "swarm": "bench-serving",
        "state_dir": str(root / "state"),
        "serving": serving,
    }
    path.write_text(yaml.safe_dump(body))
    return path


# ----------------------------------------------------------------------------- requests
def requests_of(name: str, example: Path) -> tuple[str, list[bytes]]:
    """The Content-Type and bodies of one-row requests: a patient record (its label column
    dropped) or one PNG image."""
    if name == "hospitals":
        import pandas as pd

        df = pd.read_csv(example / "data" / "new-patients.csv").drop(columns=["diagnosis"])
        return "application/json", [json.dumps([r]).encode() for r in df.to_dict("records")]
    files = sorted((example / "data" / "holdout").rglob("*.png"))
    return "image/png", [f.read_bytes() for f in files]


# ----------------------------------------------------------------------------- server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m p2pfl serve --site SITE --listen 127.0.0.1:PORT``, until :meth:`stop`."""

    def __init__(self, site: Path, log: Path):
        self.port = free_port()
        self.log = log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "p2pfl",
                    "serve",
                    "--site",
                    str(site),
                    "--listen",
                    f"127.0.0.1:{self.port}",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        t0 = time.monotonic()
        self.model = self._wait_ready(deadline=t0 + 120)
        self.ready_s = time.monotonic() - t0

    def _wait_ready(self, deadline: float) -> dict:
        """Poll ``GET /v1/model`` until it answers 200 (the model is loaded)."""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"p2pfl serve exited {self.proc.returncode}: see {self.log}")
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
            try:
                conn.request("GET", "/v1/model")
                answer = conn.getresponse()
                body = answer.read()
                if answer.status == 200:
                    return json.loads(body)
            except OSError:
                pass
            finally:
                conn.close()
            time.sleep(0.05)
        raise SystemExit(f"p2pfl serve did not answer GET /v1/model: see {self.log}")

    def cpu_s(self) -> float:
        """The server's user + system CPU seconds so far: its process and its workers'
        (``serving.workers``: forked children; the ones that ended count in the
        parent's children fields)."""
        pids = [self.proc.pid]
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        with contextlib.suppress(OSError):
            pids += [int(p) for p in children.read_text().split()]
        ticks = 0
        for pid in pids:
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                ticks += sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
        return ticks / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ----------------------------------------------------------------------------- load
def client(
    port: int,
    content_type: str,
    bodies: list[bytes],
    offset: int,
    start: threading.Barrier,
    t_end: list[float],
    out: list,
) -> None:
    """Send requests on one keep-alive connection until ``t_end``; append (started,
    latency, status) to ``out``, status 0 for a failed connection (then reconnect)."""
    headers = {"Content-Type": content_type}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    records = []
    i = offset
    start.wait()
    end = t_end[0]
    while True:
        t0 = time.perf_counter()
        if t0 >= end:
            break
        body = bodies[i % len(bodies)]
        i += 1
        try:
            conn.request("POST", "/v1/predict", body=body, headers=headers)
            answer = conn.getresponse()
            answer.read()
            status = answer.status
        except (OSError, http.client.HTTPException):
            status = 0
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        records.append((t0, time.perf_counter() - t0, status))
    conn.close()
    out.extend(records)


def client_process(
    port: int,
    content_type: str,
    bodies: list[bytes],
    offsets: list[int],
    ready,
    go,
    t_end,
    results,
) -> None:
    """One client process: a :func:`client` thread per offset in ``offsets``; says
    ``ready``, starts when ``go`` is set, stops at ``t_end.value`` (``time.perf_counter``,
    the system's monotonic clock, the same in every process), puts its records on
    ``results``."""
    start = threading.Barrier(len(offsets) + 1)
    end: list[float] = [0.0]
    out: list = []
    threads = [
        threading.Thread(
            target=client, args=(port, content_type, bodies, off, start, end, out), daemon=True
        )
        for off in offsets
    ]
    for t in threads:
        t.start()
    ready.put(os.getpid())
    go.wait()
    end[0] = t_end.value
    start.wait()
    for t in threads:
        t.join()
    results.put(out)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank) of ``values``."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def measure(
    server: Server,
    content_type: str,
    bodies: list[bytes],
    clients: int,
    duration: float,
    warmup: float,
    processes: int = 1,
) -> dict:
    """``clients`` clients for ``warmup`` + ``duration`` s; figures of the last ``duration``.
    The clients are threads spread evenly over ``processes`` client processes (none of
    them this one), each its own interpreter and GIL."""
    ctx = multiprocessing.get_context("forkserver")
    ready, results = ctx.Queue(), ctx.Queue()
    go, t_end = ctx.Event(), ctx.Value("d", 0.0)
    step = max(1, len(bodies) // clients)
    groups = [list(range(k, clients, processes)) for k in range(min(processes, clients))]
    procs = [
        ctx.Process(
            target=client_process,
            args=(
                server.port,
                content_type,
                bodies,
                [k * step for k in group],
                ready,
                go,
                t_end,
                results,
            ),
            daemon=True,
        )
        for group in groups
    ]
    for proc in procs:
        proc.start()
    for _ in procs:
        ready.get(timeout=120)
    now = time.perf_counter()
    t_count = now + warmup
    t_end.value = now + warmup + duration
    go.set()
    time.sleep(max(0.0, t_count - time.perf_counter()))
    cpu0, wall0 = server.cpu_s(), time.perf_counter()
    out: list = []
    for _ in procs:  # read before joining: a child exits only once its records are taken
        out.extend(results.get(timeout=duration + 120))
    cpu1, wall1 = server.cpu_s(), time.perf_counter()
    for proc in procs:
        proc.join()
    counted = [r for r in out if r[0] >= t_count]
    ok = [lat for _, lat, status in counted if status == 200]
    errors = sum(1 for _, _, status in counted if status != 200)
    return {
        "p50_ms": round(1000 * percentile(ok, 50), 3) if ok else None,
        "p99_ms": round(1000 * percentile(ok, 99), 3) if ok else None,
        "mean_ms": round(1000 * statistics.fmean(ok), 3) if ok else None,
        "req_s": round(len(ok) / duration, 1),
        "requests": len(counted),
        "errors": errors,
        "server_cpu_ms_per_req": round(1000 * (cpu1 - cpu0) / len(ok), 3) if ok else None,
        "server_cpu_share": round((cpu1 - cpu0) / (wall1 - wall0), 3),
        "window": [t_count, t_end.value],
    }


class TrainingLoad:
    """``p2pfl swarm`` of ``example``, ``rounds`` rounds a cycle, restarted whenever one
    ends, from :meth:`start` until :meth:`stop`; each cycle's run goes under ``root``, at
    ``nice`` on ``cpus`` (None: any), as a site daemon's workers train at
    ``limits.worker_nice`` on ``limits.worker_cpus``."""

    def __init__(
        self, example: Path, rounds: int, root: Path, nice: int = 0, cpus: list[int] | None = None
    ):
        self.example, self.rounds, self.root, self.nice = example, rounds, root, nice
        self.cpus = cpus
        self.runs: list[Path] = []
        self.proc: subprocess.Popen | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failed = 0

    def start(self, timeout: float = 180) -> TrainingLoad:
        """Start the first cycle and return once its first round record is written (the
        nodes are training, not starting)."""
        self._launch()
        self._thread = threading.Thread(target=self._keep_running, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.rounds_between(0, time.time()):
            if time.monotonic() > deadline:
                raise SystemExit(f"training in {self.runs[-1]} did not reach a round")
            time.sleep(0.1)
        return self

    def _launch(self) -> None:
        out = self.root / f"cycle{len(self.runs)}"
        self.runs.append(out)
        out.mkdir(parents=True)
        with open(out.with_suffix(".log"), "ab") as log:
            self.proc = subprocess.Popen(
                swarm_cmd(self.example, self.rounds, out),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # its own process group (stop() ends its nodes too) in this session, as a
                # site daemon's workers are in the daemon's: with the kernel's autogroups a
                # new session would be a group of its own, whose niceness the server's
                # scheduling never sees
                process_group=0,
                preexec_fn=self._setup if self.nice or self.cpus is not None else None,
            )

    def _setup(self) -> None:
        os.nice(self.nice)
        pin(self.cpus)

    def _keep_running(self) -> None:
        while not self._stop.is_set():
            assert self.proc is not None
            if self.proc.poll() is not None:
                self.failed += self.proc.returncode != 0
                if not self._stop.is_set():
                    self._launch()
            time.sleep(0.1)

    def rounds_between(self, t0: float, t1: float) -> int:
        """Node-rounds finished (round records written) between wall times ``t0`` and ``t1``."""
        count = 0
        for run in self.runs:
            for path in (run / "nodes").glob("*.jsonl"):
                with contextlib.suppress(OSError):
                    for line in path.read_text().splitlines():
                        with contextlib.suppress(ValueError):
                            count += t0 <= json.loads(line).get("t", -1) <= t1
        return count

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


# ----------------------------------------------------------------------------- breakdown
def breakdown(site: Path, content_type: str, bodies: list[bytes], n: int = 300) -> dict:
    """In this process: the median ms of the server's predict path without HTTP
    (``ModelServer.predict``: parse, normalise, forward, answer), of the forward pass alone
    (``Classifier.probabilities`` on the prepared input), and of one request from one
    keep-alive client to that server over HTTP (``http_p50_ms``)."""
    from p2pfl.export.predict import image_batches, model_inputs, records_array
    from p2pfl.sites.models.serving import ModelServer
    from p2pfl.sites.models.store import ModelStore

    body = yaml.safe_load(site.read_text())
    store = ModelStore(body["state_dir"], body["site"])
    runtime = body["serving"].get("runtime", "onnx")
    server = ModelServer(store, "127.0.0.1", 0, runtime=runtime).start()
    try:
        model = server.served.classifier
        if content_type == "image/png":
            prepared = [next(image_batches([b], model.spec, model.info, "x")) for b in bodies]
        else:
            features = model.spec["features"]
            prepared = [
                model_inputs(
                    records_array(json.loads(b), features, "x")[0],
                    model.spec,
                    model.info,
                    "x",
                    "impute",
                )
                for b in bodies
            ]

        def timed(fn) -> float:
            fn(0)  # warm
            times = []
            for i in range(n):
                t0 = time.perf_counter()
                fn(i)
                times.append(time.perf_counter() - t0)
            return round(1000 * statistics.median(times), 4)

        out = {
            "predict_ms": timed(lambda i: server.predict(content_type, bodies[i % len(bodies)])),
            "forward_ms": timed(lambda i: model.probabilities([prepared[i % len(prepared)]])),
        }
        # the same server over HTTP, one keep-alive client
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        conn = http.client.HTTPConnection(*server.address, timeout=30)
        try:
            out["http_p50_ms"] = timed(lambda i: _post(conn, content_type, bodies[i % len(bodies)]))
        finally:
            conn.close()
            server.shutdown()
            thread.join(10)
    finally:
        server.close()
    return out


def _post(conn: http.client.HTTPConnection, content_type: str, body: bytes) -> None:
    """One ``POST /v1/predict`` on ``conn``, its answer read; a SystemExit unless a 200."""
    conn.request("POST", "/v1/predict", body, {"Content-Type": content_type})
    answer = conn.getresponse()
    answer.read()
    if answer.status != 200:
        raise SystemExit(f"in-process server answered {answer.status}")


# ----------------------------------------------------------------------------- main
def machine() -> dict:
    import torch

    return {
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_at_start": [round(v, 2) for v in os.getloadavg()],
    }


def key(name: str, clients: int, training: bool) -> str:
    return f"{name}/{clients}/{'training' if training else 'idle'}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per measurement")
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds not counted, before each")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument(
        "--models-dir",
        type=Path,
        help="prepared run directories DIR/hospitals and DIR/digits-cnn (no training here)",
    )
    ap.add_argument("--model-rounds", type=int, default=3, help="rounds of the models' training")
    ap.add_argument("--no-training", action="store_true", help="skip the under-training runs")
    ap.add_argument("--train-example", choices=MODELS, default="digits-cnn")
    ap.add_argument("--train-rounds", type=int, default=2000, help="rounds of the training swarm")
    ap.add_argument(
        "--runtime", choices=("onnx", "torch"), default="onnx", help="the site's serving.runtime"
    )
    ap.add_argument(
        "--workers", default="auto", help="the site's serving.workers (auto: one a core)"
    )
    ap.add_argument(
        "--train-nice",
        type=int,
        default=WORKER_NICE,
        help="the training swarm's niceness (default: a site's limits.worker_nice)",
    )
    ap.add_argument(
        "--train-cpus",
        type=parse_cpus,
        help="the CPUs the training swarm runs on, e.g. 1 (a site's limits.worker_cpus; "
        "default: any)",
    )
    ap.add_argument(
        "--serve-cpus",
        type=parse_cpus,
        help="the CPUs the server runs on, e.g. 0 (the site's serving.cpus; default: any)",
    )
    ap.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="client processes the clients' threads are spread over (each its own GIL)",
    )
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="p2pfl-bench-serving-"))
    result: dict = {
        "machine": machine(),
        "settings": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "json"
        },
        "servers": {},
        "breakdown": {},
        "repeats": [],
        "median": {},
    }
    servers: dict[str, Server] = {}
    load: dict[str, tuple[str, list[bytes]]] = {}
    try:
        for name in args.models:
            example = copy_example(name, work)
            if args.models_dir is not None:
                run = args.models_dir / name
            else:
                run = train(example, args.model_rounds, work / "models" / name)
            workers = args.workers if args.workers == "auto" else int(args.workers)
            serving = {"runtime": args.runtime, "workers": workers}
            if args.serve_cpus is not None:
                serving["cpus"] = args.serve_cpus
            site = site_file(work, name, run, serving)
            load[name] = requests_of(name, example)
            result["breakdown"][name] = breakdown(site, *load[name])
            servers[name] = Server(site, work / f"serve-{name}.log")
            described = servers[name].model
            result["servers"][name] = {
                "ready_s": round(servers[name].ready_s, 2),
                "model": described["model"]["id"],
                "round": described["model"]["round"],
                "input": described["input"],
                "classes": described["classes"],
                "requests": len(load[name][1]),
            }
            print(
                f"serving {name} ({SITE_OF[name]}'s model, round "
                f"{described['model']['round']}) on :{servers[name].port}, ready in "
                f"{servers[name].ready_s:.1f} s; predict path {result['breakdown'][name]}"
            )
        # one answer checked: one prediction of the model's classes
        for name, server in servers.items():
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
            conn.request("POST", "/v1/predict", load[name][1][0], {"Content-Type": load[name][0]})
            answer = json.loads(conn.getresponse().read())
            conn.close()
            assert len(answer["predictions"]) == 1, answer
            assert answer["classes"] == result["servers"][name]["classes"], answer

        phases = [False] if args.no_training else [False, True]
        train_example = copy_example(args.train_example, work)
        for rep in range(args.repeats):
            figures: dict[str, dict] = {}
            for training in phases:
                cycle = None
                if training:
                    cycle = TrainingLoad(
                        train_example,
                        args.train_rounds,
                        work / f"training{rep}",
                        args.train_nice,
                        args.train_cpus,
                    ).start()
                try:
                    for name in args.models:
                        for clients in args.clients:
                            fig = measure(
                                servers[name],
                                *load[name],
                                clients,
                                args.duration,
                                args.warmup,
                                args.client_processes,
                            )
                            t0, t1 = fig.pop("window")
                            if cycle is not None:
                                # perf_counter window -> wall clock, for the round records
                                shift = time.time() - time.perf_counter()
                                fig["node_rounds_in_window"] = cycle.rounds_between(
                                    t0 + shift, t1 + shift
                                )
                            figures[key(name, clients, training)] = fig
                            print(
                                f"repeat {rep}: {name:10s} {clients:2d} clients "
                                f"{'training' if training else 'idle    '}: p50 "
                                f"{fig['p50_ms']} ms, p99 {fig['p99_ms']} ms, "
                                f"{fig['req_s']} req/s, {fig['errors']} errors"
                                + (
                                    f", {fig['node_rounds_in_window']} node-rounds trained"
                                    if training
                                    else ""
                                ),
                                flush=True,
                            )
                finally:
                    if cycle is not None:
                        cycle.stop()
                        figures[f"training_cycles/{rep}"] = {
                            "cycles": len(cycle.runs),
                            "failed": cycle.failed,
                        }
            result["repeats"].append(figures)
    finally:
        for server in servers.values():
            server.stop()
        if args.keep:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    fields = ("p50_ms", "p99_ms", "req_s", "errors", "server_cpu_ms_per_req")
    rows = [k for k in result["repeats"][0] if not k.startswith("training_cycles/")]
    for k in rows:
        reps = [r[k] for r in result["repeats"]]
        med = {f: round(statistics.median(r[f] for r in reps), 3) for f in fields}
        med["errors_total"] = sum(r["errors"] for r in reps)
        if "node_rounds_in_window" in reps[0]:
            med["node_rounds_in_window"] = statistics.median(
                r["node_rounds_in_window"] for r in reps
            )
        result["median"][k] = med

    print(
        f"\nmedian of {args.repeats} repeats, {args.duration:g} s each; "
        f"{result['machine']['cpu_count']} CPUs, torch {result['machine']['torch']} "
        f"({result['machine']['torch_threads']} threads)\n"
    )
    print("| model | clients | training | p50 ms | p99 ms | req/s | errors |")
    print("|---|---|---|---|---|---|---|")
    for k in rows:
        name, clients, phase = k.split("/")
        m = result["median"][k]
        print(
            f"| {name} | {clients} | {'yes' if phase == 'training' else 'no'} | "
            f"{m['p50_ms']:.2f} | {m['p99_ms']:.2f} | {m['req_s']:.0f} | {m['errors_total']} |"
        )
    print(
        "\nin this process, median ms: predict path without HTTP / forward pass alone / "
        "1 client over HTTP"
    )
    for name, b in result["breakdown"].items():
        print(f"  {name}: {b['predict_ms']} / {b['forward_ms']} / {b['http_p50_ms']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    errors = sum(m["errors_total"] for m in result["median"].values())
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
