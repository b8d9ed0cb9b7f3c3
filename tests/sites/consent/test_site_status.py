"""A site's status of a run (:mod:`p2pfl.sites.consent.site_status`): what a record gives
of its evaluation, and a peer's body checked whole."""

from __future__ import annotations

import math

import pytest

from p2pfl.sites.consent.site_status import (
    MAX_METRICS,
    MAX_WHY,
    read_status,
    round_metrics,
    status_body,
)


def test_a_records_evaluation_is_its_finite_test_fields():
    record = {
        "round": 3,
        "test_acc": 0.9,
        "test_loss": 0.31,
        "test_c_index": 1,
        "test_auc": math.nan,
        "test_flag": True,
        "train_loss": 0.2,
        "test_Bad": 1.0,
    }
    assert round_metrics(record) == {"test_acc": 0.9, "test_c_index": 1.0, "test_loss": 0.31}
    many = {f"test_m{i:02d}": float(i) for i in range(MAX_METRICS + 5)}
    assert len(round_metrics(many)) == MAX_METRICS


def test_a_body_made_here_reads_back_and_a_long_why_is_cut():
    body = status_body("cancelled", "x" * (MAX_WHY + 50), 3, {"test_acc": 0.5})
    assert len(body["why"]) == MAX_WHY
    assert read_status(body) == body


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"status": "won", "why": "", "round": 1, "metrics": {}}, "status"),
        ({"status": "running", "why": 3, "round": 1, "metrics": {}}, "why"),
        ({"status": "running", "why": "", "round": True, "metrics": {}}, "round"),
        ({"status": "running", "why": "", "round": -1, "metrics": {}}, "round"),
        ({"status": "running", "why": "", "round": 1, "metrics": {"acc": 1.0}}, "metrics"),
        ({"status": "running", "why": "", "round": 1, "metrics": {"test_acc": "hi"}}, "test_acc"),
        ({"status": "running", "why": "", "round": 1, "metrics": {"test_a": math.inf}}, "test_a"),
        ({"status": "running", "why": "", "round": 1, "metrics": [], "x": 1}, "nothing else"),
        ("finished", "nothing else"),
    ],
)
def test_a_peers_malformed_body_is_refused_naming_the_field(body, field):
    with pytest.raises(ValueError, match=field):
        read_status(body)
