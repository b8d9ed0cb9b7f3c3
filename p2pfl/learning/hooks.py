"""The shapes of the hooks a method gives local training (:func:`p2pfl.learning.train.
train_local`): an extra loss term, a loss in place of cross-entropy, a step hook.

Contract: type aliases only. They live under ``learning/`` so that training needs nothing
of ``algorithms/``; :mod:`p2pfl.algorithms.base` re-exports them for the methods.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from p2pfl.learning.models import SplitModel

# added to cross-entropy: (model, xb, yb, logits) -> extra loss
ExtraLoss = Callable[[SplitModel, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# replaces cross-entropy: (model, xb, yb) -> (total loss to minimise, task loss to log)
LossFn = Callable[[SplitModel, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# runs after every optimizer step: (model) -> None
StepHook = Callable[[SplitModel], None]

__all__ = ["ExtraLoss", "LossFn", "StepHook"]
