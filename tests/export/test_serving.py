"""A site's served model over HTTP (``p2pfl.sites.models.serving``): ``POST /v1/predict`` answers
what ``p2pfl predict`` answers for the same rows and model, ``GET /v1/model`` says which
model it is, a promotion or a rollback swaps the model answering, and bad requests get a
status and a reason. A real server on loopback, real models built like a swarm's."""

from __future__ import annotations

import base64
import http.client
import io
import json
import time

import numpy as np
import pandas as pd
import pytest
from export_helpers import CLASSES, FEATURES, SPEC, make_run, two_tabular_runs
from PIL import Image

from p2pfl.export import classify
from p2pfl.sites.models.serving import ModelServer
from p2pfl.sites.models.store import ModelStore

IMAGE_SPEC = {"kind": "image", "channels": 1, "size": [8, 8], "mean": [0.3], "std": [0.25]}


def _request(server, method, path, body=b"", content_type="application/json"):
    host, port = server.address
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        headers = {"Content-Type": content_type} if method == "POST" else {}
        conn.request(method, path, body=body, headers=headers)
        answer = conn.getresponse()
        return answer.status, json.loads(answer.read())
    finally:
        conn.close()


def _wait(pred, what, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _table(n=40, seed=3):
    rng = np.random.default_rng(seed)
    df = pd.DataFrame(
        {
            f: rng.normal(m, s, n)
            for f, m, s in zip(FEATURES, [50, 25, 90], [10, 4, 12], strict=True)
        }
    )
    df["note"] = "ignored"  # a column the model does not read
    return df


@pytest.fixture
def tabular_store(tmp_path):
    first, second = two_tabular_runs(tmp_path, SPEC, CLASSES)
    store = ModelStore(tmp_path / "state", "a")
    return store, first, second


def _same_as_predict(answer, want: pd.DataFrame) -> None:
    """The server's answer is ``p2pfl predict``'s CSV, class for class and, as float32,
    probability for probability."""
    preds = answer["predictions"]
    assert [p["predicted"] for p in preds] == want["predicted"].tolist()
    assert [p["label"] for p in preds] == want["label"].tolist()
    got = np.array([p["probabilities"] for p in preds], dtype=np.float32)
    expected = want[[f"p_{c}" for c in answer["classes"]]].to_numpy(dtype=np.float32)
    assert np.array_equal(got, expected)


def test_predict_answers_what_p2pfl_predict_answers(tabular_store, tmp_path):
    store, first, _ = tabular_store
    entry = store.add(first.dir, "run1", round_no=4)
    store.promote(entry.id, "the first model")
    df = _table()
    rows_csv = tmp_path / "rows.csv"
    df.to_csv(rows_csv, index=False)
    want = pd.read_csv(classify(store.path(entry.id), "a", rows_csv, tmp_path / "p.csv").path)

    with ModelServer(store, "127.0.0.1", 0) as server:
        server_thread = _serve_in_thread(server)
        records = df.to_dict(orient="records")
        status, answer = _request(server, "POST", "/v1/predict", json.dumps(records))
        assert status == 200 and answer["model"] == entry.id and answer["classes"] == CLASSES
        _same_as_predict(answer, want)
        # {"records": [...]}, JSON rows, and a CSV batch give the same answer
        for body, kind in (
            (json.dumps({"records": records}), "application/json"),
            (
                json.dumps({"columns": list(df.columns), "rows": df.values.tolist()}),
                "application/json",
            ),
            (rows_csv.read_bytes(), "text/csv"),
        ):
            status, again = _request(server, "POST", "/v1/predict", body, kind)
            assert status == 200, again
            _same_as_predict(again, want)

        status, model = _request(server, "GET", "/v1/model")
        assert status == 200
        assert model["model"]["id"] == entry.id and model["model"]["run_id"] == "run1"
        assert model["model"]["round"] == 4
        assert model["lineage"] == [] and model["served_before"] == []
        assert model["input"]["features"] == FEATURES and model["classes"] == CLASSES
        server.shutdown()
        server_thread.join(10)


def test_a_promotion_and_a_rollback_swap_the_model_answering(tabular_store, tmp_path):
    store, first, second = tabular_store
    one = store.add(first.dir, "run1")
    two = store.add(second.dir, "run2")
    df = _table(10)
    body = json.dumps(df.to_dict(orient="records"))
    with ModelServer(store, "127.0.0.1", 0) as server:
        thread = _serve_in_thread(server)
        status, answer = _request(server, "POST", "/v1/predict", body)
        assert status == 503 and "serves no model yet" in answer["error"]
        assert _request(server, "GET", "/v1/model")[0] == 503

        store.promote(one.id)
        _wait(
            lambda: _request(server, "GET", "/v1/model")[1].get("model", {}).get("id") == one.id,
            "run1 served",
        )
        store.promote(two.id)
        _wait(
            lambda: _request(server, "GET", "/v1/model")[1]["model"]["id"] == two.id, "run2 served"
        )
        status, model = _request(server, "GET", "/v1/model")
        assert model["served_before"] == [
            {"id": one.id, "run_id": "run1", "cycle": None, "round": None}
        ]
        rows = tmp_path / "rows.csv"
        df.to_csv(rows, index=False)
        want = pd.read_csv(classify(store.path(two.id), "a", rows, tmp_path / "p.csv").path)
        _same_as_predict(_request(server, "POST", "/v1/predict", body)[1], want)

        store.rollback()
        _wait(
            lambda: _request(server, "GET", "/v1/model")[1]["model"]["id"] == one.id, "rolled back"
        )
        want = pd.read_csv(classify(store.path(one.id), "a", rows, tmp_path / "p.csv").path)
        _same_as_predict(_request(server, "POST", "/v1/predict", body)[1], want)
        server.shutdown()
        thread.join(10)


def test_bad_requests_are_refused_with_a_reason(tabular_store):
    store, first, _ = tabular_store
    store.promote(store.add(first.dir, "run1").id)
    with ModelServer(store, "127.0.0.1", 0, max_request_bytes=4096) as server:
        thread = _serve_in_thread(server)

        def post(body, kind="application/json"):
            return _request(server, "POST", "/v1/predict", body, kind)

        status, answer = post(json.dumps([{"age": 50, "bmi": 25}]))
        assert status == 400 and "missing feature column(s) 'bp'" in answer["error"]
        status, answer = post(json.dumps([{"age": "old", "bmi": 25, "bp": 80}]))
        assert status == 400 and "'age'" in answer["error"] and "non-numbers" in answer["error"]
        status, answer = post("{not json")
        assert status == 400 and "not JSON" in answer["error"]
        status, answer = post(json.dumps({"columns": ["age"], "rows": [[1, 2]]}))
        assert status == 400 and "lists of 1 values" in answer["error"]
        status, answer = post(json.dumps([]))
        assert status == 400 and "no records" in answer["error"]
        status, answer = post(b"\x89PNG", "image/png")
        assert status == 400 and "not trained on images" in answer["error"]
        status, answer = post("a=b", "application/x-www-form-urlencoded")
        assert status == 415
        status, answer = post(json.dumps([{"age": 1, "bmi": 2, "bp": 3}] * 200))
        assert status == 413 and "max_request_bytes 4096" in answer["error"]
        assert _request(server, "GET", "/v1/nothing")[0] == 404
        assert _request(server, "POST", "/v1/model", "{}")[0] == 404
        # the server still answers after all of that
        status, answer = post(json.dumps([{"age": 50, "bmi": 25, "bp": 90}]))
        assert status == 200 and len(answer["predictions"]) == 1
        server.shutdown()
        thread.join(10)


def test_an_image_model_takes_image_bytes(tmp_path):
    run = make_run(tmp_path, input_spec=IMAGE_SPEC, classes=["cat", "dog", "owl", "yak"])
    store = ModelStore(tmp_path / "state", "a")
    store.promote(store.add(run.dir, "img").id)
    folder = tmp_path / "images"
    folder.mkdir()
    rng = np.random.default_rng(0)
    blobs = []
    for i in range(3):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (12, 10), dtype=np.uint8)).save(buf, "PNG")
        blobs.append(buf.getvalue())
        (folder / f"{i}.png").write_bytes(buf.getvalue())
    want = pd.read_csv(
        classify(store.path(store.served().id), "a", folder, tmp_path / "p.csv").path
    )
    with ModelServer(store, "127.0.0.1", 0) as server:
        thread = _serve_in_thread(server)
        status, one = _request(server, "POST", "/v1/predict", blobs[0], "image/png")
        assert status == 200
        # one image: as p2pfl predict answers for that one file (a batch of one)
        alone = classify(store.path(store.served().id), "a", folder / "0.png", tmp_path / "1.csv")
        _same_as_predict(one, pd.read_csv(alone.path))
        body = json.dumps({"images": [base64.b64encode(b).decode() for b in blobs]})
        status, many = _request(server, "POST", "/v1/predict", body)
        assert status == 200
        _same_as_predict(many, want)
        status, bad = _request(server, "POST", "/v1/predict", b"not an image", "image/png")
        assert status == 400 and "not a readable image" in bad["error"]
        status, bad = _request(server, "POST", "/v1/predict", json.dumps([{"age": 1}]))
        assert status == 400 and "not trained on tabular data" in bad["error"]
        server.shutdown()
        thread.join(10)


def _serve_in_thread(server):
    import threading

    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return thread
