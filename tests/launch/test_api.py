"""The Python API a notebook uses: ``p2pfl.run_swarm`` with a model class and a data
function from the user's own module (node processes import them), its records as rows,
``p2pfl.load_model`` on the result, and the errors for code no other process can import."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

import p2pfl
from p2pfl.errors import ConfigError

USER_CODE = textwrap.dedent(
    '''
    import numpy as np
    import torch
    from torch import nn


    class TinyNet(nn.Module):
        def __init__(self, num_classes, input_shape):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(input_shape[0], 16), nn.ReLU())
            self.out = nn.Linear(16, num_classes)

        def forward(self, x):
            return self.out(self.body(x))


    def clinic_data(node_id, root):
        """Each node its own 3-class problem: points around class centres, shifted per node."""
        rng = np.random.default_rng(sum(map(ord, node_id)))
        centres = np.eye(3, 5) * 3.0
        def draw(n):
            y = rng.integers(0, 3, n)
            x = centres[y] + rng.normal(size=(n, 5)) + 0.3 * (ord(node_id[-1]) % 3)
            return x.astype(np.float32), y
        x_train, y_train = draw(120)
        x_test, y_test = draw(40)
        return x_train, y_train, x_test, y_test
    '''
)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "clinic.py").write_text(USER_CODE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield __import__("clinic")
    sys.modules.pop("clinic", None)


TOPOLOGY = {
    "name": "clinics",
    "rounds": 2,
    "nodes": ["a", "b", "c"],
    "edges": "full",
    "algorithm": {"name": "fedavg"},
    "dataset": {"partition": "none", "classes": 3},
    "training": {"batch_size": 20, "lr": 0.1},
    "timing": {"linger_s": 5},
}


@pytest.mark.integration
def test_run_swarm_with_a_model_class_and_a_data_function(user_module, tmp_path):
    run = p2pfl.run_swarm(
        TOPOLOGY,
        tmp_path / "run",
        model=user_module.TinyNet,
        data=user_module.clinic_data,
        method="uapdfl",
        nodes_per_process=3,
        quiet=True,
    )
    assert run.ok, (tmp_path / "run" / "logs").glob("*.log")
    assert run.config.model.name == "clinic:TinyNet"
    assert run.config.dataset.name == "clinic:clinic_data"
    rows = run.records
    assert [(r["round"], r["node"]) for r in rows] == [
        (r, n) for r in (1, 2) for n in ("a", "b", "c")
    ]
    frame = run.to_dataframe()
    assert list(frame.groupby("round").test_acc.count()) == [3, 3]
    assert "method.divergence" in frame.columns and "method" not in frame.columns
    model = run.load_model("b")
    assert isinstance(model, user_module.TinyNet)
    last = run.final()["b"]
    data = user_module.clinic_data("b", None)
    with torch.no_grad():
        acc = (model(torch.from_numpy(data[2])).argmax(1).numpy() == data[3]).mean()
    assert acc == pytest.approx(last["test_acc"])  # the node's own test set, same weights


def test_objects_no_node_can_import_are_refused():
    def local_factory(num_classes, input_shape):  # defined in a function
        raise AssertionError("never called")

    with pytest.raises(ValueError, match="node processes cannot import it"):
        p2pfl.run_swarm(TOPOLOGY, model=local_factory)


def test_load_topology_takes_a_mapping_and_fields():
    cfg = p2pfl.load_topology(TOPOLOGY, ["training.lr=0.5"], rounds=7)
    assert cfg.rounds == 7 and cfg.training.lr == 0.5
    with pytest.raises(ConfigError, match="rounds"):
        p2pfl.load_topology(TOPOLOGY, rounds=0)


def test_to_dataframe_spreads_the_method_facts_over_columns(tmp_path):
    from p2pfl.launch.api import Run
    from p2pfl.metrics import append_record, node_log_path

    cfg = p2pfl.load_topology("topologies/synthetic.yaml", nodes=["a", "b"])
    append_record(node_log_path(tmp_path, "a"), {"round": 1, "test_acc": 0.5, "method": {}})
    b = {"round": 1, "test_acc": 0.25, "dropout": True, "method": {"test_acc": 2, "drift": 1.5}}
    append_record(node_log_path(tmp_path, "b"), b)
    run = Run(tmp_path, 0, {}, cfg)
    assert run.records[1]["method"] == {"test_acc": 2, "drift": 1.5}  # rows as recorded
    frame = run.to_dataframe()
    assert "method" not in frame.columns
    assert list(frame.test_acc) == [0.5, 0.25]  # a method's fact never replaces a field
    assert frame["method.test_acc"].iloc[1] == 2 and frame["method.drift"].iloc[1] == 1.5
