"""A task of the user's own on a real swarm (node processes, a real broker on loopback): a
logistic regression (one ``nn.Linear``, one logit) trained with ``training.loss: bce`` on
each node's CSV file, tested on its own test file (``dataset.test_root``), its records and
summary carrying every metric by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from p2pfl.check.load import load_topology
from p2pfl.export import load_model
from p2pfl.launch.swarm import run_swarm
from p2pfl.metrics import read_records

pytestmark = pytest.mark.integration

MODEL = """
import math
from torch import nn


def logistic(num_classes, input_shape):
    return nn.Linear(math.prod(input_shape), num_classes)
"""

TOPOLOGY = """
name: lr
rounds: 2
nodes: [a, b]
edges: full
dataset:
  name: csv
  root: data/{id}-train.csv
  test_root: data/{id}-test.csv
  partition: none
  label: outcome
  classes: [0, 1]
model: {name: "linear_model:logistic"}
training: {loss: bce, lr: 0.1, batch_size: 16, steps: 15}
evaluation: {metrics: [accuracy, auc, f1]}
timing: {linger_s: 3}
"""


def _write(tmp_path):
    import pandas as pd

    rng = np.random.default_rng(0)
    (tmp_path / "data").mkdir()
    for node in ("a", "b"):
        for part, n in (("train", 90), ("test", 30)):
            x = rng.normal(size=(n, 4))
            df = pd.DataFrame(x, columns=["f0", "f1", "f2", "f3"])
            df["outcome"] = (x[:, 0] - x[:, 1] > 0).astype(int)
            df.to_csv(tmp_path / "data" / f"{node}-{part}.csv", index=False)
    (tmp_path / "linear_model.py").write_text(MODEL)
    (tmp_path / "topology.yaml").write_text(TOPOLOGY)


@pytest.mark.parametrize(
    ("method", "params"),
    [("local", {}), ("fedavg", {}), ("fedavg", {"server_opt": "adam", "server_lr": 1.0})],
)
def test_a_logistic_regression_trains_with_bce_from_each_nodes_files(tmp_path, method, params):
    _write(tmp_path)
    knobs = f"algorithm.params={json.dumps(params)}"
    cfg = load_topology(tmp_path / "topology.yaml", [f"algorithm.name={method}", knobs])
    out = tmp_path / "run"
    code, summary = run_swarm(cfg, out, nodes_per_process=2, progress=False)
    logs = "".join(p.read_text() for p in (out / "logs").glob("*.log"))
    assert code == 0, logs[-3000:]
    for node in ("a", "b"):
        meta = json.loads((out / "nodes" / f"{node}.meta.json").read_text())
        assert (meta["n_train"], meta["n_test"]) == (90, 30)  # its test file, whole
        records = read_records(out / "nodes" / f"{node}.jsonl")
        assert [r["round"] for r in records] == [1, 2]
        last = records[-1]
        # the node's own 30-row test file, a separable task: every metric by name
        assert last["test_acc"] > 0.8 and last["test_auc"] > 0.9 and last["test_f1"] > 0.8
        assert last["train_ce"] == pytest.approx(last["train_loss"])  # BCE, no extra term
    assert set(summary["metrics"]) == {"test_auc", "test_f1"}
    assert summary["final"]["acc_mean"] > 0.8
    if params:  # FedAdam: every member took the same server step from the same mean
        a, b = (load_model(out, node).state_dict() for node in ("a", "b"))
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_predict_gives_the_sigmoid_of_one_logit_and_the_value_of_a_regression(tmp_path):
    import pandas as pd

    from p2pfl.export.predict import classify

    _write(tmp_path)
    cfg = load_topology(tmp_path / "topology.yaml", ["algorithm.name=local", "rounds=1"])
    code, _ = run_swarm(cfg, tmp_path / "run", nodes_per_process=2, progress=False)
    assert code == 0
    got = classify(tmp_path / "run", "a", tmp_path / "data" / "a-test.csv", tmp_path / "p.csv")
    rows = pd.read_csv(got.path)
    assert got.accuracy > 0.8 and list(rows.columns[-3:]) == ["label", "p_0", "p_1"]
    assert np.allclose(rows["p_0"] + rows["p_1"], 1.0)
    assert ((rows["p_1"] > 0.5) == (rows["predicted"] == 1)).all()
    # the same files as a regression of the first feature on the others: values out
    for path in (tmp_path / "data").glob("*.csv"):
        df = pd.read_csv(path)
        df["outcome"] = df["f0"] * 3.0 + 1.0
        df.drop(columns=["f0"]).to_csv(path, index=False)
    reg = load_topology(
        tmp_path / "topology.yaml",
        [
            "algorithm.name=local",
            "rounds=1",
            "training.loss=mse",
            "dataset.classes=null",
            "evaluation.metrics=[mae]",
        ],
    )
    code, summary = run_swarm(reg, tmp_path / "reg", nodes_per_process=2, progress=False)
    assert code == 0 and set(summary["metrics"]) == {"test_mae", "test_loss"}
    last = read_records(tmp_path / "reg" / "nodes" / "a.jsonl")[-1]
    assert last["test_acc"] is None and last["test_mae"] >= 0
    out = classify(tmp_path / "reg", "a", tmp_path / "data" / "a-test.csv", tmp_path / "v.csv")
    values = pd.read_csv(out.path)
    assert out.accuracy is None and "predicted" in values and len(values) == 30
    # a site's promotion gate scores a kept model by its task's metric (promote.metric)
    from p2pfl.export.held_out import held_out_scorer
    from p2pfl.learning.artifacts import ExportError

    score = held_out_scorer(tmp_path / "reg", "a", "mae")
    assert score(tmp_path / "reg") == pytest.approx(last["test_mae"], rel=1e-5)
    with pytest.raises(ExportError, match="promote.metric 'accuracy' does not score"):
        held_out_scorer(tmp_path / "reg", "a", "accuracy")
