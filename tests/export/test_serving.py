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


def _same_as_predict(answer, want: pd.DataFrame, exact: bool = False) -> None:
    """The server's answer is ``p2pfl predict``'s CSV, class for class and probability for
    probability: the same float32 from torch, within 1e-6 from onnxruntime."""
    preds = answer["predictions"]
    assert [p["predicted"] for p in preds] == want["predicted"].tolist()
    assert [p["label"] for p in preds] == want["label"].tolist()
    got = np.array([p["probabilities"] for p in preds], dtype=np.float32)
    expected = want[[f"p_{c}" for c in answer["classes"]]].to_numpy(dtype=np.float32)
    if exact:
        assert np.array_equal(got, expected)
    else:
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("runtime", ["onnx", "torch"])
def test_predict_answers_what_p2pfl_predict_answers(tabular_store, tmp_path, runtime):
    store, first, _ = tabular_store
    entry = store.add(first.dir, "run1", round_no=4)
    store.promote(entry.id, "the first model")
    df = _table()
    rows_csv = tmp_path / "rows.csv"
    df.to_csv(rows_csv, index=False)
    want = pd.read_csv(classify(store.path(entry.id), "a", rows_csv, tmp_path / "p.csv").path)

    exact = runtime == "torch"
    with ModelServer(store, "127.0.0.1", 0, runtime=runtime) as server:
        server_thread = _serve_in_thread(server)
        records = df.to_dict(orient="records")
        status, answer = _request(server, "POST", "/v1/predict", json.dumps(records))
        assert status == 200 and answer["model"] == entry.id and answer["classes"] == CLASSES
        _same_as_predict(answer, want, exact)
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
            _same_as_predict(again, want, exact)

        status, model = _request(server, "GET", "/v1/model")
        assert status == 200
        assert model["model"]["id"] == entry.id and model["model"]["run_id"] == "run1"
        assert model["model"]["round"] == 4
        assert model["lineage"] == [] and model["served_before"] == []
        assert model["input"]["features"] == FEATURES and model["classes"] == CLASSES
        assert model["runtime"] == {"onnx": "onnxruntime", "torch": "torch"}[runtime]
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
        status, answer = _raw_post(server, None)  # no length: neither Content-Length nor chunked
        assert status == 411 and "Content-Length required" in answer["error"]
        status, answer = _raw_post(server, [b"[" + b" " * 3000, b" " * 3000 + b"]"])  # chunked
        assert status == 413 and "the body: more than serving.max_request_bytes" in answer["error"]
        assert _request(server, "GET", "/v1/nothing")[0] == 404
        assert _request(server, "POST", "/v1/model", "{}")[0] == 405
        status, answer = _request(server, "GET", "/v1/predict")
        assert status == 405 and "takes POST" in answer["error"]
        # a missing value is refused, naming its column and row; an unread column is named
        status, answer = post(
            json.dumps([{"age": 50, "bmi": 25, "bp": 9}, {"age": 1, "bmi": None, "bp": 2}])
        )
        assert status == 400 and "column 'bmi' has no value at row 1" in answer["error"]
        status, answer = post(b"age,bmi,bp\n50,,90\n", "text/csv")
        assert status == 400 and "column 'bmi' has no value at row 0" in answer["error"]
        status, answer = post(json.dumps([{"age": 50, "bmi": 25, "bp": 9, "bpm": 60}]))
        assert status == 200 and answer["ignored_columns"] == ["bpm"]
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


def _raw_post(server, chunks):
    """A POST to /v1/predict without a body's length (``chunks`` None) or chunked."""
    host, port = server.address
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        if chunks is None:
            conn.putrequest("POST", "/v1/predict")
            conn.putheader("Content-Type", "application/json")
            conn.endheaders()
        else:
            conn.request(
                "POST",
                "/v1/predict",
                body=iter(chunks),
                headers={"Content-Type": "application/json"},
                encode_chunked=True,
            )
        answer = conn.getresponse()
        return answer.status, json.loads(answer.read())
    finally:
        conn.close()


def _serve_in_thread(server):
    import threading

    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return thread


def test_a_site_may_impute_missing_values_instead(tabular_store):
    """``serving.missing: impute``: a missing value is the column's training mean, as
    ``p2pfl predict`` reads an empty cell."""
    store, first, _ = tabular_store
    store.promote(store.add(first.dir, "run1").id)
    with ModelServer(store, "127.0.0.1", 0, missing="impute") as server:
        thread = _serve_in_thread(server)
        status, answer = _request(
            server, "POST", "/v1/predict", json.dumps([{"age": 50, "bmi": None, "bp": 90}])
        )
        assert status == 200 and len(answer["predictions"]) == 1
        server.shutdown()
        thread.join(10)


def test_the_open_inference_protocol_answers_a_real_client(tabular_store, tmp_path):
    """KServe's v2 protocol, through Triton's own client (``tritonclient[http]``): health,
    readiness, metadata, and inference with one input tensor (sent in the binary extension)
    or a tensor a column (JSON); the probabilities are ``p2pfl predict``'s to 1e-6."""
    import tritonclient.http as triton
    from tritonclient.utils import InferenceServerException

    store, first, _ = tabular_store
    entry = store.add(first.dir, "run1", round_no=4)
    store.promote(entry.id)
    df = _table(12)
    rows = tmp_path / "rows.csv"
    df.to_csv(rows, index=False)
    want = pd.read_csv(classify(store.path(entry.id), "a", rows, tmp_path / "p.csv").path)
    expected = want[[f"p_{c}" for c in CLASSES]].to_numpy(dtype=np.float32)
    with ModelServer(store, "127.0.0.1", 0) as server:
        thread = _serve_in_thread(server)
        host, port = server.address
        client = triton.InferenceServerClient(url=f"{host}:{port}")
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("a")
        meta = client.get_model_metadata("a")
        assert meta["versions"] == [entry.id] and meta["parameters"]["features"] == FEATURES
        assert [o["name"] for o in meta["outputs"]] == ["predicted", "label", "probabilities"]

        tensor = triton.InferInput("input", [len(df), len(FEATURES)], "FP32")
        tensor.set_data_from_numpy(df[FEATURES].to_numpy(dtype=np.float32))  # binary
        result = client.infer("a", [tensor])
        assert np.allclose(result.as_numpy("probabilities"), expected, atol=1e-6)
        assert result.as_numpy("predicted").tolist() == want["predicted"].tolist()
        labels = [v.decode() if isinstance(v, bytes) else v for v in result.as_numpy("label")]
        assert labels == want["label"].tolist()
        answer = result.get_response()
        assert answer["model_version"] == entry.id
        assert answer["parameters"]["run_id"] == "run1" and answer["parameters"]["round"] == 4

        columns = []
        for f in FEATURES:  # a tensor a column, as JSON, float64
            col = triton.InferInput(f, [len(df)], "FP64")
            col.set_data_from_numpy(df[f].to_numpy(dtype=np.float64), binary_data=False)
            columns.append(col)
        wanted = [triton.InferRequestedOutput("probabilities", binary_data=False)]
        result = client.infer("a", columns, outputs=wanted)
        assert np.allclose(result.as_numpy("probabilities"), expected, atol=1e-6)
        assert [o["name"] for o in result.get_response()["outputs"]] == ["probabilities"]

        with pytest.raises(InferenceServerException, match="unknown input\\(s\\) 'bpm'"):
            client.infer("a", [*columns[:2], triton.InferInput("bpm", [len(df)], "FP64")])
        holes = df[FEATURES].to_numpy(dtype=np.float32).copy()
        holes[5, 1] = np.nan
        tensor.set_data_from_numpy(holes)
        with pytest.raises(InferenceServerException, match="column 'bmi' has no value at row 5"):
            client.infer("a", [tensor])
        assert not client.is_model_ready("b")
        status, answer = _request(server, "GET", "/v2/models/a/infer")
        assert status == 405 and "takes POST" in answer["error"]
        status, answer = _request(server, "POST", "/v2/models/b/infer", "{}")
        assert status == 404 and "serves 'a'" in answer["error"]
        client.close()
        server.shutdown()
        thread.join(10)
