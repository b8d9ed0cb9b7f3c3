"""A site's model store (``p2pfl.sites.models.store``): entries copied from runs, the promotion
gate on the site's held-out data, atomic promotion with ``current.onnx``, promotion by hand
and rollback; on models built and trained like a swarm's, scored by ``p2pfl predict``'s
own ``classify``."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pandas as pd
import pytest
from export_helpers import CLASSES, FEATURES, SPEC, make_run, two_tabular_runs

from p2pfl.export import ExportError, classify
from p2pfl.export.predict import table_inputs
from p2pfl.sites.models.store import (
    CURRENT,
    CURRENT_ONNX,
    PROMOTED,
    REFUSED,
    RETIRED,
    ModelStore,
    ModelStoreError,
    gate,
)


@pytest.mark.parametrize(
    ("candidate", "served", "min_delta", "ok"),
    [
        (0.80, None, 0.0, True),  # nothing served: any model
        (0.80, 0.80, 0.0, True),  # as good
        (0.79, 0.80, 0.0, False),
        (0.79, 0.80, 0.02, True),  # within the allowance
        (0.70, 0.80, 0.05, False),
        (0.90, 0.80, 0.0, True),
    ],
)
def test_gate(candidate, served, min_delta, ok):
    why = gate(candidate, served, min_delta)
    assert (why is None) == ok
    if not ok:
        assert f"{candidate:.4f}" in why and f"{served:.4f}" in why


def _runs(tmp_path):
    """Two runs whose site-``a`` models differ, and a held-out CSV labelled by the first:
    the first scores 1.0 on it, the second less."""
    first, second = two_tabular_runs(tmp_path, SPEC, CLASSES)
    rng = np.random.default_rng(7)
    df = pd.DataFrame(
        {
            f: rng.normal(m, s, 300)
            for f, m, s in zip(FEATURES, [50, 25, 90], [10, 4, 12], strict=True)
        }
    )
    df["risk"] = "low"
    held = tmp_path / "held_out.csv"
    df.to_csv(held, index=False)
    labels = pd.read_csv(classify(first.dir, "a", held, tmp_path / "p1.csv").path)["label"]
    df["risk"] = labels
    df.to_csv(held, index=False)
    return first, second, held


def _score(held, tmp_path):
    return lambda run_dir: classify(run_dir, "a", held, tmp_path / "scored.csv").accuracy


def test_the_first_model_is_promoted_and_a_worse_one_refused(tmp_path):
    first, second, held = _runs(tmp_path)
    score = _score(held, tmp_path)
    assert score(second.dir) < 0.95  # the premise: the second model is worse here
    store = ModelStore(tmp_path / "state", "a")
    one = store.add(first.dir, "run1", round_no=3, data_version="v1")
    assert one.status == "candidate" and store.served() is None
    one = store.judge(one.id, score, min_delta=0.02)
    assert one.status == PROMOTED and one.accuracy == 1.0 and one.served_accuracy is None
    assert store.served().id == one.id
    assert json.loads((store.root / CURRENT).read_text()) == {"current": one.id, "before": []}

    two = store.judge(store.add(second.dir, "run2", round_no=3).id, score, min_delta=0.02)
    assert two.status == REFUSED and "below the served model's 1.0000" in two.reason
    assert two.served_accuracy == 1.0 and two.accuracy < 0.95
    assert store.served().id == one.id  # the served model did not change
    assert [e.id for e in store.entries()] == [one.id, two.id]

    # current.onnx is the served model: it answers as classify on the served entry does
    session = ort.InferenceSession(str(store.root / CURRENT_ONNX))
    info = json.loads((store.path(one.id) / "nodes" / "a.model.json").read_text())
    _names, batches, _labels = table_inputs(pd.read_csv(held), SPEC, info, str(held))
    logits = np.concatenate([session.run(None, {"input": x})[0] for x in batches])
    want = pd.read_csv(classify(store.path(one.id), "a", held, tmp_path / "w.csv").path)
    assert logits.argmax(1).tolist() == want["predicted"].tolist()


def test_promote_by_hand_and_rollback(tmp_path):
    first, second, held = _runs(tmp_path)
    score = _score(held, tmp_path)
    store = ModelStore(tmp_path / "state", "a")
    one = store.judge(store.add(first.dir, "run1").id, score, 0.0)
    two = store.judge(store.add(second.dir, "run2").id, score, 0.0)
    assert two.status == REFUSED
    onnx_before = (store.root / CURRENT_ONNX).read_bytes()

    two = store.promote(two.id)
    assert two.status == PROMOTED and two.reason == "promoted by hand"
    assert store.entry(one.id).status == RETIRED
    assert store.served().id == two.id
    assert (store.root / CURRENT_ONNX).read_bytes() != onnx_before
    with pytest.raises(ModelStoreError, match="served already"):
        store.promote(two.id)

    back = store.rollback()
    assert back.id == one.id and store.served().id == one.id
    assert store.entry(two.id).status == RETIRED
    assert "rolled back to" in store.entry(two.id).reason
    assert (store.root / CURRENT_ONNX).read_bytes() == onnx_before
    with pytest.raises(ModelStoreError, match="no model served before"):
        store.rollback()
    assert [h["status"] for h in store.entry(two.id).history] == [
        "candidate",
        REFUSED,
        PROMOTED,
        RETIRED,
    ]


def test_errors_name_the_store_and_the_model(tmp_path):
    first, _second, _held = _runs(tmp_path)
    store = ModelStore(tmp_path / "state", "a")
    with pytest.raises(ModelStoreError, match="no model 'nope' \\(models: none\\)"):
        store.entry("nope")
    with pytest.raises(ModelStoreError, match="no model '../x'"):
        store.entry("../x")
    with pytest.raises(ModelStoreError, match="no model served before"):
        store.rollback()
    with pytest.raises(ExportError, match="left no model of c"):
        ModelStore(tmp_path / "state", "c").add(first.dir, "run1")
    one = store.add(first.dir, "run1")
    again = store.add(first.dir, "run1")  # the same run twice: two entries
    assert (one.id, again.id) == ("run1", "run1.2")


def test_cli_models_list_promote_rollback(tmp_path, capsys):
    from p2pfl.cli import main

    first, second, held = _runs(tmp_path)
    site = tmp_path / "site.yaml"
    site.write_text("site: a\nswarm: hospitals\nstate_dir: state\n")
    assert main(["models", "list", "--site", str(site)]) == 0
    assert "a: no models yet" in capsys.readouterr().out
    store = ModelStore(tmp_path / "state", "a")  # state_dir is relative to the site file
    score = _score(held, tmp_path)
    one = store.judge(store.add(first.dir, "run1", round_no=3).id, score, 0.0)
    two = store.judge(store.add(second.dir, "run2", round_no=3).id, score, 0.0)

    assert main(["models", "list", "--site", str(site)]) == 0
    text = capsys.readouterr().out
    assert f"* {one.id}  run run1 round 3  accuracy 1.0000  promoted" in text
    assert f"  {two.id}  run run2 round 3  accuracy {two.accuracy:.4f}  refused" in text
    assert main(["models", "list", "--site", str(site), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["served"] == one.id and [m["id"] for m in listed["models"]] == [one.id, two.id]

    assert main(["models", "promote", two.id, "--site", str(site)]) == 0
    assert f"a: serving {two.id} (run run2): promoted by hand" in capsys.readouterr().out
    assert main(["models", "rollback", "--site", str(site)]) == 0
    assert f"a: serving {one.id} (run run1) again" in capsys.readouterr().out
    assert store.served().id == one.id

    # a mistake: one line naming the store and the models it has, exit 2, no traceback
    assert main(["models", "promote", "nope", "--site", str(site)]) == 2
    err = capsys.readouterr()
    assert "no model 'nope' (models: run1, run2)" in err.out + err.err
    assert "Traceback" not in err.out + err.err


def test_cli_models_offer_judges_a_finished_run_on_the_held_out_split(tmp_path, capsys):
    from p2pfl.cli import main
    from p2pfl.export.held_out import held_out_scorer

    runs = tmp_path / "state" / "runs"
    runs.mkdir(parents=True)
    for run_id, nodes in (("r1", ("a", "b")), ("r2", ("b", "a"))):  # a's models differ
        made = make_run(tmp_path / run_id, nodes=nodes)
        made.dir.rename(runs / run_id)
        (runs / run_id / "nodes" / "a.jsonl").write_text('{"round": 1}\n{"round": 2}\n')
    site = tmp_path / "site.yaml"
    site.write_text("site: a\nswarm: s\nstate_dir: state\npromote: {min_delta: 1.0}\n")
    assert main(["models", "offer", "r1", "--site", str(site)]) == 0
    first = held_out_scorer(runs / "r1", "a")(runs / "r1")
    assert f"a: r1: held-out accuracy {first:.4f}: promoted" in capsys.readouterr().out
    assert main(["models", "offer", "r2", "--site", str(site)]) == 0
    assert "a: r2: held-out accuracy" in capsys.readouterr().out  # min_delta 1: any model
    store = ModelStore(tmp_path / "state", "a")
    assert store.served().id == "r2" and store.entry("r2").round == 2
    assert store.entry("r2").served_accuracy == pytest.approx(first)
    assert main(["models", "offer", "nope", "--site", str(site)]) == 2
    err = capsys.readouterr()
    assert "runs/nope/config.yaml: no such file: run nope left no model of a" in err.err
