"""A topology's own task: ``training.loss`` (cross-entropy, BCE, MSE, MAE or the user's),
``evaluation.metrics`` and labels that are classes or values; the metrics against their
definitions, and the config and model checks that name the field to fix."""

from __future__ import annotations

import itertools
import math
import sys

import numpy as np
import pytest
import torch

from p2pfl.check.preflight import check_model
from p2pfl.config.schema import TopologyConfig
from p2pfl.errors import ConfigError
from p2pfl.learning.task import (
    auc,
    balanced_accuracy,
    class_scores,
    concordance_index,
    f1,
    model_outputs,
    record_field,
    task_of,
)

LOGISTIC = """
import math
import torch
from torch import nn


def logistic(num_classes, input_shape):
    return nn.Linear(math.prod(input_shape), num_classes)


def two_logits(num_classes, input_shape):
    return nn.Linear(math.prod(input_shape), 2)


def cox(outputs, y):
    event, time = y[:, 0], y[:, 1]
    order = torch.argsort(time, descending=True)
    risk, event = outputs.reshape(-1)[order], event[order]
    return -((risk - torch.logcumsumexp(risk, 0)) * event).sum() / event.sum().clamp_min(1)


def broken(outputs, y):
    return "not a tensor"
"""


@pytest.fixture
def usertask(tmp_path, monkeypatch):
    (tmp_path / "usertask.py").write_text(LOGISTIC)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield "usertask"
    sys.modules.pop("usertask", None)


def _cfg(**sections) -> TopologyConfig:
    dataset = {"name": "csv", "partition": "none", "root": "x.csv", **sections.pop("dataset", {})}
    return TopologyConfig(name="t", nodes=["a", "b"], dataset=dataset, **sections)


# ----------------------------------------------------------------------------- metrics


def brute_c_index(risk, event, time):
    num = den = 0.0
    for i, j in itertools.permutations(range(len(risk)), 2):
        if event[i] and time[i] < time[j]:
            den += 1
            num += 1.0 if risk[i] > risk[j] else 0.5 if risk[i] == risk[j] else 0.0
    return num / den


def test_the_c_index_is_harrells_over_every_comparable_pair():
    rng = np.random.default_rng(0)
    risk = rng.integers(0, 5, 40).astype(float)  # ties among risks
    time = rng.integers(1, 30, 40).astype(float)  # ties among times: not comparable
    event = rng.integers(0, 2, 40)
    assert concordance_index(risk, event, time) == pytest.approx(brute_c_index(risk, event, time))
    perfect = np.arange(10.0)
    assert concordance_index(-perfect, np.ones(10), perfect) == 1.0
    assert math.isnan(concordance_index(perfect, np.zeros(10), perfect))  # no event: no pair


def test_class_metrics_against_their_definitions():
    y = np.array([0, 0, 1, 1, 1, 2])
    probs = np.eye(3)[[0, 1, 1, 1, 0, 2]] * 0.8 + 0.1
    assert balanced_accuracy(probs, y) == pytest.approx((1 / 2 + 2 / 3 + 1) / 3)
    f_per = [2 / (2 + 1 + 1), 4 / (4 + 1 + 1), 1.0]  # 2tp / (2tp + fp + fn) per class
    assert f1(probs, y) == pytest.approx(np.mean(f_per))
    # one logit: the sigmoid is the positive class's probability
    z = torch.tensor([[-2.0], [0.5], [3.0], [-0.1]])
    p = class_scores(z)
    assert p.shape == (4, 2) and p[:, 1] == pytest.approx(torch.sigmoid(z[:, 0]).numpy())
    assert auc(p, np.array([0, 1, 1, 0])) == 1.0
    assert auc(p, np.array([1, 0, 0, 1])) == 0.0
    assert math.isnan(auc(p, np.array([1, 1, 1, 1])))  # one class: undefined


def test_record_fields_name_each_metric():
    assert record_field("accuracy") == "test_acc"
    assert record_field("c_index") == "test_c_index"
    assert record_field("mypkg.scores:brier") == "test_brier"


# ----------------------------------------------------------------------------- the config


def test_the_loss_sets_what_the_labels_are_and_what_the_model_outputs():
    assert _cfg(dataset={"classes": 3}).dataset.targets == "classes"
    reg = _cfg(training={"loss": "mse"}, dataset={"label": ["a", "b"]})
    assert reg.dataset.targets == "values" and model_outputs(reg, 2) == 2
    binary = _cfg(training={"loss": "bce"}, dataset={"classes": [0, 1]})
    assert binary.dataset.targets == "classes" and model_outputs(binary, 2) == 1
    task = task_of(reg)
    assert task.metrics == ("mae", "rmse") and not task.is_default
    assert task_of(_cfg(dataset={"classes": 3})).is_default
    assert "targets" not in _cfg(dataset={"classes": 3}).dump()["dataset"]  # records unchanged


@pytest.mark.parametrize(
    ("sections", "words"),
    [
        ({"training": {"loss": "cross_entropie"}}, "did you mean 'cross_entropy'"),
        ({"evaluation": {"metrics": ["auc", "cindex"]}}, "did you mean 'c_index'"),
        (
            {"training": {"loss": "bce"}, "dataset": {"classes": ["a", "b", "c"]}},
            "bce is one logit for two classes; the dataset has 3",
        ),
        (
            {"training": {"loss": "mse"}, "evaluation": {"metrics": ["auc"]}},
            "auc scores classes; the labels are values",
        ),
        ({"evaluation": {"metrics": ["rmse"]}, "dataset": {"classes": 2}}, "rmse scores values"),
        (
            {"training": {"loss": "mse"}, "dataset": {"partition": "iid"}},
            "give dataset.partition: none",
        ),
    ],
)
def test_a_task_that_cannot_work_is_refused_naming_the_field(sections, words):
    with pytest.raises(ValueError, match=words):
        _cfg(**sections)


# ----------------------------------------------------------------------------- the checks


def test_a_model_whose_outputs_do_not_fit_the_loss_names_training_loss(usertask):
    one = _cfg(dataset={"classes": [0, 1]}, model={"name": "usertask:logistic"})
    assert check_model(one.model_copy(update={"training": one.training}), 2, (4,)) is not None
    two = _cfg(
        dataset={"classes": [0, 1]},
        training={"loss": "bce"},
        model={"name": "usertask:two_logits"},
    )
    with pytest.raises(ConfigError) as info:
        check_model(two, 2, (4,), "t.yaml")
    assert info.value.errors[0][0] == "training.loss"
    assert "bce: the model outputs (2, 2) for a batch of 2" in str(info.value)


def test_a_users_loss_is_checked_on_the_models_outputs(usertask):
    cox = _cfg(
        dataset={"label": ["event", "time"]},
        training={"loss": "usertask:cox"},
        evaluation={"metrics": ["c_index"]},
        model={"name": "usertask:logistic"},
    )
    assert cox.dataset.targets == "values" and model_outputs(cox, 2) == 1
    check_model(cox, 2, (5,), "t.yaml")
    broken = cox.model_copy(
        update={"training": cox.training.model_copy(update={"loss": "usertask:broken"})}
    )
    with pytest.raises(ConfigError, match="training.loss: 'usertask:broken' on outputs"):
        check_model(broken, 2, (5,), "t.yaml")
    missing = cox.model_copy(
        update={"training": cox.training.model_copy(update={"loss": "usertask:nope"})}
    )
    with pytest.raises(ConfigError, match="training.loss"):
        check_model(missing, 2, (5,), "t.yaml")


@pytest.mark.parametrize(
    ("method", "sections", "words"),
    [
        (
            "pfedc",
            {"training": {"loss": "bce"}, "dataset": {"classes": [0, 1]}},
            "method 'pfedc' trains its task heads with its own loss",
        ),
        (
            "uapdfl",
            {"training": {"loss": "mse"}, "dataset": {"label": ["a", "b"]}},
            "this model outputs 2 values a row",
        ),
    ],
)
def test_a_method_whose_maths_cannot_train_the_task_says_so(usertask, method, sections, words):
    cfg = _cfg(algorithm={"name": method}, model={"name": "mlp"}, **sections)
    with pytest.raises(ConfigError, match=words) as info:
        check_model(cfg, 2, (4,), "t.yaml")
    assert info.value.errors[0][0] == "training.loss"


def test_uapdfl_reads_one_output_as_a_probability(usertask):
    from p2pfl.algorithms.uapdfl import unit_distribution

    z = torch.tensor([[0.3]])
    assert torch.allclose(
        unit_distribution(z), torch.tensor([[torch.sigmoid(z).item(), 1 - torch.sigmoid(z).item()]])
    )
    cox = _cfg(
        algorithm={"name": "uapdfl"},
        dataset={"label": ["event", "time"]},
        training={"loss": "usertask:cox"},
        model={"name": "usertask:logistic"},
    )
    check_model(cox, 2, (5,), "t.yaml")  # a one-output risk score: accepted
