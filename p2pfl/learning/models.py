"""Models split into a feature extractor ``g`` and a classifier ``h``.

Contract (relied on by every algorithm):

* ``SplitModel.forward(x) == h(g(x))``; ``g`` maps an input batch ``(B, *input_shape)`` to
  flattened features ``(B, F)`` and ``h`` maps ``(B, F)`` to logits ``(B, num_classes)``.
* Every ``state_dict`` key starts with ``g.`` or ``h.``, so a part of a model (``g``, ``h``
  or ``all``) is selected by key prefix alone (:func:`p2pfl.learning.state.part_keys`).
* :func:`build_model` draws its initial weights from torch's global RNG only (so seeding
  ``torch.manual_seed`` first gives the same model on every node) and never downloads
  weights.

All convolutional layers are in ``g``; the remaining (fully connected) layers are in ``h``.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
from torch import nn

from p2pfl.config.schema import ModelConfig
from p2pfl.learning.split_model import SplitModel
from p2pfl.learning.user_code import UserCodeError, describe, import_object
from p2pfl.learning.user_model import ModelSplitError, build_user_model

# ----------------------------------------------------------------------------- helpers


def _feature_dim(g: nn.Module, input_shape: tuple[int, ...], model: str) -> int:
    """F of ``g`` for one dummy input (eval mode, no grad, no RNG use)."""
    was_training = g.training
    g.eval()
    try:
        with torch.no_grad():
            out = g(torch.zeros(1, *input_shape))
    except RuntimeError as exc:
        raise ValueError(
            f"model {model!r} cannot take inputs of shape {tuple(input_shape)}: {exc}"
        ) from None
    finally:
        g.train(was_training)
    if out.dim() != 2 or out.shape[1] == 0:
        raise ValueError(
            f"model {model!r}: input shape {tuple(input_shape)} gives features {tuple(out.shape)}"
        )
    return int(out.shape[1])


def _image_shape(input_shape: tuple[int, ...], model: str) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise ValueError(
            f"model {model!r} needs an image input shape (C, H, W), got {tuple(input_shape)}"
        )
    c, hh, ww = (int(v) for v in input_shape)
    return c, hh, ww


def _cnn(c: int, padding: str = "same") -> nn.Module:
    """UA-PDFL CNN features: two 5x5 conv layers (32, 64 channels), ReLU, max-pool 2; padding 2
    (``same``) or none (``valid``)."""
    pad = 2 if padding == "same" else 0
    return nn.Sequential(
        OrderedDict(
            conv1=nn.Conv2d(c, 32, 5, padding=pad),
            relu1=nn.ReLU(inplace=True),
            pool1=nn.MaxPool2d(2),
            conv2=nn.Conv2d(32, 64, 5, padding=pad),
            relu2=nn.ReLU(inplace=True),
            pool2=nn.MaxPool2d(2),
            flatten=nn.Flatten(),
        )
    )


def _lenet(c: int, hh: int, ww: int) -> nn.Module:
    """LeNet features (conv5x5 6ch → pool 2 → conv5x5 16ch → pool 2). Padding is the classic
    one where it fits (28x28 and 32x32 both give 16·5·5 = 400 features, as in the papers) and
    2 where the input is too small for it (e.g. 8x8)."""
    side = min(hh, ww)
    pad1 = 0 if side >= 32 else 2
    after1 = (side + 2 * pad1 - 4) // 2
    pad2 = 0 if after1 >= 10 else 2
    return nn.Sequential(
        OrderedDict(
            conv1=nn.Conv2d(c, 6, 5, padding=pad1),
            relu1=nn.ReLU(inplace=True),
            pool1=nn.MaxPool2d(2),
            conv2=nn.Conv2d(6, 16, 5, padding=pad2),
            relu2=nn.ReLU(inplace=True),
            pool2=nn.MaxPool2d(2),
            flatten=nn.Flatten(),
        )
    )


def _resnet18(c: int, num_classes: int) -> tuple[nn.Module, nn.Module]:
    """CIFAR-style ResNet18: 3x3 stride-1 stem, no max-pool. g ends with avgpool + flatten."""
    from torchvision.models import resnet18

    net = resnet18(weights=None, num_classes=num_classes)
    net.conv1 = nn.Conv2d(c, 64, kernel_size=3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
    g = nn.Sequential(
        OrderedDict(
            conv1=net.conv1,
            bn1=net.bn1,
            relu=net.relu,
            layer1=net.layer1,
            layer2=net.layer2,
            layer3=net.layer3,
            layer4=net.layer4,
            avgpool=net.avgpool,
            flatten=nn.Flatten(),
        )
    )
    return g, net.fc


def _vgg11(c: int, num_classes: int) -> tuple[nn.Module, nn.Module]:
    """torchvision VGG11 (no BN). The first conv takes ``c`` channels; max-pools use
    ``ceil_mode`` so inputs smaller than 32x32 (e.g. 28x28) still pass all five pools
    (identical to floor mode for 32x32)."""
    from torchvision.models import vgg11

    net = vgg11(weights=None, num_classes=num_classes)
    first = net.features[0]
    assert isinstance(first, nn.Conv2d)
    if c != first.in_channels:
        conv = nn.Conv2d(c, first.out_channels, kernel_size=3, padding=1)
        nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")
        nn.init.constant_(conv.bias, 0)
        net.features[0] = conv
    for m in net.features:
        if isinstance(m, nn.MaxPool2d):
            m.ceil_mode = True
    g = nn.Sequential(OrderedDict(features=net.features, avgpool=net.avgpool, flatten=nn.Flatten()))
    return g, net.classifier


# ----------------------------------------------------------------------------- factory


class UserModelError(UserCodeError, ValueError):
    """A user's model that cannot be built or split: the factory does not import or raises,
    returns no ``nn.Module``, fails on the input shape, or ``model.personal`` does not split
    it. ``field`` is the config field to fix (``model.name`` or ``model.personal``)."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)


def build_user_module(
    cfg: ModelConfig, num_classes: int, input_shape: tuple[int, ...]
) -> SplitModel:
    """The user's model ``cfg.name`` (``package.module:factory``) for ``num_classes`` and
    ``input_shape``, split by ``cfg.personal`` (:mod:`p2pfl.learning.user_model`); a
    :class:`UserModelError` naming the factory and the field otherwise."""
    try:
        factory = import_object(cfg.name, "model factory")
    except UserCodeError as exc:
        raise UserModelError("model.name", str(exc)) from None
    try:
        return build_user_model(
            factory, cfg.name, num_classes, input_shape, cfg.personal, cfg.kwargs
        )
    except ModelSplitError as exc:
        raise UserModelError(exc.field, f"model {cfg.name!r}: {exc}") from None
    except Exception as exc:  # the user's factory or forward raised
        raise UserModelError(
            "model.name",
            f"model {cfg.name!r} (num_classes={num_classes}, input_shape={list(input_shape)}): "
            f"{describe(exc)}",
        ) from None


def build_model(cfg: ModelConfig, num_classes: int, input_shape: tuple[int, ...]) -> SplitModel:
    """A fresh :class:`SplitModel` named by ``cfg.name`` for ``num_classes`` classes and inputs of
    shape ``input_shape`` (``(C, H, W)`` for images; any shape for ``mlp``).

    * ``cnn``: g = conv5x5(32, pad 2) → ReLU → pool2 → conv5x5(64, pad 2) → ReLU → pool2 →
      flatten; h = Linear(F, 512) → ReLU → Linear(512, classes). ``cfg.padding = "valid"``
      pads none (F = 1,600 on 32x32 inputs, 1,024 on 28x28). ``cfg.head = "last"`` moves
      Linear(F, 512) → ReLU into g, leaving h = Linear(512, classes) (same initial values).
    * ``lenet``: g = conv5x5(6) → ReLU → pool2 → conv5x5(16) → ReLU → pool2 → flatten;
      h = Linear(F, 120) → ReLU → Linear(120, 84) → ReLU → Linear(84, classes).
    * ``mlp``: g = flatten → Linear(prod(shape), cfg.hidden) → ReLU; h = Linear(hidden, classes).
    * ``resnet18``: CIFAR-style ResNet18; g = all but ``fc`` (60 parameter tensors), h = ``fc``.
    * ``vgg11``: torchvision VGG11; g = features + avgpool + flatten, h = classifier.

    * ``package.module:factory``: the user's own module (:func:`build_user_module`).

    Raises ``ValueError`` for an input shape the model cannot take."""
    input_shape = tuple(int(v) for v in input_shape)
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    name = cfg.name
    if cfg.is_user:
        return build_user_module(cfg, num_classes, input_shape)
    if name == "mlp":
        in_dim = math.prod(input_shape)
        g: nn.Module = nn.Sequential(
            OrderedDict(
                flatten=nn.Flatten(),
                fc=nn.Linear(in_dim, cfg.hidden),
                relu=nn.ReLU(inplace=True),
            )
        )
        h: nn.Module = nn.Linear(cfg.hidden, num_classes)
    elif name == "cnn":
        c, _, _ = _image_shape(input_shape, name)
        g = _cnn(c, cfg.padding)
        f = _feature_dim(g, input_shape, name)
        if cfg.head == "last":  # same layers, same initial values; fc1 moves into g
            g.add_module("fc1", nn.Linear(f, 512))
            g.add_module("relu", nn.ReLU(inplace=True))
            h = nn.Sequential(OrderedDict(fc2=nn.Linear(512, num_classes)))
        else:
            h = nn.Sequential(
                OrderedDict(
                    fc1=nn.Linear(f, 512),
                    relu=nn.ReLU(inplace=True),
                    fc2=nn.Linear(512, num_classes),
                )
            )
    elif name == "lenet":
        c, hh, ww = _image_shape(input_shape, name)
        g = _lenet(c, hh, ww)
        f = _feature_dim(g, input_shape, name)
        h = nn.Sequential(
            OrderedDict(
                fc1=nn.Linear(f, 120),
                relu1=nn.ReLU(inplace=True),
                fc2=nn.Linear(120, 84),
                relu2=nn.ReLU(inplace=True),
                fc3=nn.Linear(84, num_classes),
            )
        )
    elif name == "resnet18":
        c, _, _ = _image_shape(input_shape, name)
        g, h = _resnet18(c, num_classes)
    elif name == "vgg11":
        c, _, _ = _image_shape(input_shape, name)
        g, h = _vgg11(c, num_classes)
    else:  # pragma: no cover - config validation rejects other names
        raise ValueError(f"unknown model {name!r}")
    f = _feature_dim(g, input_shape, name)
    return SplitModel(
        g, h, name=name, num_classes=num_classes, input_shape=input_shape, feature_dim=f
    )
