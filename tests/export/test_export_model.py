"""A run's trained models: the files a node leaves, load_model, and the export formats."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys

import numpy as np
import pytest
import torch
from export_helpers import make_run
from safetensors.torch import load_file

import p2pfl
from p2pfl.algorithms import get_algorithm
from p2pfl.algorithms.build import build_node_model
from p2pfl.cli import main
from p2pfl.export import ExportError, export_model, load_model, nodes_with_models
from p2pfl.learning.artifacts import read_model_info, write_model_artifacts
from p2pfl.learning.data import load_node_data
from p2pfl.node.daemon import Node, NodeOptions


@pytest.fixture
def mlp_run(tmp_path):
    return make_run(tmp_path)


def _test_set(shape, n=64, seed=7):
    return torch.randn(n, *shape, generator=torch.Generator().manual_seed(seed))


def test_load_model_gives_the_trained_models_outputs(mlp_run):
    x = _test_set((1, 8, 8))
    rng_before = torch.random.get_rng_state()
    loaded = load_model(mlp_run.dir, "a")
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # the caller's RNG is kept
    assert not loaded.training
    with torch.no_grad():
        want, got = mlp_run.models["a"](x), loaded(x)
    assert torch.equal(got, want)
    # not merely the initial model again: training moved the weights
    cfg = mlp_run.cfg
    initial = build_node_model(get_algorithm(cfg.algorithm.name), cfg, 4, (1, 8, 8)).eval()
    with torch.no_grad():
        assert not torch.allclose(initial(x), want)
    # and each node its own
    with torch.no_grad():
        assert not torch.allclose(load_model(mlp_run.dir, "b")(x), want)


def test_p2pfl_load_model_is_lazy(mlp_run):
    assert p2pfl.load_model is load_model
    code = "import sys, p2pfl; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    with pytest.raises(AttributeError):
        p2pfl.no_such_name  # noqa: B018


def test_the_files_are_plain_safetensors_and_json(mlp_run):
    run, module = mlp_run.dir, mlp_run.models["a"]
    weights = load_file(str(run / "nodes" / "a.safetensors"))
    state = module.state_dict()
    assert sorted(weights) == sorted(state)  # the module's own names
    assert all(torch.equal(weights[k], state[k]) for k in state)
    meta = json.loads((run / "nodes" / "a.model.json").read_text())
    assert meta["node"] == "a" and meta["format"] == 1 and meta["config"] == "config.yaml"
    assert meta["model"]["name"] == "mlp" and meta["algorithm"] == "uapdfl"
    assert meta["num_classes"] == 4 and meta["input_shape"] == [1, 8, 8]
    assert meta["round"] == mlp_run.cfg.rounds
    assert meta["layout"] == [[k, list(v.shape), "float32"] for k, v in state.items()]
    assert nodes_with_models(run) == ["a", "b"]
    assert not [p for p in (run / "nodes").iterdir() if p.name.startswith(".")]  # no temp files


def test_tied_weights_are_saved_under_each_name(tmp_path):
    module = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    module[1].weight = module[0].weight  # tied: safetensors refuses shared storage as such
    info = {"model": {"name": "x"}, "algorithm": "fedavg", "num_classes": 3}
    write_model_artifacts(tmp_path, "n", module, {**info, "input_shape": [3], "round": 1})
    weights = load_file(str(tmp_path / "nodes" / "n.safetensors"))
    assert torch.equal(weights["0.weight"], weights["1.weight"])
    module.load_state_dict(weights, strict=True)


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_onnx_export_matches_torch(tmp_path, model):
    import onnx
    import onnxruntime as ort

    run = make_run(tmp_path, model=model)
    path = export_model(run.dir, "a", "onnx", tmp_path / "out" / "a.onnx")
    assert path == tmp_path / "out" / "a.onnx"
    onnx.checker.check_model(str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    cfg = run.cfg
    test_x = load_node_data(cfg.dataset, cfg.node_ids, "a", cfg.seed).test_x  # a's test set
    worst = 0.0
    for x in (test_x, test_x[:5]):  # the whole set, and another batch size (dynamic axis)
        (got,) = session.run(None, {"input": x.numpy()})
        with torch.no_grad():
            want = run.models["a"](x).numpy()
        worst = max(worst, float(np.abs(got - want).max()))
    print(f"{model}: max |ONNX - torch| = {worst:.3g} over node a's {len(test_x)} test samples")
    assert worst < 1e-4


@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated")
def test_torchscript_export_matches_torch(tmp_path):
    run = make_run(tmp_path, model="cnn")
    path = export_model(run.dir, "b", "torchscript")
    assert path == run.dir / "export" / "b.pt"
    scripted = torch.jit.load(str(path))
    for n in (64, 3):
        x = _test_set((1, 8, 8), n=n)
        with torch.no_grad():
            torch.testing.assert_close(scripted(x), run.models["b"](x), rtol=0, atol=1e-5)


def test_safetensors_export_copies_weights_and_json(mlp_run, tmp_path):
    path = export_model(mlp_run.dir, "a", "safetensors", tmp_path / "x" / "model.safetensors")
    assert path.read_bytes() == (mlp_run.dir / "nodes" / "a.safetensors").read_bytes()
    meta = json.loads((tmp_path / "x" / "model.model.json").read_text())
    assert meta["node"] == "a"


@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated")
def test_pfedc_model_loads_with_its_heads_and_class_mask(tmp_path):
    from p2pfl.algorithms.pfedc import find_heads

    def hold_two_classes(model):  # what set_labels does for a node holding classes 0 and 2
        find_heads(model)[1].predict_only([0, 2])

    run = make_run(tmp_path, algorithm="pfedc", prepare=hold_two_classes)
    loaded = load_model(run.dir, "a")
    assert any(".heads." in k for k in loaded.state_dict())
    x = _test_set((1, 8, 8))
    with torch.no_grad():
        want, got = run.models["a"](x), loaded(x)
    assert torch.equal(got, want)
    assert set(got.argmax(1).tolist()) <= {0, 2}
    scripted = torch.jit.load(str(export_model(run.dir, "a", "torchscript")))
    with torch.no_grad():
        torch.testing.assert_close(scripted(x), want, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- errors


def test_unknown_node_names_the_nodes_that_have_models(mlp_run):
    with pytest.raises(ExportError, match=r"nodes/zz.model.json.*nodes with models: a, b"):
        load_model(mlp_run.dir, "zz")


def test_missing_run_dir(tmp_path):
    with pytest.raises(ExportError, match=r"nope: no such run directory"):
        load_model(tmp_path / "nope", "a")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match=r"empty: not a run directory \(no config.yaml\)"):
        export_model(tmp_path / "empty", "a", "onnx")


def test_malformed_json_and_weights_are_named(mlp_run):
    meta_path = mlp_run.dir / "nodes" / "a.model.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "num_classes": "four"}))
    with pytest.raises(ExportError, match=r"a.model.json: field 'num_classes'"):
        read_model_info(mlp_run.dir, "a")
    meta_path.write_text(json.dumps(meta))
    (mlp_run.dir / "nodes" / "a.safetensors").write_bytes(b"not weights")
    with pytest.raises(ExportError, match=r"a.safetensors: not a readable safetensors file"):
        load_model(mlp_run.dir, "a")
    other = load_file(str(mlp_run.dir / "nodes" / "b.safetensors"))
    other.pop("h.bias")
    from safetensors.torch import save_file

    save_file(other, str(mlp_run.dir / "nodes" / "a.safetensors"))
    with pytest.raises(ExportError, match=r"do not fit the model.*missing h.bias"):
        load_model(mlp_run.dir, "a")


def test_unknown_format(mlp_run):
    with pytest.raises(ExportError, match="unknown export format 'keras'"):
        export_model(mlp_run.dir, "a", "keras")


# ----------------------------------------------------------------------------- cli


def test_cli_export_every_node(mlp_run, tmp_path, capsys):
    out = tmp_path / "exported"
    assert main(["export", str(mlp_run.dir), "--format", "onnx", "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(out / "a.onnx"), str(out / "b.onnx")]
    assert main(["export", str(mlp_run.dir), "--node", "b", "--format", "safetensors"]) == 0
    assert capsys.readouterr().out.strip() == str(mlp_run.dir / "export" / "b.safetensors")


def test_cli_export_errors_are_messages(mlp_run, tmp_path, capsys):
    assert main(["export", str(mlp_run.dir), "--node", "zz", "--format", "onnx"]) == 2
    err = capsys.readouterr().err
    assert "node 'zz' has no trained model" in err and "Traceback" not in err
    assert main(["export", str(tmp_path / "none"), "--format", "onnx"]) == 2
    assert "no such run directory" in capsys.readouterr().err


# ----------------------------------------------------------------------------- daemon


def test_the_daemon_writes_the_trained_model(tmp_path, caplog):
    import numpy as np

    from p2pfl.algorithms.build import node_method
    from p2pfl.learning.data import load_node_data

    cfg = make_run(tmp_path, nodes=()).cfg
    run = tmp_path / "daemon-run"
    node = Node(cfg, "a", NodeOptions(out_dir=run))
    node.data = load_node_data(cfg.dataset, cfg.node_ids, "a", cfg.seed)
    rng = np.random.default_rng(0)
    node.method = node_method(node.method_cls, cfg, "a", node.data, rng, torch.device("cpu"))
    node.records.append({"round": 2})
    (run).mkdir()
    (run / "config.yaml").write_text((tmp_path / "run" / "config.yaml").read_text())
    asyncio.run(node._write_model())
    meta = read_model_info(run, "a")
    assert meta["round"] == 2 and meta["input_shape"] == list(node.data.input_shape)
    assert meta["classes"] == (getattr(node.data, "classes", None) or None)
    assert meta["input_spec"] == (getattr(node.data, "input_spec", None) or None)
    x = _test_set(tuple(node.data.input_shape))
    with torch.no_grad():
        assert torch.equal(load_model(run, "a")(x), node.method.model.eval()(x))
    # a disk that refuses is logged, never fatal
    node.out_dir = tmp_path / "a-file"
    node.out_dir.write_text("")
    with caplog.at_level(logging.WARNING):
        asyncio.run(node._write_model())
    assert "trained model not written" in caplog.text


USER_MODULE = """
import math
from torch import nn


class Net(nn.Module):
    def __init__(self, num_classes, input_shape, hidden=12):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.ReLU())
        self.norm = nn.BatchNorm1d(hidden)
        self.classifier = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.classifier(self.norm(self.body(x)))


def make(num_classes, input_shape):
    return Net(num_classes, input_shape)
"""


def test_user_model_is_exported_with_the_users_own_names(tmp_path, monkeypatch):
    import importlib

    import onnxruntime as ort

    (tmp_path / "export_usernet.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    run = make_run(tmp_path, model="export_usernet:make")
    loaded = load_model(run.dir, "a")
    assert type(loaded).__name__ == "Net" and not loaded.training
    names = set(load_file(str(run.dir / "nodes" / "a.safetensors")))
    assert names == set(loaded.state_dict()) and "classifier.2.weight" in names
    assert "norm.running_mean" in names  # BatchNorm statistics travel too
    x = _test_set((1, 8, 8))
    with torch.no_grad():
        assert torch.equal(loaded(x), run.models["a"].eval()(x))
    session = ort.InferenceSession(
        str(export_model(run.dir, "a", "onnx")), providers=["CPUExecutionProvider"]
    )
    (got,) = session.run(None, {"input": x.numpy()})
    assert np.abs(got - loaded(x).detach().numpy()).max() < 1e-4
