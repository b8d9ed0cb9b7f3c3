"""A device's own data (``dataset.partition: none``): each reader, the swarm's label space,
deterministic splits, normalisation from the node's own train split, datasets read item by
item, and one error per bad input naming the field, the node and the file."""

from __future__ import annotations

import json
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from p2pfl.check.preflight import check_inputs
from p2pfl.config.schema import DatasetConfig, TopologyConfig, TrainingConfig
from p2pfl.errors import ConfigError
from p2pfl.learning import data as D
from p2pfl.learning.models import build_model
from p2pfl.learning.node_inputs import check_node_data
from p2pfl.learning.own_data import split_fraction
from p2pfl.learning.partition import stable_rng
from p2pfl.learning.train import evaluate, train_local

pd = pytest.importorskip("pandas")

FEATURES = ["f0", "f1", "f2"]


def _table(n: int = 60, seed: int = 0, classes: int = 3, names: list[str] | None = None):
    """A small class-structured table: feature means move with the class."""
    rng = np.random.default_rng(seed)
    y = np.arange(n) % classes
    x = rng.normal(0.0, 1.0, size=(n, len(FEATURES))) + y[:, None] * 2.0 + [10.0, -5.0, 0.0]
    df = pd.DataFrame(x, columns=FEATURES)
    df["label"] = [names[i] for i in y] if names else y
    return df


def _topo(tmp_path: Path, nodes=2, model="mlp", **dataset) -> TopologyConfig:
    ds = {"partition": "none", **dataset}
    return TopologyConfig(name="t", nodes=nodes, dataset=ds, model={"name": model})


def _bad(cfg: TopologyConfig, node: str = "n0", **kw) -> ConfigError:
    with pytest.raises(ConfigError) as exc:
        check_node_data(cfg, node, source="t.yaml", cache_dir=kw.pop("cache_dir", None), **kw)
    return exc.value


def _assert_names(err: ConfigError, field: str, node: str, file: str | Path) -> str:
    msg = str(err)
    assert len(err.errors) == 1 and err.errors[0][0] == field, msg
    assert msg.startswith(f"t.yaml: {field}: node {node!r}: "), msg
    assert str(file) in msg, msg
    return msg


# ----------------------------------------------------------------------------- csv / parquet


def test_csv_one_file_is_split_deterministically_and_normalised_by_its_train_split(tmp_path):
    path = tmp_path / "n0.csv"
    _table(100).to_csv(path, index=False)
    cfg = DatasetConfig(name="csv", root=str(path), partition="none", classes=3)
    d = D.load_node_data(cfg, ["n0", "n1"], "n0", seed=0)
    again = D.load_node_data(cfg, ["n0", "n1"], "n0", seed=0)
    other_node = D.load_node_data(cfg, ["n0", "n1"], "n1", seed=0)
    assert len(d.train_y) == 80 and len(d.test_y) == 20  # test_fraction 0.2
    assert torch.equal(d.train_x, again.train_x) and torch.equal(d.test_y, again.test_y)
    assert not torch.equal(d.test_x, other_node.test_x)  # seeded by the node id too
    assert d.test_hist in ([7, 7, 6], [7, 6, 7], [6, 7, 7])  # stratified
    assert d.train_x.dtype == torch.float32 and d.train_x.shape == (80, 3)
    assert d.input_shape == (3,) and d.num_classes == 3 and d.classes == ["0", "1", "2"]
    assert d.train_set is None and d.source == str(path)
    # statistics from the node's own train split only
    assert d.train_x.mean(0).abs().max() < 1e-5
    assert (d.train_x.std(0, unbiased=False) - 1).abs().max() < 1e-4
    spec = d.input_spec
    assert spec["kind"] == "tabular" and spec["features"] == FEATURES and spec["label"] == "label"
    assert json.loads(json.dumps(spec)) == spec
    # the split is split_fraction's, seeded by (seed, "split", node id)
    labels = pd.read_csv(path)["label"].to_numpy()
    tr, te = split_fraction(labels, 0.2, 3, stable_rng(0, "split", "n0"))
    assert d.train_y.tolist() == labels[tr].tolist() and d.test_y.tolist() == labels[te].tolist()
    raw = pd.read_csv(path)[FEATURES].to_numpy()
    mean, std = raw[tr].mean(0), raw[tr].std(0)
    assert np.allclose(spec["mean"], mean) and np.allclose(spec["std"], std)


def test_csv_split_is_stratified_and_the_inverse_of_the_spec_gives_the_raw_rows(tmp_path):
    path = tmp_path / "d.csv"
    df = _table(50)
    df.to_csv(path, index=False)
    cfg = DatasetConfig(name="csv", root=str(path), partition="none", classes=3, test_fraction=0.3)
    d = D.load_node_data(cfg, ["a"], "a", seed=4)
    spec = d.input_spec
    raw = np.concatenate([d.train_x.numpy(), d.test_x.numpy()]) * spec["std"] + spec["mean"]
    assert np.allclose(np.sort(raw, axis=0), np.sort(df[FEATURES].to_numpy(), axis=0), atol=1e-4)
    assert len(d.test_y) == 15 and sum(d.test_hist) == 15


def test_csv_directory_with_train_and_test_files(tmp_path):
    _table(40, seed=1).to_csv(tmp_path / "train.csv", index=False)
    _table(12, seed=2)[["label", *reversed(FEATURES)]].to_csv(tmp_path / "test.csv", index=False)
    cfg = DatasetConfig(name="csv", root=str(tmp_path), partition="none", classes=3)
    d = D.load_node_data(cfg, ["a"], "a", seed=0)
    assert len(d.train_y) == 40 and len(d.test_y) == 12 and d.source == str(tmp_path)
    # test columns are taken by name, in the train file's order
    mean, std = np.array(d.input_spec["mean"]), np.array(d.input_spec["std"])
    want = (_table(12, seed=2)[FEATURES].to_numpy() - mean) / std
    assert np.allclose(d.test_x.numpy(), want, atol=1e-5)


def test_parquet_with_class_names(tmp_path):
    names = ["cat", "dog", "emu", "fox"]
    df = _table(40, classes=3, names=names)  # this node has no "fox"
    df.to_parquet(tmp_path / "train.parquet", engine="pyarrow")
    df.iloc[:8].to_parquet(tmp_path / "test.parquet", engine="pyarrow")
    cfg = DatasetConfig(name="parquet", root=str(tmp_path), partition="none", classes=names)
    d = D.load_node_data(cfg, ["a"], "a", seed=0)
    assert d.num_classes == 4 and d.classes == names
    assert d.train_hist == [14, 13, 13, 0] and len(d.test_y) == 8
    assert d.train_y.dtype == torch.int64


def test_stats_from_a_file_instead_of_the_train_split(tmp_path):
    path = tmp_path / "a.csv"
    _table(30).to_csv(path, index=False)
    stats = tmp_path / "stats.json"
    mean = {"f0": 1.0, "f1": 2.0, "f2": 0.0}
    std = {"f0": 2.0, "f1": 0.0, "f2": 4.0}  # std 0 -> 1
    stats.write_text(json.dumps({"mean": mean, "std": std}))
    base = dict(name="csv", root=str(path), partition="none", classes=3)
    own = D.load_node_data(DatasetConfig(**base), ["a"], "a", seed=0)
    filed = D.load_node_data(DatasetConfig(**base, stats=str(stats)), ["a"], "a", seed=0)
    assert filed.input_spec["mean"] == [1.0, 2.0, 0.0]
    assert filed.input_spec["std"] == [2.0, 1.0, 4.0]
    assert own.input_spec["mean"] != filed.input_spec["mean"]
    assert torch.equal(own.train_y, filed.train_y)  # the same split
    raw = own.train_x.numpy() * own.input_spec["std"] + own.input_spec["mean"]
    want = (raw - [1.0, 2.0, 0.0]) / [2.0, 1.0, 4.0]
    assert np.allclose(filed.train_x.numpy(), want, atol=1e-4)


# ----------------------------------------------------------------------------- npz


def test_npz_uint8_images_are_scaled_and_float_arrays_kept(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "n.npz"
    x = rng.integers(0, 256, size=(20, 1, 4, 4), dtype=np.uint8)
    np.savez(path, x_train=x, y_train=np.arange(20) % 5, x_test=x[:6], y_test=np.arange(6) % 5)
    cfg = DatasetConfig(name="npz", root=str(path), partition="none", classes=5)
    d = D.load_node_data(cfg, ["a"], "a", seed=0)
    assert torch.equal(d.train_x, torch.from_numpy(x.astype(np.float32) / 255.0))
    assert d.input_shape == (1, 4, 4) and d.num_classes == 5
    assert d.input_spec == {"kind": "array", "shape": [1, 4, 4], "scale": 255.0}
    f = rng.normal(size=(10, 7)).astype(np.float64)
    np.savez(path, x_train=f, y_train=np.zeros(10, int), x_test=f[:2], y_test=[1, 1])
    d = D.load_node_data(cfg, ["a"], "a", seed=0)
    assert torch.equal(d.train_x, torch.from_numpy(f.astype(np.float32)))
    assert d.input_spec == {"kind": "array", "shape": [7]} and d.test_hist == [0, 2, 0, 0, 0]


def test_npz_missing_key_is_named(tmp_path):
    path = tmp_path / "n.npz"
    np.savez(path, x_train=np.zeros((4, 2)), y_train=np.zeros(4, int), x_test=np.zeros((1, 2)))
    topo = _topo(tmp_path, name="npz", root=str(path), classes=2)
    msg = _assert_names(_bad(topo), "dataset.root", "n0", path)
    assert "'y_test'" in msg


# ----------------------------------------------------------------------------- functions


USER_MODULE = """
import numpy as np
import torch

CALLS = {"getitem": 0}


class Counting(torch.utils.data.Dataset):
    def __init__(self, n, offset=0, targets=False):
        self.n, self.offset = n, offset
        if targets:
            self.targets = [(i + offset) % 3 for i in range(n)]

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        CALLS["getitem"] += 1
        g = torch.Generator().manual_seed(i + self.offset)
        y = (i + self.offset) % 3
        return torch.randn(4, generator=g) + y, y


def arrays(node_id, root):
    rng = np.random.default_rng(len(node_id))
    x = torch.from_numpy(rng.normal(size=(30, 4)).astype(np.float32))
    y = torch.arange(30) % 3
    return x, y, x[:9], y[:9]


def datasets(node_id, root):
    return Counting(40), Counting(10, offset=100)


def datasets_with_targets(node_id, root):
    return Counting(40, targets=True), Counting(10, offset=100, targets=True)


def bad_labels(node_id, root):
    return np.zeros((5, 2)), np.array([0, 1, 7, 9, -1]), np.zeros((1, 2)), np.array([0])


def broken(node_id, root):
    raise RuntimeError(f"no data for {node_id} under {root}")
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    name = f"own_data_user_{abs(hash(str(tmp_path))) % 10**8}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_function_returning_arrays(user_module):
    cfg = DatasetConfig(name=f"{user_module}:arrays", partition="none", classes=3)
    d = D.load_node_data(cfg, ["abc"], "abc", seed=0)
    assert d.train_x.shape == (30, 4) and len(d.test_y) == 9 and d.num_classes == 3
    assert d.input_spec == {"kind": "array", "shape": [4]} and d.source == cfg.name


def test_function_returning_datasets_is_read_item_by_item_and_trains(user_module):
    mod = sys.modules.get(user_module) or __import__(user_module)
    cfg = DatasetConfig(name=f"{user_module}:datasets", partition="none", classes=3)
    mod.CALLS["getitem"] = 0
    d = D.load_node_data(cfg, ["a"], "a", seed=0)
    # labels read once item by item (50), plus the first item of each for the shape
    assert mod.CALLS["getitem"] <= 40 + 10 + 2
    assert d.train_x is None and d.test_x is None
    assert d.train_set is not None and d.train_set.dataset.__class__.__name__ == "Counting"
    assert d.train_y.tolist() == [i % 3 for i in range(40)] and d.train_hist == [14, 13, 13]
    assert d.input_shape == (4,) and d.input_spec == {"kind": "array", "shape": [4]}
    mod.CALLS["getitem"] = 0
    with_targets = DatasetConfig(
        name=f"{user_module}:datasets_with_targets", partition="none", classes=3
    )
    d2 = D.load_node_data(with_targets, ["a"], "a", seed=0)
    assert mod.CALLS["getitem"] <= 2  # labels from .targets: only the shape is read
    assert torch.equal(d2.train_y, d.train_y)
    # training reads it by batches, deterministically by seed
    torch.manual_seed(0)
    model = build_model(TopologyConfig(name="t", nodes=1, model={"name": "mlp"}).model, 3, (4,))
    twin = build_model(TopologyConfig(name="t", nodes=1, model={"name": "mlp"}).model, 3, (4,))
    twin.load_state_dict(model.state_dict())
    tcfg = TrainingConfig(epochs=3, batch_size=8, lr=0.1)
    r1 = train_local(model, d.train_inputs, None, tcfg, 0.1, seed=5)
    r2 = train_local(twin, d.train_inputs, None, tcfg, 0.1, seed=5)
    assert r1.steps == 15 and r1.loss == r2.loss
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), twin.state_dict().values(), strict=True)
    )
    acc, loss = evaluate(model, d.test_inputs, None, batch_size=4)
    assert 0.0 <= acc <= 1.0 and np.isfinite(loss)
    assert acc > 0.5  # class-structured inputs (mean = label)


# ----------------------------------------------------------------------------- image folders


def _flat_images(root: Path, classes: dict[str, int], n: int = 10) -> None:
    from PIL import Image

    for cls, level in classes.items():
        (root / cls).mkdir(parents=True)
        for i in range(n):
            Image.new("L", (4, 3), level + i).save(root / cls / f"{i}.png")


def test_imagefolder_without_test_folder_is_split_deterministically(tmp_path):
    _flat_images(tmp_path / "mine", {"b": 200, "a": 10})
    cfg = DatasetConfig(name="imagefolder", root=str(tmp_path / "mine"), partition="none")
    d = D.load_node_data(cfg, ["n0"], "n0", seed=0, cache_dir=tmp_path / "cache")
    D.clear_cache()
    again = D.load_node_data(cfg, ["n0"], "n0", seed=0, cache_dir=tmp_path / "cache2")
    assert torch.equal(d.train_x, again.train_x) and torch.equal(d.test_y, again.test_y)
    assert d.classes == ["a", "b"] and d.test_hist == [2, 2] and d.train_hist == [8, 8]
    assert d.input_shape == (1, 3, 4)
    assert d.input_spec == {
        "kind": "image",
        "channels": 1,
        "size": [3, 4],
        "mean": [0.5],
        "std": [0.5],
    }
    # the class "b" images are the bright ones
    assert float(d.train_x[d.train_y == 1].mean()) > 0.5 > float(d.train_x[d.train_y == 0].mean())


def test_imagefolder_zip_of_train_only_with_class_names(tmp_path):
    import io

    from PIL import Image

    src = tmp_path / "mine.zip"
    with zipfile.ZipFile(src, "w") as zf:
        for cls, level in (("dog", 200), ("cat", 40)):
            for i in range(5):
                buf = io.BytesIO()
                Image.new("RGB", (5, 6), (level, level, level)).save(buf, format="PNG")
                zf.writestr(f"top/train/{cls}/{i}.png", buf.getvalue())
    names = ["ant", "cat", "dog"]
    cfg = DatasetConfig(name="imagefolder", root=str(src), partition="none", classes=names)
    d = D.load_node_data(cfg, ["n0"], "n0", seed=1, cache_dir=tmp_path / "c")
    assert d.num_classes == 3 and d.classes == names
    assert [a + b for a, b in zip(d.train_hist, d.test_hist, strict=True)] == [0, 5, 5]
    assert d.input_shape == (3, 6, 5) and sum(d.test_hist) == 2


def test_imagefolder_with_test_folder_and_nodes_of_different_folders(tmp_path):
    _flat_images(tmp_path / "n0" / "train", {"cat": 10, "dog": 200}, n=4)
    _flat_images(tmp_path / "n0" / "test", {"cat": 10, "emu": 100}, n=2)  # emu: test only
    _flat_images(tmp_path / "n1", {"cat": 10, "dog": 200}, n=4)
    topo = _topo(tmp_path, name="imagefolder", root=str(tmp_path / "{id}"))
    d = check_node_data(topo, "n0", cache_dir=tmp_path / "c")
    assert d.classes == ["cat", "dog", "emu"] and d.train_hist == [4, 4, 0]
    assert d.test_hist == [2, 0, 2]  # the test folder as it is: no split
    with pytest.raises(ConfigError) as exc:
        check_inputs(topo, source="t.yaml", cache_dir=tmp_path / "c")
    assert exc.value.errors[0][0] == "dataset.classes", str(exc.value)
    assert "node 'n1'" in str(exc.value) and str(tmp_path / "n1") in str(exc.value)
    names = ["cat", "dog", "emu"]
    named = _topo(tmp_path, name="imagefolder", root=str(tmp_path / "{id}"), classes=names)
    check_inputs(named, source="t.yaml", cache_dir=tmp_path / "c")  # one label space: fine
    d1 = check_node_data(named, "n1", cache_dir=tmp_path / "c")
    assert d1.num_classes == 3 and d1.train_hist[2] == 0 and sum(d1.test_hist) == 2


def test_imagefolder_folder_not_in_classes_is_named(tmp_path):
    _flat_images(tmp_path / "n0", {"cat": 10, "zebra": 200}, n=3)
    topo = _topo(tmp_path, name="imagefolder", root=str(tmp_path / "{id}"), classes=["cat", "dog"])
    err = _bad(topo, cache_dir=tmp_path / "c")
    msg = _assert_names(err, "dataset.classes", "n0", tmp_path / "n0")
    assert "'zebra'" in msg and "'cat'" not in msg.split("):")[-1]


# ----------------------------------------------------------------------------- built-ins


def test_partition_none_on_synthetic_gives_the_whole_dataset(tmp_path):
    syn = dict(
        name="synthetic",
        partition="none",
        num_classes=4,
        input_shape=[1, 4, 4],
        synthetic_train=200,
        synthetic_test=80,
    )
    cfg = DatasetConfig(**syn)
    D.clear_cache()
    arrays = D.load_arrays(cfg, 0)
    a = D.load_node_data(cfg, ["n0", "n1"], "n0", seed=0)
    b = D.load_node_data(cfg, ["n0", "n1"], "n1", seed=0)
    assert torch.equal(a.train_x, torch.from_numpy(np.array(arrays.train_x)))
    assert torch.equal(a.test_y, torch.from_numpy(np.array(arrays.test_y)))
    assert torch.equal(a.train_x, b.train_x)  # everything, on every node
    assert a.input_spec == {"kind": "array", "shape": [1, 4, 4]} and a.source == "synthetic"
    assert a.classes == ["0", "1", "2", "3"]
    capped = D.load_node_data(
        DatasetConfig(**syn, train_per_node=40, test_per_node=12), ["n0"], "n0", seed=0
    )
    assert len(capped.train_y) == 40 and capped.train_hist == [10, 10, 10, 10]
    assert len(capped.test_y) == 12
    # with a larger label space: num_classes is the swarm's
    wider = D.load_node_data(DatasetConfig(**syn, classes=6), ["n0"], "n0", seed=0)
    assert wider.num_classes == 6 and wider.train_hist[4:] == [0, 0]
    with pytest.raises(D.DatasetError, match="labels outside"):
        D.load_node_data(DatasetConfig(**syn, classes=3), ["n0"], "n0", seed=0)


def test_partitioned_built_ins_say_what_they_read():
    cfg = DatasetConfig(
        name="synthetic", partition="iid", num_classes=3, synthetic_train=60, synthetic_test=30
    )
    d = D.load_node_data(cfg, ["a", "b"], "a", seed=0)
    assert d.classes == ["0", "1", "2"] and d.source == "synthetic"
    assert d.input_spec == {"kind": "array", "shape": [1, 8, 8]}


def test_id_templates_in_root_and_data_root(tmp_path):
    for i, node in enumerate(["n0", "n1"]):
        (tmp_path / node).mkdir()
        _table(20 + 10 * i, seed=i).to_csv(tmp_path / node / "data.csv", index=False)
        _table(20 + 10 * i, seed=i).to_csv(tmp_path / f"{node}.csv", index=False)
    topo = _topo(tmp_path, name="csv", root=str(tmp_path / "{id}.csv"), classes=3)
    d0, d1 = (check_node_data(topo, n) for n in ("n0", "n1"))
    assert d0.source == str(tmp_path / "n0.csv") and d1.source == str(tmp_path / "n1.csv")
    assert len(d0.train_y) + len(d0.test_y) == 20 and len(d1.train_y) + len(d1.test_y) == 30
    # a device's data_root overrides dataset.root, with {id} too
    d1b = check_node_data(topo, "n1", data_root=str(tmp_path / "{id}"))
    assert d1b.source == str(tmp_path / "n1" / "data.csv")
    check_inputs(topo, source="t.yaml")  # every node opens, the model takes (3,)


def test_validate_refuses_nodes_with_different_input_shapes(tmp_path):
    _table(20).to_csv(tmp_path / "n0.csv", index=False)
    _table(20).drop(columns=["f2"]).to_csv(tmp_path / "n1.csv", index=False)
    topo = _topo(tmp_path, name="csv", root=str(tmp_path / "{id}.csv"), classes=3)
    with pytest.raises(ConfigError) as exc:
        check_inputs(topo, source="t.yaml")
    msg = str(exc.value)
    assert exc.value.errors[0][0] == "dataset.root" and "node 'n1'" in msg, msg
    assert str(tmp_path / "n1.csv") in msg and "[2]" in msg and "[3]" in msg, msg


def test_the_daemon_loads_its_own_data_and_records_it(tmp_path):
    from p2pfl.node.daemon import Node, NodeOptions

    (tmp_path / "data").mkdir()
    _table(30).to_csv(tmp_path / "data" / "n1.csv", index=False)
    topo = _topo(tmp_path, name="csv", root="/nonexistent/{id}.csv", classes=3)
    out = tmp_path / "run"
    (out / "nodes").mkdir(parents=True)
    node = Node(topo, "n1", NodeOptions(data_root=str(tmp_path / "data" / "{id}.csv"), out_dir=out))
    node._load()
    assert node.data is not None and node.data.input_shape == (3,)
    assert node.method is not None and node.method.ctx.num_classes == 3
    node._write_run_files()
    meta = json.loads((out / "nodes" / "n1.meta.json").read_text())
    assert meta["input_spec"]["kind"] == "tabular" and meta["classes"] == ["0", "1", "2"]
    assert meta["data_source"] == str(tmp_path / "data" / "n1.csv")


# ----------------------------------------------------------------------------- bad inputs


def test_missing_label_column(tmp_path):
    path = tmp_path / "n0.csv"
    _table(10).rename(columns={"label": "y"}).to_csv(path, index=False)
    msg = _assert_names(
        _bad(_topo(tmp_path, name="csv", root=str(path), classes=3)), "dataset.label", "n0", path
    )
    assert "no label column 'label'" in msg and "f0, f1, f2, y" in msg


def test_string_feature_column(tmp_path):
    path = tmp_path / "n0.csv"
    df = _table(10)
    df["city"] = "Lyon"
    df.to_csv(path, index=False)
    msg = _assert_names(
        _bad(_topo(tmp_path, name="csv", root=str(path), classes=3)), "dataset.root", "n0", path
    )
    assert "column 'city' is not numeric" in msg


def test_nan_feature_column(tmp_path):
    path = tmp_path / "n0.csv"
    df = _table(10)
    df.loc[3, "f1"] = np.nan
    df.to_csv(path, index=False)
    msg = _assert_names(
        _bad(_topo(tmp_path, name="csv", root=str(path), classes=3)), "dataset.root", "n0", path
    )
    assert "f1" in msg and "NaN" in msg


@pytest.mark.parametrize("content", ["", "f0,f1,label\n"])
def test_empty_data_file(tmp_path, content):
    path = tmp_path / "n0.csv"
    path.write_text(content)
    msg = _assert_names(
        _bad(_topo(tmp_path, name="csv", root=str(path), classes=3)), "dataset.root", "n0", path
    )
    assert "empty file" in msg


def test_empty_parquet_file(tmp_path):
    path = tmp_path / "n0.parquet"
    _table(5).iloc[:0].to_parquet(path, engine="pyarrow")
    msg = _assert_names(
        _bad(_topo(tmp_path, name="parquet", root=str(path), classes=3)), "dataset.root", "n0", path
    )
    assert "empty file" in msg


def test_label_outside_classes(tmp_path):
    path = tmp_path / "n0.csv"
    df = _table(20)
    df.loc[:7, "label"] = [3, 4, 5, 6, 7, 8, 9, -1]
    df.to_csv(path, index=False)
    msg = _assert_names(
        _bad(_topo(tmp_path, name="csv", root=str(path), classes=3)), "dataset.classes", "n0", path
    )
    assert "labels 0..2" in msg and "-1, 3, 4, 5, 6 and 3 more" in msg, msg


def test_label_names_outside_classes(tmp_path):
    path = tmp_path / "n0.csv"
    _table(12, names=["cat", "dog", "yak"]).to_csv(path, index=False)
    topo = _topo(tmp_path, name="csv", root=str(path), classes=["cat", "dog"])
    msg = _assert_names(_bad(topo), "dataset.classes", "n0", path)
    assert "'yak'" in msg


def test_own_files_need_the_swarms_classes(tmp_path):
    path = tmp_path / "n0.csv"
    _table(10).to_csv(path, index=False)
    msg = _assert_names(
        _bad(_topo(tmp_path, name="csv", root=str(path))), "dataset.classes", "n0", path
    )
    assert "needs dataset.classes" in msg


def test_stats_file_without_a_column(tmp_path):
    path = tmp_path / "n0.csv"
    _table(10).to_csv(path, index=False)
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({"mean": {"f0": 0, "f1": 0}, "std": {"f0": 1, "f1": 1}}))
    topo = _topo(tmp_path, name="csv", root=str(path), classes=3, stats=str(stats))
    msg = _assert_names(_bad(topo), "dataset.stats", "n0", stats)
    assert "f2" in msg


def test_missing_root(tmp_path):
    topo = _topo(tmp_path, name="csv", root=str(tmp_path / "{id}.csv"), classes=3)
    _assert_names(_bad(topo, node="n1"), "dataset.root", "n1", tmp_path / "n1.csv")


def test_dataset_function_that_does_not_import(tmp_path):
    topo = _topo(tmp_path, name="no_such_module_xyz:load", classes=3)
    msg = str(_bad(topo, node="n1"))
    assert msg.startswith("t.yaml: dataset.name: node 'n1': "), msg
    assert "'no_such_module_xyz:load'" in msg and "no module named" in msg, msg


def test_dataset_function_that_raises(tmp_path, user_module):
    topo = _topo(tmp_path, name=f"{user_module}:broken", root=str(tmp_path / "{id}"), classes=3)
    msg = _assert_names(_bad(topo, node="n1"), "dataset.name", "n1", f"{user_module}.py")
    assert "RuntimeError: no data for n1" in msg and f"{user_module}:broken" in msg, msg


def test_dataset_function_with_labels_outside_classes(tmp_path, user_module):
    topo = _topo(tmp_path, name=f"{user_module}:bad_labels", classes=3)
    msg = _assert_names(_bad(topo), "dataset.classes", "n0", f"{user_module}.py")
    assert "-1, 7, 9" in msg, msg


def test_own_data_needs_partition_none():
    cfg = DatasetConfig(name="csv", root="x.csv", partition="iid", classes=3)
    with pytest.raises(D.DatasetError, match="partition: none") as exc:
        D.load_node_data(cfg, ["a"], "a", seed=0)
    assert exc.value.field == "dataset.partition"


# ----------------------------------------------------------------------------- the split


def test_data_module_keeps_its_public_names():
    import p2pfl.learning.data as data

    for name in [*data.__all__, "DatasetError"]:
        assert hasattr(data, name), name
    assert issubclass(data.DatasetError, ValueError)


# ----------------------------------------------------------------------------- a test file of its own


def test_a_nodes_test_root_is_its_test_file_beside_any_train_file(tmp_path):
    (tmp_path / "train").mkdir()
    for i, node in enumerate(("n0", "n1")):
        _table(40, seed=i).to_csv(tmp_path / "train" / f"{node}.csv", index=False)
        _table(12, seed=10 + i).to_csv(tmp_path / f"{node}-test.csv", index=False)
    cfg = DatasetConfig(
        name="csv",
        root=str(tmp_path / "train" / "{id}.csv"),
        test_root=str(tmp_path / "{id}-test.csv"),
        partition="none",
        classes=[0, 1, 2],  # numbers as class names
    )
    d = D.load_node_data(cfg, ["n0", "n1"], "n1", seed=0)
    assert len(d.train_y) == 40 and len(d.test_y) == 12  # the whole file, no test_fraction
    assert d.classes == ["0", "1", "2"] and d.test_hist == [4, 4, 4]
    assert d.source == str(tmp_path / "train" / "n1.csv")


def test_a_missing_test_root_names_the_node_the_file_and_the_field(tmp_path):
    _table(30).to_csv(tmp_path / "n0.csv", index=False)
    cfg = _topo(
        tmp_path,
        name="csv",
        root=str(tmp_path / "{id}.csv"),
        test_root=str(tmp_path / "{id}-test.csv"),
        classes=3,
    )
    _assert_names(_bad(cfg), "dataset.test_root", "n0", tmp_path / "n0-test.csv")


def test_test_root_is_for_a_nodes_own_table_only():
    with pytest.raises(ValueError, match="test_root: a node's own test file"):
        DatasetConfig(name="fashionmnist", test_root="t.csv")


def test_number_labels_are_the_classes_they_name(tmp_path):
    path = tmp_path / "n0.csv"
    df = _table(30)
    df["label"] = df["label"].map({0: 7, 1: 3, 2: 5})
    df.to_csv(path, index=False)
    cfg = DatasetConfig(name="csv", root=str(path), partition="none", classes=[3, 5, 7])
    d = D.load_node_data(cfg, ["n0"], "n0", seed=0)
    by_class = {c: d.train_x[d.train_y == i][:, 0].mean().item() for i, c in enumerate(d.classes)}
    # label 7 held class 0's rows (the lowest feature mean): it is class "7", not index 7
    assert d.classes == ["3", "5", "7"] and by_class["7"] < by_class["3"] < by_class["5"]
