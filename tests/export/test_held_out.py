"""Scoring kept models on a site's held-out data (``p2pfl.export.held_out``): inputs
normalised again for each model's own statistics, and the accuracy on a run's test split."""

from __future__ import annotations

import pytest
import torch
from export_helpers import make_run

from p2pfl.check.load import load_topology
from p2pfl.export import ExportError, load_model
from p2pfl.export.held_out import held_out_scorer, renormalize
from p2pfl.learning.data import load_node_data

TAB = {"kind": "tabular", "features": ["a", "b"], "mean": [1.0, 10.0], "std": [2.0, 5.0]}


def test_tabular_inputs_are_normalised_again_for_the_model():
    raw = torch.tensor([[3.0, 20.0], [1.0, 0.0]])
    x = (raw - torch.tensor([1.0, 10.0])) / torch.tensor([2.0, 5.0])
    model = {**TAB, "mean": [0.0, 20.0], "std": [1.0, 0.0]}  # std 0: taken as 1
    want = (raw - torch.tensor([0.0, 20.0])) / torch.tensor([1.0, 1.0])
    assert torch.allclose(renormalize(x, TAB, model), want)
    assert renormalize(x, TAB, TAB) is x  # the same statistics: untouched
    assert renormalize(x, TAB, {}) is x  # a model without input_spec takes them as given


def test_image_inputs_per_channel():
    spec = {
        "kind": "image",
        "channels": 3,
        "size": [2, 2],
        "mean": [0.5, 0.4, 0.3],
        "std": [0.2] * 3,
    }
    model = {**spec, "mean": [0.0] * 3, "std": [1.0] * 3}
    raw = torch.rand(4, 3, 2, 2)
    x = (raw - torch.tensor([0.5, 0.4, 0.3]).view(1, 3, 1, 1)) / 0.2
    assert torch.allclose(renormalize(x, spec, model), raw, atol=1e-6)


@pytest.mark.parametrize(
    ("model", "match"),
    [
        ({**TAB, "features": ["b", "a"]}, "reads features"),
        ({"kind": "image", "channels": 1}, "trained on 'image' inputs"),
    ],
)
def test_a_model_of_other_inputs_is_refused(model, match):
    with pytest.raises(ExportError, match=match):
        renormalize(torch.zeros(1, 2), TAB, model)


def test_the_scorer_gives_the_accuracy_on_the_nodes_test_split(tmp_path):
    run = make_run(tmp_path)
    score = held_out_scorer(run.dir, "a")
    cfg = load_topology(run.dir / "config.yaml")
    data = load_node_data(cfg.dataset, cfg.node_ids, "a", cfg.seed)
    with torch.no_grad():
        pred = load_model(run.dir, "a")(data.test_x).argmax(1)
    assert score(run.dir) == pytest.approx(float((pred == data.test_y).float().mean()))
    with pytest.raises(ExportError, match="no such run directory"):
        score(tmp_path / "nowhere")
