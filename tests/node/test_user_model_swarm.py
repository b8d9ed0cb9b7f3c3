"""A user's own model on a real swarm: every installed method runs with it end to end (node
processes, a real broker on loopback), and a neighbour whose model layout differs is
refused before any weight moves, with both layouts and the first difference named."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "learning"))
from swarm_helpers import check_run_dir  # noqa: E402
from user_models_src import USER_MODULE  # noqa: E402

from p2pfl.algorithms import known_algorithms  # noqa: E402
from p2pfl.check.load import load_topology  # noqa: E402
from p2pfl.config.schema import dump_topology  # noqa: E402
from p2pfl.launch.swarm import run_swarm, spawn_worker  # noqa: E402
from p2pfl.metrics import read_records  # noqa: E402

pytestmark = pytest.mark.integration
TOPOLOGY = Path(__file__).resolve().parents[2] / "topologies" / "synthetic.yaml"


def user_topology(tmp_path: Path, monkeypatch, overrides: list[str]):
    (tmp_path / "usernet.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)  # node processes import usernet from their directory
    return load_topology(
        TOPOLOGY,
        [
            "model={name: 'usernet:make'}",
            "nodes=[a, b, c]",
            "edges=full",
            "timing.linger_s=5",
            *overrides,
        ],
    )


@pytest.mark.parametrize("method", known_algorithms())
def test_every_method_runs_with_a_user_model(tmp_path, monkeypatch, method):
    cfg = user_topology(
        tmp_path, monkeypatch, [f"algorithm.name={method}", "algorithm.params={}", "rounds=2"]
    )
    code, summary = run_swarm(cfg, tmp_path / "run", nodes_per_process=3, progress=False)
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("*.log"))
    assert code == 0, logs[-3000:]
    check_run_dir(tmp_path / "run", cfg.node_ids, 2)
    assert "refusing" not in logs and "Traceback" not in logs


def test_a_neighbour_with_another_layout_is_refused(tmp_path, monkeypatch, broker):
    cfg = user_topology(
        tmp_path,
        monkeypatch,
        ["nodes=[a, b]", "rounds=1", "timing.startup_timeout_s=60", "timing.round_timeout_s=10"],
    )
    cfg = cfg.model_copy(
        update={"broker": cfg.broker.model_copy(update={"host": broker.host, "port": broker.port})}
    )
    out = tmp_path / "run"
    (out / "a").mkdir(parents=True)
    (out / "b").mkdir()
    other = cfg.model_copy(update={"model": cfg.model.model_copy(update={"kwargs": {"hidden": 7}})})
    workers = []
    for nid, node_cfg in (("a", cfg), ("b", other)):
        path = out / nid / "config.yaml"
        path.write_text(dump_topology(node_cfg))
        workers.append(spawn_worker(path, [nid], f"{broker.host}:{broker.port}", out / nid, False))
    try:
        for w in workers:
            assert w.proc.wait(timeout=120) == 0, w.log_path.read_text()[-3000:]
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
    log_a = workers[0].log_path.read_text()
    assert "refusing neighbour b: its model layout" in log_a
    assert "tensor 'g.body.1.weight': [12, 64] float32 here, [7, 64] float32 there" in log_a
    assert "refusing neighbour a" in workers[1].log_path.read_text()
    for nid in ("a", "b"):
        (rec,) = read_records(out / nid / "nodes" / f"{nid}.jsonl")
        assert rec["bytes_recv"] < 20_000 and not rec["pulled"], rec  # no weight moved
