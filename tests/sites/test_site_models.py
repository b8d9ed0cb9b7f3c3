"""A site keeps and serves its own model: real ``p2pfl daemon`` processes and a real broker
on loopback train a run on each site's own CSV; when it finishes, each daemon keeps its
node's model and judges it at the promotion gate, and the site with ``serving.listen``
answers ``POST /v1/predict`` with it, as ``p2pfl predict`` answers on the run's model
(docs/design.md, "A site's own models")."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pandas as pd
import pytest
from daemon_helpers import Site, p2pfl_cli, spec, wait

from p2pfl.launch.broker import free_port

pytestmark = pytest.mark.one_broker  # the daemons' MQTT use is the nodes'; Mosquitto only

FEATURES = ["f1", "f2", "f3", "f4"]


def _patients(n: int, seed: int) -> pd.DataFrame:
    """Rows whose class follows their first two features (a model learns it in a round)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (n, len(FEATURES)))
    df = pd.DataFrame(x * [3, 2, 1, 1] + [40, 20, 5, 0], columns=FEATURES)
    df["outcome"] = np.where(x[:, 0] + x[:, 1] > 0, "bad", "good")
    return df


def _binding(path) -> dict:
    return {
        "name": "csv",
        "root": str(path),
        "partition": "none",
        "label": "outcome",
        "classes": ["good", "bad"],
        "test_fraction": 0.25,
    }


def _http(method: str, url: str, body: bytes | None = None, kind: str = "application/json"):
    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": kind})
    try:
        with urllib.request.urlopen(req, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")
    except OSError:
        return None, {}


def test_a_finished_run_is_kept_judged_and_served(tmp_path, broker):
    port = free_port()
    made: list[Site] = []
    try:
        for i, name in enumerate(("a", "b")):
            data = tmp_path / f"{name}.csv"
            _patients(160, seed=i).to_csv(data, index=False)
            extra = {"serving": {"listen": f"127.0.0.1:{port}"}} if name == "a" else {}
            made.append(Site(tmp_path, name, broker.address, data={"own": _binding(data)}, **extra))
            made[-1].start()
        a, b = made
        base = f"http://127.0.0.1:{port}"
        wait(lambda: _http("GET", f"{base}/v1/model")[0] == 503, 60, "a's serving to answer")

        run_spec = spec(
            "kept",
            data="own",
            model={"name": "mlp"},
            algorithm={"name": "fedavg", "params": {}},
            rounds=3,
        )
        run_id = a.ask("submit", spec=run_spec)["run_id"]
        for site in made:
            site.wait_status(run_id, {"finished"}, 240)

        # each site kept its model; the first one passes the gate (nothing served before)
        def kept(site: Site) -> dict | None:
            out = p2pfl_cli("models", "list", "--json", "--site", str(site.path))
            assert out.returncode == 0, out.stderr
            listed = json.loads(out.stdout)
            return listed if listed["served"] else None

        for site in made:
            wait(
                lambda s=site: kept(s) is not None,
                120,
                f"{site.name} to serve a model",
                lambda s=site: s.log()[-3000:],
            )
            listed = kept(site)
            (entry,) = listed["models"]
            assert entry["run_id"] == run_id and entry["status"] == "promoted"
            assert entry["round"] == 3 and 0.0 <= entry["accuracy"] <= 1.0
            assert (site.state_dir / "models" / "current.onnx").is_file()

        # a's serving picks the promoted model up and answers as p2pfl predict does
        wait(
            lambda: _http("GET", f"{base}/v1/model")[1].get("model", {}).get("run_id") == run_id,
            30,
            "a's serving to serve the run's model",
        )
        status, model = _http("GET", f"{base}/v1/model")
        assert status == 200 and model["model"]["round"] == 3
        assert model["input"]["features"] == FEATURES and model["classes"] == ["good", "bad"]
        rows = _patients(25, seed=9)
        rows_csv = tmp_path / "rows.csv"
        rows.to_csv(rows_csv, index=False)
        out = tmp_path / "predicted.csv"
        run_dir = a.state_dir / "runs" / run_id
        pred = p2pfl_cli("predict", str(run_dir), "--node", "a", str(rows_csv), "--out", str(out))
        assert pred.returncode == 0, pred.stdout + pred.stderr
        want = pd.read_csv(out)
        records = rows.drop(columns=["outcome"]).to_dict(orient="records")
        status, answer = _http("POST", f"{base}/v1/predict", json.dumps(records).encode())
        assert status == 200
        assert [p["label"] for p in answer["predictions"]] == want["label"].tolist()
        got = np.array([p["probabilities"] for p in answer["predictions"]], dtype=np.float32)
        assert np.array_equal(got, want[["p_good", "p_bad"]].to_numpy(dtype=np.float32))
        assert (a.state_dir / "serving.log").is_file()
    finally:
        for site in made:
            site.stop()
