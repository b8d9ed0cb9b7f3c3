"""Models: the g/h split, shapes, parameter counts, part_keys."""

from __future__ import annotations

import pytest
import torch

from p2pfl.config.schema import ModelConfig
from p2pfl.learning.models import SplitModel, build_model
from p2pfl.learning.state import part_keys

SHAPES = [(1, 28, 28), (3, 32, 32)]
SMALL = [(1, 8, 8)]


def _check(model: SplitModel, shape: tuple[int, ...], classes: int) -> None:
    assert isinstance(model, SplitModel)
    x = torch.randn(2, *shape)
    model.eval()
    with torch.no_grad():
        out = model(x)
        feats = model.features(x)
        assert torch.allclose(model.h(feats), out)
    assert out.shape == (2, classes)
    assert feats.dim() == 2 and feats.shape[0] == 2
    keys = list(model.state_dict())
    assert keys and all(k.startswith(("g.", "h.")) for k in keys)
    assert part_keys(keys, "g") and part_keys(keys, "h")


@pytest.mark.parametrize("shape", SHAPES + SMALL)
@pytest.mark.parametrize("name", ["cnn", "lenet", "mlp"])
def test_small_models_build_and_run(name, shape):
    model = build_model(ModelConfig(name=name, hidden=16), 7, shape)
    _check(model, shape, 7)
    assert model.feature_dim == model.features(torch.zeros(1, *shape)).shape[1]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", ["resnet18", "vgg11"])
def test_large_models_build_and_run(name, shape):
    model = build_model(ModelConfig(name=name), 10, shape)
    _check(model, shape, 10)


def test_cnn_layout():
    m = build_model(ModelConfig(name="cnn"), 10, (1, 28, 28))
    g_params = part_keys([n for n, _ in m.named_parameters()], "g")
    assert len(g_params) == 4  # two conv layers (weight, bias)
    assert m.feature_dim == 64 * 7 * 7
    assert m.h.fc1.out_features == 512
    assert build_model(ModelConfig(name="cnn"), 10, (1, 8, 8)).feature_dim == 64 * 2 * 2


def test_cnn_valid_padding_has_the_literatures_1600_features():
    valid = ModelConfig(name="cnn", padding="valid")
    m = build_model(valid, 10, (3, 32, 32))
    assert m.feature_dim == 64 * 5 * 5  # 32 → 28 → 14 → 10 → 5
    assert m.h.fc1.in_features == 1600
    assert build_model(valid, 10, (1, 28, 28)).feature_dim == 64 * 4 * 4
    assert build_model(ModelConfig(name="cnn"), 10, (3, 32, 32)).feature_dim == 4096


def test_cnn_last_head_moves_fc1_into_g_with_the_same_function():
    torch.manual_seed(0)
    fc = build_model(ModelConfig(name="cnn"), 10, (1, 28, 28))
    torch.manual_seed(0)
    last = build_model(ModelConfig(name="cnn", head="last"), 10, (1, 28, 28))
    assert part_keys(list(last.state_dict()), "h") == ["h.fc2.weight", "h.fc2.bias"]
    assert torch.equal(last.g.fc1.weight, fc.h.fc1.weight)  # same initial values
    assert last.feature_dim == 512
    _check(last, (1, 28, 28), 10)
    x = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        assert torch.allclose(last(x), fc(x))


def test_lenet_has_400_features_on_28_and_32():
    assert build_model(ModelConfig(name="lenet"), 10, (1, 28, 28)).feature_dim == 400
    assert build_model(ModelConfig(name="lenet"), 10, (3, 32, 32)).feature_dim == 400


def test_mlp_hidden():
    m = build_model(ModelConfig(name="mlp", hidden=64), 10, (1, 28, 28))
    assert m.feature_dim == 64
    assert [n for n, _ in m.named_parameters()] == [
        "g.fc.weight",
        "g.fc.bias",
        "h.weight",
        "h.bias",
    ]


def test_resnet18_split_counts():
    m = build_model(ModelConfig(name="resnet18"), 10, (3, 32, 32))
    names = [n for n, _ in m.named_parameters()]
    assert len(names) == 62
    assert len(part_keys(names, "g")) == 60
    assert part_keys(names, "h") == ["h.weight", "h.bias"]
    assert m.g.conv1.kernel_size == (3, 3) and m.g.conv1.stride == (1, 1)
    assert not any(isinstance(mod, torch.nn.MaxPool2d) for mod in m.modules())
    gray = build_model(ModelConfig(name="resnet18"), 10, (1, 28, 28))
    assert gray.g.conv1.in_channels == 1


def test_build_is_deterministic_under_the_global_seed():
    torch.manual_seed(3)
    a = build_model(ModelConfig(name="cnn"), 4, (1, 8, 8)).state_dict()
    torch.manual_seed(3)
    b = build_model(ModelConfig(name="cnn"), 4, (1, 8, 8)).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_part_keys():
    keys = ["g.a", "h.b", "g.c", "h.d.e"]
    assert part_keys(keys, "g") == ["g.a", "g.c"]
    assert part_keys(keys, "h") == ["h.b", "h.d.e"]
    assert part_keys(keys, "all") == keys
    assert part_keys(iter(keys), "g") == ["g.a", "g.c"]
    with pytest.raises(ValueError, match="unknown model part"):
        part_keys(keys, "x")


def test_too_small_input_is_a_clear_error():
    with pytest.raises(ValueError, match="lenet"):
        build_model(ModelConfig(name="lenet"), 10, (1, 2, 2))
    with pytest.raises(ValueError, match="image input shape"):
        build_model(ModelConfig(name="cnn"), 10, (64,))
