"""The promotion gate by the site's ``promote.metric``: a score must not fall, an error must
not rise, by more than ``min_delta``; a kept run is scored through its own task."""

from __future__ import annotations

import pytest

from p2pfl.sites.daemon.site_file import Promote
from p2pfl.sites.models.store import gate


def test_a_score_may_fall_by_min_delta_and_no_more():
    assert gate(0.80, None, 0.0) is None  # nothing served: any model
    assert gate(0.79, 0.80, 0.01) is None
    why = gate(0.78, 0.80, 0.01, "auc")
    assert why == "held-out auc 0.7800 is below the served model's 0.8000 minus min_delta 0.01"


def test_an_error_may_rise_by_min_delta_and_no_more():
    assert gate(41.0, 40.0, 1.0, "mae") is None
    assert gate(39.0, 40.0, 0.0, "rmse") is None
    why = gate(42.0, 40.0, 1.0, "mae")
    assert why == "held-out mae 42.0000 is above the served model's 40.0000 plus min_delta 1"


def test_the_metric_is_one_the_tasks_report():
    assert Promote().metric == "accuracy"
    assert Promote(metric="c_index", min_delta=0.02).metric == "c_index"
    with pytest.raises(ValueError):
        Promote(metric="loss")
