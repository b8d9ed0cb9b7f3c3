"""The model contract every method relies on: ``forward(x) == h(g(x))``.

* ``g`` maps an input batch ``(B, *input_shape)`` to flattened features ``(B, F)``
  (:meth:`SplitModel.features`) and ``h`` maps them to logits ``(B, num_classes)``.
* Every ``state_dict`` key starts with ``g.`` or ``h.``, so a part of a model (``g``, ``h``
  or ``all``) is selected by key prefix alone (:func:`p2pfl.learning.state.part_keys`).

The built-in models (:mod:`p2pfl.learning.models`) are ``SplitModel`` s of two
``nn.Module`` s; a user's own module is wrapped by
:class:`p2pfl.learning.user_model.UserSplitModel`, which keeps the same contract.
"""

from __future__ import annotations

import torch
from torch import nn


class SplitModel(nn.Module):
    """``forward(x) = h(g(x))`` with ``g``: input → (B, F) features, ``h``: (B, F) → logits."""

    def __init__(
        self,
        g: nn.Module,
        h: nn.Module,
        *,
        name: str = "",
        num_classes: int = 0,
        input_shape: tuple[int, ...] = (),
        feature_dim: int = 0,
    ):
        super().__init__()
        self.g = g
        self.h = h
        self.name = name
        self.num_classes = num_classes
        self.input_shape = tuple(input_shape)
        self.feature_dim = feature_dim

    @property
    def parts_held(self) -> frozenset[str]:
        """The parts that hold a trainable parameter: ``{"g", "h"}`` for every built-in
        model; one of them for a user's model whose ``model.personal`` leaves the other
        empty (:mod:`p2pfl.learning.user_model`)."""
        return frozenset(p for p in ("g", "h") if any(True for _ in getattr(self, p).parameters()))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """``g(x)``: flattened features of shape ``(B, F)``."""
        return self.g(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.h(self.g(x))

    def features_and_logits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(g(x), h(g(x)))`` with ``g`` run once."""
        feats = self.g(x)
        return feats, self.h(feats)

    def export_module(self) -> nn.Module:
        """The module a user takes away after training: this model itself for a built-in
        one, the user's own module for a user model (whose state_dict names are the user's)."""
        return self

    def extra_repr(self) -> str:
        return f"name={self.name!r}, input_shape={self.input_shape}, classes={self.num_classes}"

    def replace_module(self, name: str, new: nn.Module) -> None:
        """Put ``new`` at ``name`` (relative to this model, e.g. ``h.fc2``)."""
        parent_name, _, child = name.rpartition(".")
        parent = self.get_submodule(parent_name) if parent_name else self
        setattr(parent, child, new)
