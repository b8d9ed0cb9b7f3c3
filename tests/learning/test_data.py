"""Per-node splits and loaders (synthetic and tiny generated data only)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from imagefolder_zip import make_imagefolder_zip

from p2pfl.config.schema import DatasetConfig
from p2pfl.learning import data as D

# ----------------------------------------------------------------------------- node data


def _synthetic(**kw) -> DatasetConfig:
    base = dict(
        name="synthetic",
        partition="dirichlet(0.5)",
        num_classes=4,
        input_shape=[1, 8, 8],
        synthetic_train=800,
        synthetic_test=400,
    )
    base.update(kw)
    return DatasetConfig(**base)


def test_synthetic_node_data_is_deterministic_and_well_formed():
    ids = ["a", "b", "c", "d"]
    cfg = _synthetic()
    datas = [D.load_node_data(cfg, ids, nid, seed=0) for nid in ids]
    D.clear_cache()
    again = D.load_node_data(cfg, ids, "b", seed=0)
    assert torch.equal(again.train_x, datas[1].train_x)
    assert torch.equal(again.test_y, datas[1].test_y)
    other = D.load_node_data(cfg, ids, "b", seed=1)
    assert not torch.equal(other.train_y, datas[1].train_y) or not torch.equal(
        other.train_x, datas[1].train_x
    )
    assert sum(len(d.train_y) for d in datas) == 800
    for d in datas:
        assert d.train_x.dtype == torch.float32 and d.train_y.dtype == torch.int64
        assert d.train_x.shape[1:] == (1, 8, 8) and d.input_shape == (1, 8, 8)
        assert d.num_classes == 4
        assert d.train_hist == np.bincount(d.train_y.numpy(), minlength=4).tolist()
        assert d.test_hist == np.bincount(d.test_y.numpy(), minlength=4).tolist()
        # the test split follows the node's own train label distribution (ratio 400/800)
        assert len(d.test_y) == round(len(d.train_y) / 2)
        assert {i for i, v in enumerate(d.test_hist) if v} == {
            i for i, v in enumerate(d.train_hist) if v
        }
        tr = np.array(d.train_hist) / sum(d.train_hist)
        te = np.array(d.test_hist) / sum(d.test_hist)
        assert np.abs(tr - te).max() < 0.05


def test_partition_is_drawn_once_per_process_and_matches_a_fresh_draw(monkeypatch):
    """The nodes a process packs share one partition draw; each node's shard is the one a
    fresh :func:`partition_indices` gives, and a changed node list or spec draws again."""
    ids = [f"n{i}" for i in range(6)]
    cfg = _synthetic()
    D.clear_cache()
    draws = []
    real = D.partition_indices
    monkeypatch.setattr(D, "partition_indices", lambda *a, **k: draws.append(a) or real(*a, **k))
    datas = [D.load_node_data(cfg, ids, nid, seed=0) for nid in ids]
    assert len(draws) == 1
    arrays = D.load_arrays(cfg, 0)
    fresh = real(arrays.train_y, 6, "dirichlet(0.5)", 0, 4, cfg.min_samples, salt="synthetic")
    for d, idx in zip(datas, fresh, strict=True):
        assert torch.equal(d.train_y, torch.from_numpy(arrays.train_y[idx]))
    D.load_node_data(cfg, ids[:5], "n0", seed=0)
    D.load_node_data(_synthetic(partition="iid"), ids, "n0", seed=0)
    assert len(draws) == 3
    D.clear_cache()  # a dataset loaded again gets its own draw
    D.load_node_data(cfg, ids, "n1", seed=0)
    assert len(draws) == 4


def test_synthetic_is_class_structured():
    """Nearest class mean on the train set classifies the test set almost perfectly."""
    arr = D.load_arrays(_synthetic(num_classes=5, input_shape=[3, 4, 4]), seed=0)
    x = arr.train_x.reshape(len(arr.train_x), -1)
    means = np.stack([x[arr.train_y == c].mean(0) for c in range(5)])
    tx = arr.test_x.reshape(len(arr.test_x), -1)
    pred = np.argmin(((tx[:, None] - means[None]) ** 2).sum(-1), axis=1)
    assert (pred == arr.test_y).mean() > 0.95


def test_train_and_test_per_node_caps():
    ids = [f"n{i}" for i in range(3)]
    cfg = _synthetic(partition="iid", train_per_node=50, test_per_node=20)
    d = D.load_node_data(cfg, ids, "n2", seed=0)
    assert len(d.train_y) == 50 and len(d.test_y) == 20
    with pytest.raises(ValueError, match="not in the swarm"):
        D.load_node_data(cfg, ids, "zz", seed=0)


def test_min_samples_in_config_is_used():
    cfg = _synthetic(synthetic_train=100, min_samples=30)
    with pytest.raises(ValueError, match="min_samples"):
        D.load_node_data(cfg, ["a", "b", "c", "d"], "a", seed=0)


# ----------------------------------------------------------------------------- image folders


@pytest.mark.parametrize("top", ["", "tiny/"])
def test_imagefolder_zip(tmp_path, top):
    src = tmp_path / "tiny.zip"
    make_imagefolder_zip(src, top)
    cache = tmp_path / "cache"
    cfg = DatasetConfig(name="imagefolder", root=str(src), partition="iid", min_samples=1)
    D.clear_cache()
    arr = D.load_arrays(cfg, seed=0, cache_dir=cache)
    assert arr.classes == ["ant", "cat", "dog"]
    assert arr.train_x.shape == (12, 3, 6, 5) and arr.train_x.dtype == np.uint8
    assert arr.test_x.shape == (6, 3, 6, 5)
    assert isinstance(arr.train_x, np.memmap)
    means = [arr.train_x[arr.train_y == c].mean() for c in range(3)]
    assert means == pytest.approx([120, 40, 200], abs=3)
    assert list((cache / "imagefolder").glob("*/meta.json"))
    d = D.load_node_data(cfg, ["a", "b"], "a", seed=0, cache_dir=cache)
    assert d.train_x.dtype == torch.float32 and d.input_shape == (3, 6, 5)
    assert len(d.train_y) == 6 and d.num_classes == 3
    assert float(d.train_x.min()) >= -1.0 and float(d.train_x.max()) <= 1.0
    assert d.classes == ["ant", "cat", "dog"] and d.source == str(src)
    assert d.input_spec == {
        "kind": "image",
        "channels": 3,
        "size": [6, 5],
        "mean": [0.5] * 3,
        "std": [0.5] * 3,
    }
    # a second load (fresh process state) reads the cache
    D.clear_cache()
    again = D.load_arrays(cfg, seed=0, cache_dir=cache)
    assert np.array_equal(np.asarray(again.train_x), np.asarray(arr.train_x))


def test_imagefolder_directory_and_missing(tmp_path):
    from PIL import Image

    for split in ("train", "test"):
        for c in ("b", "a"):
            (tmp_path / "ds" / split / c).mkdir(parents=True)
            for i in range(3):
                Image.new("L", (4, 4), 10 if c == "a" else 250).save(
                    tmp_path / "ds" / split / c / f"{i}.jpg"
                )
    arr = D.load_imagefolder(tmp_path / "ds", cache_dir=tmp_path / "cache")
    assert arr.classes == ["a", "b"] and arr.input_shape == (1, 4, 4)
    assert arr.train_x[arr.train_y == 1].mean() > 200
    with pytest.raises(FileNotFoundError, match="imagefolder"):
        D.load_imagefolder(tmp_path / "nope", cache_dir=tmp_path / "cache")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="train/<class>"):
        D.load_imagefolder(tmp_path / "empty", cache_dir=tmp_path / "cache")


def test_cifar10_zip_found_under_root(tmp_path):
    """A cifar10*.zip beside other files is found (and cifar100*.zip is not taken for it)."""
    make_imagefolder_zip(tmp_path / "cifar100-other.zip")
    make_imagefolder_zip(tmp_path / "cifar10-tiny.zip", "cifar10/")
    D.clear_cache()
    arr = D.load_arrays(
        DatasetConfig(name="cifar10", root=str(tmp_path)), seed=0, cache_dir=tmp_path / "c"
    )
    assert arr.classes == ["ant", "cat", "dog"]
    assert arr.mean == D.NORMALIZATION["cifar10"][0]
    (tmp_path / "cifar10-tiny.zip").unlink()
    D.clear_cache()
    with pytest.raises(FileNotFoundError, match="cifar10"):
        D.load_arrays(DatasetConfig(name="cifar10", root=str(tmp_path / "none")), 0, tmp_path / "c")


def test_missing_dataset_files_are_a_clear_error(tmp_path):
    D.clear_cache()
    with pytest.raises(FileNotFoundError, match=r"fashionmnist.*" + str(tmp_path)):
        D.load_arrays(DatasetConfig(name="fashionmnist", root=str(tmp_path)), 0, tmp_path)


FMNIST = Path(__file__).resolve().parents[3] / "shared" / "data"


@pytest.mark.skipif(
    not (FMNIST / "FashionMNIST" / "raw" / "train-images-idx3-ubyte.gz").is_file(),
    reason="shared Fashion-MNIST not present",
)
def test_fashionmnist_from_shared_gz(tmp_path):
    t0 = time.perf_counter()
    D.clear_cache()
    cfg = DatasetConfig(name="fashionmnist", root=str(FMNIST), partition="dirichlet(0.5)")
    d = D.load_node_data(cfg, [f"n{i}" for i in range(8)], "n1", seed=0, cache_dir=tmp_path)
    assert (tmp_path / "FashionMNIST" / "raw" / "train-images-idx3-ubyte").is_file()
    assert d.input_shape == (1, 28, 28) and d.num_classes == 10
    assert d.classes[0] == "T-shirt/top" and d.input_spec["mean"] == [0.2860]
    assert d.train_x.dtype == torch.float32 and len(d.train_y) > 1000
    assert abs(float(d.train_x.mean())) < 0.5
    assert time.perf_counter() - t0 < 20
    D.clear_cache()
