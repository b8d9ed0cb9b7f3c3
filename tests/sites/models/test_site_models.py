"""A site keeps and serves its own model: real ``p2pfl daemon`` processes and a real broker
on loopback train a run on each site's own CSV; when it finishes, each daemon keeps its
node's model and judges it at the promotion gate, and the site with ``serving.listen``
answers ``POST /v1/predict`` with it, as ``p2pfl predict`` answers on the run's model
(docs/design.md, "A site's own models")."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from daemon_helpers import FEATURES, Site, csv_binding, http_json, p2pfl_cli, patients, spec, wait

from p2pfl.launch.broker import free_port
from p2pfl.learning.own_tables import split_by_row_hash

pytestmark = pytest.mark.one_broker  # the daemons' MQTT use is the nodes'; Mosquitto only


def test_a_finished_run_is_kept_judged_and_served(tmp_path, broker):
    port = free_port()
    made: list[Site] = []
    try:
        for i, name in enumerate(("a", "b")):
            data = tmp_path / f"{name}.csv"
            patients(160, seed=i).to_csv(data, index=False)
            extra = {"serving": {"listen": f"127.0.0.1:{port}"}} if name == "a" else {}
            extra["promote"] = {"offer": True}
            made.append(
                Site(tmp_path, name, broker.address, data={"own": csv_binding(data)}, **extra)
            )
            made[-1].start()
        a, b = made
        base = f"http://127.0.0.1:{port}"
        wait(lambda: http_json("GET", f"{base}/v1/model")[0] == 503, 60, "a's serving to answer")

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
            lambda: (
                http_json("GET", f"{base}/v1/model")[1].get("model", {}).get("run_id") == run_id
            ),
            30,
            "a's serving to serve the run's model",
        )
        status, model = http_json("GET", f"{base}/v1/model")
        assert status == 200 and model["model"]["round"] == 3
        assert model["input"]["features"] == FEATURES and model["classes"] == ["good", "bad"]
        rows = patients(25, seed=9)
        rows_csv = tmp_path / "rows.csv"
        rows.to_csv(rows_csv, index=False)
        out = tmp_path / "predicted.csv"
        run_dir = a.state_dir / "runs" / run_id
        pred = p2pfl_cli("predict", str(run_dir), "--node", "a", str(rows_csv), "--out", str(out))
        assert pred.returncode == 0, pred.stdout + pred.stderr
        want = pd.read_csv(out)
        records = rows.drop(columns=["outcome"]).to_dict(orient="records")
        status, answer = http_json("POST", f"{base}/v1/predict", json.dumps(records).encode())
        assert status == 200
        assert [p["label"] for p in answer["predictions"]] == want["label"].tolist()
        got = np.array([p["probabilities"] for p in answer["predictions"]], dtype=np.float32)
        # served through onnxruntime (serving.runtime: onnx): predict's to 1e-6
        want_p = want[["p_good", "p_bad"]].to_numpy(dtype=np.float32)
        np.testing.assert_allclose(got, want_p, rtol=0, atol=1e-6)
        assert model["runtime"] == "onnxruntime"
        assert (a.state_dir / "serving.log").is_file()
    finally:
        for site in made:
            site.stop()


def _entries(site: Site) -> dict:
    out = p2pfl_cli("models", "list", "--json", "--site", str(site.path))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _judged(site: Site, run_id: str) -> dict | None:
    for entry in _entries(site)["models"]:
        if entry["run_id"] == run_id and entry["status"] != "candidate":
            return entry
    return None


def _cycle_run(site: Site, cycle: int) -> dict | None:
    """The run of the series' ``cycle`` this site knows (by its run.json once started)."""
    for run_id in site.runs():
        facts = site.state_dir / "runs" / run_id / "run.json"
        if facts.is_file() and json.loads(facts.read_text()).get("cycle") == cycle:
            return json.loads(facts.read_text())
    return None


def test_a_series_retrains_on_new_rows_warm_started_and_the_gate_keeps_a_worse_model_out(
    tmp_path, broker
):
    """Three sites with watched CSVs. Rows appended at two of them start cycle 2,
    warm-started from each site's promoted model of cycle 1. Then site c appends copies of
    its training rows with their labels inverted (they hash to the training side, so its
    held-out rows stay clean) and a appends clean rows: cycle 3 trains, and c's gate refuses
    its model; c's /v1/predict keeps answering from cycle 2's; rollback serves cycle 1's."""
    port = free_port()
    made: list[Site] = []
    files = {}
    try:
        for i, name in enumerate(("a", "b", "c")):
            files[name] = tmp_path / f"{name}.csv"
            patients(160, seed=i).to_csv(files[name], index=False)
            extra = {"serving": {"listen": f"127.0.0.1:{port}"}} if name == "c" else {}
            extra["promote"] = {"offer": True}
            binding = csv_binding(files[name], watch=True)
            made.append(Site(tmp_path, name, broker.address, data={"own": binding}, **extra))
            made[-1].start()
        a, b, c = made
        series = {"on_new_data": {"min_new": 30}, "rounds": 2, "warm_start": "last_promoted"}
        run_spec = spec(
            "ward",
            data="own",
            model={"name": "mlp"},
            algorithm={"name": "fedavg", "params": {}},
            rounds=3,
            series=series,
        )
        first = a.ask("submit", spec=run_spec)["run_id"]
        for site in made:
            site.wait_status(first, {"finished"}, 240)
            wait(lambda s=site: _judged(s, first), 120, f"{site.name} to judge cycle 1")
            assert _judged(site, first)["status"] == "promoted"

        # cycle 2: new rows at two of the three sites
        for name, seed in (("a", 10), ("b", 11)):
            patients(40, seed=seed).to_csv(files[name], mode="a", header=False, index=False)
        wait(lambda: all(_cycle_run(s, 2) for s in made), 120, "cycle 2 to start everywhere")
        for site in made:
            facts = _cycle_run(site, 2)
            assert facts["series"] == first and facts["cycle"] == 2
            assert facts["warm_start"] == _judged(site, first)["id"]  # its own cycle-1 model
            site.wait_status(facts["run_id"], {"finished"}, 240)
        second = _cycle_run(a, 2)["run_id"]
        assert _cycle_run(a, 2)["rows"] == 200 and _cycle_run(c, 2)["rows"] == 160
        assert (b.run(second)["cycle"], b.run(second)["rounds"]) == (2, 2)  # p2pfl runs says
        records = b.records(second)
        assert [r["round"] for r in records] == [1, 2]  # series.rounds after the first cycle
        wait(lambda: _judged(c, second), 120, "c to judge cycle 2")
        assert _judged(c, second)["parent"] == _judged(c, first)["id"]  # its lineage
        if _judged(c, second)["status"] != "promoted":  # the gate may keep cycle 1's
            p2pfl_cli("models", "promote", _judged(c, second)["id"], "--site", str(c.path))
        base = f"http://127.0.0.1:{port}"
        wait(
            lambda: (
                http_json("GET", f"{base}/v1/model")[1].get("model", {}).get("run_id") == second
            ),
            30,
            "c to serve cycle 2",
        )

        # cycle 3: c's new rows repeat its training rows with the labels inverted
        own = pd.read_csv(files["c"])
        train, _ = split_by_row_hash(own[FEATURES].to_numpy(np.float64), 0.25)
        flipped = own.iloc[train].copy()  # its training rows: the copies hash there too
        flipped["outcome"] = flipped["outcome"].map({"good": "bad", "bad": "good"})
        pd.concat([flipped] * 4).to_csv(files["c"], mode="a", header=False, index=False)
        patients(40, seed=12).to_csv(files["a"], mode="a", header=False, index=False)
        wait(lambda: _cycle_run(c, 3), 120, "cycle 3 to start at c")
        third = _cycle_run(c, 3)["run_id"]
        c.wait_status(third, {"finished"}, 240)
        wait(lambda: _judged(c, third), 120, "c to judge cycle 3")
        refused = _judged(c, third)
        assert refused["status"] == "refused", refused
        assert "below the served model's" in refused["reason"]
        status, model = http_json("GET", f"{base}/v1/model")
        assert status == 200 and model["model"]["run_id"] == second  # still cycle 2's
        assert [e["run_id"] for e in model["lineage"]] == [first]  # warm-started from cycle 1
        rows = patients(5, seed=99).drop(columns=["outcome"]).to_dict(orient="records")
        status, answer = http_json("POST", f"{base}/v1/predict", json.dumps(rows).encode())
        assert status == 200 and answer["run_id"] == second

        back = p2pfl_cli("models", "rollback", "--site", str(c.path))
        assert back.returncode == 0, back.stdout + back.stderr
        wait(
            lambda: http_json("GET", f"{base}/v1/model")[1]["model"]["run_id"] == first,
            30,
            "c to serve cycle 1 again",
        )
        status, answer = http_json("POST", f"{base}/v1/predict", json.dumps(rows).encode())
        assert status == 200 and answer["run_id"] == first
    finally:
        for site in made:
            site.stop()
