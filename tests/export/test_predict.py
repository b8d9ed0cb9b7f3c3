"""p2pfl predict: a node's trained model on a CSV file and on an image folder."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from export_helpers import make_run
from PIL import Image

from p2pfl.cli import main
from p2pfl.export import ExportError, classify, load_model, predict

FEATURES = ["age", "bmi", "bp", "s1", "s2"]
MEAN = [50.0, 25.0, 90.0, 1.0, -2.0]
STD = [10.0, 4.0, 12.0, 0.5, 0.0]  # a constant feature: std 0 is taken as 1
CLASSES = ["low", "mid", "high"]
TABULAR = {"kind": "tabular", "features": FEATURES, "label": "risk", "mean": MEAN, "std": STD}


@pytest.fixture
def tabular_run(tmp_path):
    return make_run(tmp_path, input_shape=(5,), num_classes=3, classes=CLASSES, input_spec=TABULAR)


def _table(n=40, seed=3):
    rng = np.random.default_rng(seed)
    df = pd.DataFrame(
        {f: rng.normal(m, max(s, 1.0), n) for f, m, s in zip(FEATURES, MEAN, STD, strict=True)}
    )
    df["risk"] = rng.choice(CLASSES, n)
    df["note"] = "x"  # a column the model does not read
    return df[["note", "risk", *reversed(FEATURES)]]  # any column order


def test_predict_csv(tabular_run, tmp_path, monkeypatch):
    df = _table()
    src = tmp_path / "patients.csv"
    df.to_csv(src, index=False)
    monkeypatch.chdir(tmp_path)
    result = classify(tabular_run.dir, "a", src)
    assert result.path == tmp_path / "predictions-a.csv"
    out = pd.read_csv(result.path)
    assert list(out.columns) == ["row", "predicted", "label", "p_low", "p_mid", "p_high"]
    assert out["row"].tolist() == list(range(len(df)))
    np.testing.assert_allclose(out[["p_low", "p_mid", "p_high"]].sum(axis=1), 1.0, atol=1e-6)
    # what the model says on the inputs normalised by hand
    std = np.where(np.array(STD) > 0, STD, 1.0)
    x = torch.tensor(((df[FEATURES].to_numpy() - MEAN) / std), dtype=torch.float32)
    with torch.no_grad():
        want = tabular_run.models["a"](x).argmax(1).numpy()
    assert out["predicted"].tolist() == want.tolist()
    assert out["label"].tolist() == [CLASSES[k] for k in want]
    truth = [CLASSES.index(v) for v in df["risk"]]
    assert result.labelled == len(df)
    assert result.accuracy == pytest.approx(float(np.mean(want == truth)))


def test_predict_csv_labels_as_indices_and_no_labels(tabular_run, tmp_path):
    df = _table()
    df["risk"] = [CLASSES.index(v) for v in df["risk"]]  # labels given as class indices
    df.to_csv(tmp_path / "a.csv", index=False)
    by_index = classify(tabular_run.dir, "a", tmp_path / "a.csv", tmp_path / "p1.csv")
    df.drop(columns="risk").to_csv(tmp_path / "b.csv", index=False)
    unlabelled = classify(tabular_run.dir, "a", tmp_path / "b.csv", tmp_path / "p2.csv")
    assert by_index.accuracy is not None and unlabelled.accuracy is None
    assert (tmp_path / "p1.csv").read_text() == (tmp_path / "p2.csv").read_text()


def test_predict_csv_missing_feature_column_is_named(tabular_run, tmp_path):
    _table().drop(columns="bmi").to_csv(tmp_path / "x.csv", index=False)
    with pytest.raises(ExportError, match=r"x.csv: missing feature column\(s\) 'bmi'"):
        predict(tabular_run.dir, "a", tmp_path / "x.csv", tmp_path / "out.csv")
    assert not (tmp_path / "out.csv").exists()
    df = _table()
    df["bp"] = "high"
    df.to_csv(tmp_path / "y.csv", index=False)
    with pytest.raises(ExportError, match=r"y.csv: column\(s\) 'bp' hold non-numbers"):
        predict(tabular_run.dir, "a", tmp_path / "y.csv", tmp_path / "out.csv")


def test_predict_csv_on_an_image_model_is_refused(tmp_path):
    run = make_run(tmp_path, input_spec={"kind": "image", "channels": 1, "size": [8, 8]})
    _table().to_csv(tmp_path / "x.csv", index=False)
    with pytest.raises(ExportError, match="not trained on tabular data.*image folder"):
        predict(run.dir, "a", tmp_path / "x.csv")


IMAGE_SPEC = {"kind": "image", "channels": 1, "size": [8, 8], "mean": [0.3], "std": [0.25]}


def test_predict_image_folder(tmp_path, monkeypatch):
    run = make_run(
        tmp_path, model="cnn", classes=["cat", "dog", "eel", "fox"], input_spec=IMAGE_SPEC
    )
    rng = np.random.default_rng(0)
    root = tmp_path / "images"
    pixels = {}
    for rel in ("cat/1.png", "cat/2.png", "dog/x/3.png", "unsorted/4.png", "5.png"):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        arr = rng.integers(0, 256, (8, 8), dtype=np.uint8)
        Image.fromarray(arr, mode="L").save(p)
        pixels[rel] = arr
    Image.fromarray(rng.integers(0, 256, (12, 10, 3), dtype=np.uint8), "RGB").save(
        root / "dog" / "rgb.png"
    )  # converted to grey and resized to 8x8
    (root / "notes.txt").write_text("not an image")
    monkeypatch.chdir(tmp_path)
    assert main(["predict", str(run.dir), "--node", "b", str(root)]) == 0
    out = pd.read_csv(tmp_path / "predictions-b.csv")
    assert list(out.columns) == ["file", "predicted", "label", "p_cat", "p_dog", "p_eel", "p_fox"]
    assert out["file"].tolist() == [
        "5.png",
        "cat/1.png",
        "cat/2.png",
        "dog/rgb.png",
        "dog/x/3.png",
        "unsorted/4.png",
    ]
    model = load_model(run.dir, "b")
    x = torch.tensor(np.stack([pixels[f] for f in ("5.png", "cat/1.png")]), dtype=torch.float32)
    x = ((x / 255.0 - 0.3) / 0.25)[:, None]
    with torch.no_grad():
        want = torch.softmax(model(x), 1).numpy()
    got = out[["p_cat", "p_dog", "p_eel", "p_fox"]].to_numpy()[:2]
    np.testing.assert_allclose(got, want, atol=1e-6)
    result = classify(run.dir, "b", root, tmp_path / "again.csv")
    assert result.rows == 6 and result.labelled == 4  # the files under cat/ and dog/


def test_predict_image_folder_errors(tmp_path):
    run = make_run(tmp_path, model="cnn", input_spec=IMAGE_SPEC)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match="empty: no image files"):
        predict(run.dir, "a", tmp_path / "empty")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "broken.png").write_bytes(b"not a png")
    with pytest.raises(ExportError, match="broken.png: not a readable image"):
        predict(run.dir, "a", tmp_path / "bad", tmp_path / "o.csv")
    with pytest.raises(ExportError, match="nothing.csv: no such file"):
        predict(run.dir, "a", tmp_path / "nothing.csv")


def test_predict_npy(tmp_path):
    run = make_run(tmp_path)
    x = np.random.default_rng(1).normal(size=(7, 1, 8, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    out = pd.read_csv(predict(run.dir, "a", tmp_path / "x.npy", tmp_path / "p.csv"))
    with torch.no_grad():
        want = run.models["a"](torch.from_numpy(x)).argmax(1).tolist()
    assert out["predicted"].tolist() == want
    assert out["label"].astype(str).tolist() == [str(k) for k in want]  # classes "0".."3"


def test_cli_predict_prints_the_accuracy(tabular_run, tmp_path, capsys):
    _table().to_csv(tmp_path / "t.csv", index=False)
    out = tmp_path / "preds" / "p.csv"
    code = main(
        ["predict", str(tabular_run.dir), "--node", "a", str(tmp_path / "t.csv"), "--out", str(out)]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert f"40 predictions written to {out}" in printed and "accuracy" in printed
    assert main(["predict", str(tabular_run.dir), "--node", "q", str(tmp_path / "t.csv")]) == 2
    assert "nodes with models: a, b" in capsys.readouterr().err


def test_predict_without_input_spec_says_so(tmp_path):
    run = make_run(tmp_path)  # a model.json without input_spec
    _table().to_csv(tmp_path / "x.csv", index=False)
    with pytest.raises(ExportError, match=r"a.model.json: no input_spec.*\.npy"):
        predict(run.dir, "a", tmp_path / "x.csv")


def test_classes_that_do_not_match_are_refused_at_write(tmp_path):
    with pytest.raises(ExportError, match="field 'classes': expected 4 class names"):
        make_run(tmp_path, classes=["x", "y"])


def test_predict_npy_of_uint8_is_scaled_as_the_dataset_did(tmp_path):
    run = make_run(tmp_path, input_spec={"kind": "array", "shape": [1, 8, 8], "scale": 255.0})
    raw = np.random.default_rng(2).integers(0, 256, (5, 1, 8, 8), dtype=np.uint8)
    np.save(tmp_path / "x.npy", raw)
    out = pd.read_csv(predict(run.dir, "a", tmp_path / "x.npy", tmp_path / "p.csv"))
    with torch.no_grad():
        probs = torch.softmax(run.models["a"](torch.from_numpy(raw / np.float32(255))), 1)
    np.testing.assert_allclose(out[[f"p_{c}" for c in "0123"]].to_numpy(), probs, atol=1e-6)


def test_predict_reads_the_model_a_site_serves(tmp_path):
    """``p2pfl predict --site site.yaml INPUT``: the site's served model (its store's
    ``current.json``), the same answers as naming its folder and node."""
    import pandas as pd
    from export_helpers import CLASSES, FEATURES, SPEC, two_tabular_runs

    from p2pfl.sites.models.store import ModelStore

    first, _ = two_tabular_runs(tmp_path, SPEC, CLASSES)
    site = tmp_path / "site.yaml"
    site.write_text("site: a\nswarm: f\nstate_dir: state\n")
    rows = tmp_path / "rows.csv"
    pd.DataFrame([[50, 25, 90], [40, 30, 70]], columns=FEATURES).to_csv(rows, index=False)
    with pytest.raises(SystemExit, match="serves no model yet"):
        main(["predict", "--site", str(site), str(rows)])
    store = ModelStore(tmp_path / "state", "a")
    entry = store.add(first.dir, "run1")
    store.promote(entry.id)
    out = tmp_path / "served.csv"
    assert main(["predict", "--site", str(site), str(rows), "--out", str(out)]) == 0
    want = tmp_path / "direct.csv"
    assert (
        main(["predict", str(store.path(entry.id)), "--node", "a", str(rows), "--out", str(want)])
        == 0
    )
    assert out.read_text() == want.read_text()
