"""Small own data learns at the defaults: where ``training.epochs`` is unset a node trains
whole epochs up to ``training.min_steps`` optimizer steps a round; where it is set, exactly
that many epochs. ``p2pfl validate`` prints each node's samples and steps a round, and warns
where a node holds fewer rows than a batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from p2pfl.check.sizes import describe_sizes, node_sizes, round_steps, size_warnings
from p2pfl.cli import main
from p2pfl.config.schema import TopologyConfig, TrainingConfig
from p2pfl.learning.models import build_model
from p2pfl.learning.train import epoch_steps, round_epochs, train_local
from p2pfl.privacy.accountant import steps_per_round


@pytest.mark.parametrize(
    ("n", "batch", "steps"), [(36, 50, 1), (50, 50, 1), (51, 50, 2), (100, 8, 13), (0, 8, 1)]
)
def test_epoch_steps_count_the_short_last_batch(n, batch, steps):
    assert epoch_steps(n, batch) == steps


def test_unset_epochs_reach_min_steps_in_whole_epochs():
    cfg = TrainingConfig()
    assert cfg.epochs is None and cfg.min_steps == 20
    assert round_epochs(cfg, 1) == 20  # one batch an epoch: 20 epochs
    assert round_epochs(cfg, 3) == 7  # 21 steps: the fewest whole epochs reaching 20
    assert round_epochs(cfg, 20) == 1
    assert round_epochs(cfg, 1200) == 1  # a large node trains one epoch, as before
    assert round_epochs(TrainingConfig(min_steps=5), 2) == 3


def test_set_epochs_are_kept_whatever_the_data():
    assert round_epochs(TrainingConfig(epochs=1), 1) == 1
    assert round_epochs(TrainingConfig(epochs=3, min_steps=100), 1) == 3


def _iris_like(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    x = torch.randn(n, 4, generator=g) + 2.0 * torch.nn.functional.one_hot(y, 4)
    return x, y


def test_a_node_with_one_batch_takes_min_steps_a_round():
    x, y = _iris_like(36)
    model = build_model(TopologyConfig(name="t", nodes=1, model={"name": "mlp"}).model, 3, (4,))
    cfg = TrainingConfig(batch_size=50)
    assert train_local(model, x, y, cfg, 0.05).steps == 20
    assert train_local(model, x, y, TrainingConfig(epochs=1, batch_size=50), 0.05).steps == 1
    assert train_local(model, x, y, TrainingConfig(batch_size=16), 0.05).steps == 21  # 7 × 3


def test_a_time_budget_cuts_a_round_short():
    """A catch-up round at the swarm's pace (docs/wire.md, "Rounds and catch-up"): the
    steps end once their time, scaled as an emulated device's, reaches ``budget_s``; the
    first is always taken, and the losses are those of the last epoch begun, never of the
    empty one after the budget ran out."""
    x, y = _iris_like(36)
    model = build_model(TopologyConfig(name="t", nodes=1, model={"name": "mlp"}).model, 3, (4,))
    cfg = TrainingConfig(batch_size=16)  # 21 steps: 7 epochs of 3
    assert train_local(model, x, y, cfg, 0.05, budget_s=1e9).steps == 21
    out = train_local(model, x, y, cfg, 0.05, budget_s=1.0, time_scale=1e12)
    assert out.steps == 1 and out.loss > 0 and out.ce_loss > 0
    one_batch = TrainingConfig(batch_size=50)  # 20 epochs of one step: the budget ends one
    out = train_local(model, x, y, one_batch, 0.05, budget_s=1.0, time_scale=1e12)
    assert out.steps == 1 and out.loss > 0 and out.ce_loss > 0


def test_round_steps_follow_the_trainer():
    cfg = TopologyConfig(name="t", nodes=1, training={"batch_size": 8})
    assert round_steps(cfg, 100) == 2 * 13  # ⌈100/8⌉ = 13 a plain epoch
    dp = TopologyConfig(
        name="t",
        nodes=1,
        training={"batch_size": 8},
        defence={"rule": "mean"},
        privacy={"dp": {"noise_multiplier": 1.0}},
    )
    # DP-SGD's Poisson epochs take ⌊1/q⌋ = 12 steps: 2 epochs reach 20
    assert round_steps(dp, 100) == steps_per_round(8, 100, 2) == 24


def _own_csv_topology(tmp_path, rows: int, training: dict | None = None) -> TopologyConfig:
    pd = pytest.importorskip("pandas")
    rng = np.random.default_rng(0)
    for node in ("a", "b"):
        y = np.arange(rows) % 3
        frame = pd.DataFrame(rng.normal(size=(rows, 3)) + y[:, None], columns=["f0", "f1", "f2"])
        frame["label"] = y
        frame.to_csv(tmp_path / f"{node}.csv", index=False)
    topo = {
        "name": "small",
        "nodes": ["a", "b"],
        "dataset": {
            "name": "csv",
            "root": str(tmp_path / "{id}.csv"),
            "partition": "none",
            "label": "label",
            "classes": 3,
            "test_fraction": 0.25,
        },
        "model": {"name": "mlp"},
    }
    if training is not None:
        topo["training"] = training
    return TopologyConfig.model_validate(topo)


def test_node_sizes_and_the_small_node_warning(tmp_path):
    cfg = _own_csv_topology(tmp_path, 48)
    sizes = node_sizes(cfg)
    assert [(s.node, s.train, s.test, s.steps_per_round) for s in sizes] == [
        ("a", 36, 12, 20),
        ("b", 36, 12, 20),
    ]
    (warning,) = size_warnings(cfg, sizes)
    assert warning.startswith("training.batch_size: 2 node(s) hold fewer training rows")
    assert "a (36), b (36)" in warning and "training.min_steps" in warning
    lines = describe_sizes(cfg, sizes)
    assert "at least 20 steps (training.min_steps)" in lines[0]
    assert lines[1].split() == ["a", "train", "36", "test", "12", "20", "steps", "a", "round"]
    fitted = _own_csv_topology(tmp_path, 48, {"batch_size": 16})
    assert size_warnings(fitted, node_sizes(fitted)) == []


def test_validate_prints_each_nodes_samples_and_steps(tmp_path, capsys):
    cfg = _own_csv_topology(tmp_path, 48, {"epochs": 1})
    path = tmp_path / "small.yaml"
    path.write_text(__import__("yaml").safe_dump(cfg.dump()))
    assert main(["validate", str(path)]) == 0
    err = capsys.readouterr().err
    assert "training a round: 1 epoch(s) of batches of 50" in err, err
    assert "a  train     36  test     12  1 steps a round" in err, err
    assert "warning" in err and "set a smaller training.batch_size" in err, err
