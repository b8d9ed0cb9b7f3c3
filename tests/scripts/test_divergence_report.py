"""UA-PDFL's decision report on a hand-written run directory."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest


def _write(run: Path, node: str, records: list[dict]) -> None:
    path = run / "nodes" / f"{node}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_rates_and_quantiles_per_round_bucket(tmp_path, capsys, monkeypatch, load_script):
    monkeypatch.setenv("COLUMNS", "200")
    rep = load_script("divergence_report")
    run = tmp_path / "run"
    r1 = {"round": 1, "divergence": {"b": 0.0}, "relative": {"b": 0.0}, "dropout": True}

    def record(facts: dict) -> dict:  # this version's layout: the method's facts apart
        return {"round": facts.pop("round"), "dropout": facts["dropout"], "method": facts}

    _write(
        run,
        "a",
        [
            record({**r1, "h_peers": []}),
            record(
                {
                    "round": 2,
                    "divergence": {"b": 0.2, "c": 0.4},
                    "relative": {"b": 0.5, "c": None},
                    "dropout": False,
                    "h_peers": ["b"],
                }
            ),
        ],
    )
    _write(  # an older run's layout: the method's facts at the top level
        run,
        "b",
        [
            {**r1, "h_peers": []},
            {
                "round": 2,
                "divergence": {"a": 0.2},
                "relative": {"a": 0.5},
                "dropout": True,
                "h_peers": [],
            },
        ],
    )
    report = rep.run_report(run, buckets=2)
    first, second = report["buckets"]
    assert first["rounds"] == [1, 1] and first["dropout_rate"] == 1.0
    assert second["node_rounds"] == 2 and second["dropout_rate"] == 0.5
    assert second["h_peers_mean"] == 0.5 and second["h_share_of_drawn"] == pytest.approx(1 / 3)
    assert second["div_q10_50_90"][1] == pytest.approx(0.2)
    assert math.isinf(second["rel_q10_50_90"][2])  # a null D (no drift yet) counts as far
    assert report["rounds_2_on"] == {k: second[k] for k in report["rounds_2_on"]}
    out = tmp_path / "report.json"
    assert rep.main([str(run), "--buckets", "2", "--json", str(out)]) == 0
    written = json.loads(out.read_text())[0]
    assert written["rounds"] == 2 and written["buckets"][1]["rel_q10_50_90"][2] is None
    assert "50%" in capsys.readouterr().out


def test_a_directory_without_records_is_a_clear_error(tmp_path, load_script):
    with pytest.raises(SystemExit, match="no node records"):
        load_script("divergence_report").run_report(tmp_path, buckets=2)
