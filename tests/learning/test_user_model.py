"""A user's own nn.Module as a SplitModel: names, the g/h split by prefix, features,
devices and modes, and the errors a user gets for each way it can go wrong."""

from __future__ import annotations

import sys

import pytest
import torch
from user_models_src import USER_MODULE

from p2pfl.config.schema import ModelConfig
from p2pfl.learning.models import UserModelError, build_model
from p2pfl.learning.state import select_part
from p2pfl.learning.user_model import UserSplitModel, matches


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """``usernet`` importable from the current directory, as a user's own module is."""
    (tmp_path / "usernet.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "usernet"
    sys.modules.pop("usernet", None)


def build(name: str, **kw) -> UserSplitModel:
    return build_model(ModelConfig(name=name, **kw), 3, (1, 4, 4))


def test_default_split_is_the_last_linear(user_module):
    torch.manual_seed(0)
    model = build("usernet:make")
    keys = list(model.state_dict())
    assert [k for k in keys if k.startswith("h.")] == [
        "h.classifier.2.weight",
        "h.classifier.2.bias",
    ]
    assert "g.classifier.0.weight" in keys and "g.norm.running_mean" in keys
    # the names after g./h. are the user's own, and every tensor is there once
    own = model.export_module().state_dict()
    assert sorted(k.split(".", 1)[1] for k in keys) == sorted(own)
    assert len(list(model.parameters())) == len(list(model.export_module().parameters()))
    assert model.feature_dim == 12


def test_forward_and_features_are_the_users(user_module):
    torch.manual_seed(0)
    model = build("usernet:make").eval()
    x = torch.randn(5, 1, 4, 4)
    net = model.export_module()
    assert torch.equal(model(x), net(x))
    feats, logits = model.features_and_logits(x)
    assert torch.equal(logits, net(x))
    # g(x) is what the personal layer classifier.2 takes
    seen = net.classifier[1](net.classifier[0](net.drop(net.norm(net.body(x)))))
    assert torch.equal(feats, seen) and torch.equal(model.features(x), seen)


def test_state_loads_into_the_users_module_and_trains_it(user_module):
    torch.manual_seed(0)
    model = build("usernet:make")
    state = {k: v + 1 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    assert torch.equal(model.export_module().classifier[2].weight, state["h.classifier.2.weight"])
    before = model.export_module().body[1].weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = torch.nn.functional.cross_entropy(model(torch.randn(8, 1, 4, 4)), torch.zeros(8).long())
    loss.backward()
    opt.step()
    assert not torch.equal(before, model.export_module().body[1].weight)


def test_modes_reach_modules_without_tensors(user_module):
    model = build("usernet:make")
    model.eval()
    assert not model.export_module().drop.training and not model.export_module().training
    model.train()
    assert model.export_module().drop.training


def test_personal_prefixes_choose_h(user_module):
    model = build("usernet:make", personal=["norm", "classifier"])
    h = select_part(model.state_dict(), "h")
    assert sorted(h) == sorted(
        f"h.{k}"
        for k in model.export_module().state_dict()
        if k.startswith(("norm.", "classifier."))
    )
    assert model.feature_dim == 12  # the input of norm, the first personal module reached


def test_prefix_matching_is_by_path():
    assert matches("fc.weight", "fc") and matches("fc", "fc")
    assert not matches("fc2.weight", "fc")
    assert matches("layer1.0.conv.weight", "layer1.")


@pytest.mark.parametrize(
    ("name", "kw", "field", "words"),
    [
        ("nowhere_pkg.mod:make", {}, "model.name", "no module named 'nowhere_pkg'"),
        ("usernet:missing", {}, "model.name", "has no 'missing'"),
        ("usernet:raises", {}, "model.name", "RuntimeError: no GPU found for this model"),
        ("usernet:wrong_input", {}, "model.name", "forward fails on a batch of shape [2, 1, 4, 4]"),
        ("usernet:not_a_module", {}, "model.name", "not a torch.nn.Module"),
        ("usernet:make", {"personal": ["head"]}, "model.personal", "prefix 'head' matches no"),
        ("usernet:make", {"personal": ["norm.running_mean"]}, "model.personal", "no trainable"),
    ],
)
def test_user_model_errors_name_the_field_and_the_cause(user_module, name, kw, field, words):
    with pytest.raises(UserModelError) as info:
        build(name, **kw)
    assert info.value.field == field
    assert words in str(info.value) and name in str(info.value)


def test_the_factory_gets_kwargs(user_module):
    model = build("usernet:make", kwargs={"hidden": 7})
    assert model.feature_dim == 7


def test_a_model_of_one_linear_layer_is_all_personal_by_default(user_module):
    torch.manual_seed(0)
    model = build("usernet:logistic")
    assert model.parts_held == {"h"} and select_part(model.state_dict(), "g") == {}
    x = torch.randn(5, 1, 4, 4)
    feats, logits = model.features_and_logits(x)
    # g is the identity: the features are the input the linear layer takes
    assert torch.equal(feats, x.flatten(1)) and model.feature_dim == 16
    assert torch.equal(logits, model.export_module()(x))


def test_a_bare_linear_module_splits_by_its_own_parameters(user_module):
    model = build_model(ModelConfig(name="usernet:bare_linear"), 3, (16,))
    assert model.personal == ["weight", "bias"] and model.parts_held == {"h"}
    x = torch.randn(4, 16)
    assert torch.equal(model.features(x), x) and model(x).shape == (4, 3)


def test_nothing_personal_leaves_h_the_identity(user_module):
    model = build("usernet:logistic", personal=[])
    assert model.parts_held == {"g"} and select_part(model.state_dict(), "h") == {}
    x = torch.randn(2, 1, 4, 4)
    feats, logits = model.features_and_logits(x)
    assert torch.equal(feats, logits) and model.feature_dim == 3
    mlp = build("usernet:make", personal=[])
    assert mlp.parts_held == {"g"} and mlp.feature_dim == 3


def test_a_personal_intercept_inside_one_layer(user_module):
    model = build_model(ModelConfig(name="usernet:bare_linear", personal=["bias"]), 1, (16,))
    assert model.parts_held == {"g", "h"}
    assert sorted(model.state_dict()) == ["g.weight", "h.bias"]
    x = torch.randn(3, 16)
    feats, out = model.features_and_logits(x)  # no module of h's own: the input
    assert torch.equal(feats, x) and out.shape == (3, 1)
