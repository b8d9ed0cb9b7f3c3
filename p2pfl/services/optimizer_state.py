"""A node's optimizer kept from round to round (``training.optimizer_state: keep``).

By default a node makes its optimizer anew each round (``reset``, the papers' simulations),
so Adam forgets its moments and SGD its momentum at every merge. Under ``keep`` the node
makes it once, at its first round, over its model's parameters, and every round's
training (plain or DP-SGD) steps it at that round's learning rate. Its state goes into the
node's checkpoint (:mod:`p2pfl.services.checkpoint`) and comes back on a resume. A round
whose loss turns non-finite rolls the model back and starts the optimizer over (its
moments hold that round's non-finite steps).

What peers send never reaches it: a merge loads weights into the same parameters, in
place, and the moments stay the node's own.
"""

from __future__ import annotations

from typing import Any

import torch

from p2pfl.config.schema import TrainingConfig
from p2pfl.learning.train import make_optimizer


class KeptOptimizer:
    """The optimizer of one node's ``model`` under ``training``, made at its first use."""

    def __init__(self, model: torch.nn.Module, training: TrainingConfig):
        self.model = model
        self.training = training
        self.optimizer: torch.optim.Optimizer | None = None

    def for_round(self, lr: float) -> torch.optim.Optimizer:
        """The kept optimizer (made now at the first round), for a round at ``lr`` (the
        trainer sets it)."""
        if self.optimizer is None:
            self.optimizer = make_optimizer(self.model, self.training, lr)
        return self.optimizer

    def reset(self) -> None:
        """Start over at the next round (after a rolled-back round)."""
        self.optimizer = None

    def state(self) -> dict[str, Any] | None:
        """The optimizer's state as the checkpoint's codec holds it (tensors, numbers, str
        keys); None before the first round."""
        if self.optimizer is None:
            return None
        saved = self.optimizer.state_dict()
        return {
            "state": {
                str(i): {k: _plain(v) for k, v in entry.items()}
                for i, entry in saved["state"].items()
            },
            "param_groups": [{k: _plain(v) for k, v in g.items()} for g in saved["param_groups"]],
        }

    def load_state(self, state: Any, where: str) -> None:
        """Restore :meth:`state` (from this node's checkpoint); ``ValueError`` naming
        ``where`` when it does not fit this model and optimizer."""
        if state is None:
            self.optimizer = None
            return
        try:
            groups = [dict(g) for g in state["param_groups"]]
            entries = {int(i): dict(e) for i, e in state["state"].items()}
            opt = make_optimizer(self.model, self.training, float(groups[0]["lr"]))
            params = [p for g in opt.param_groups for p in g["params"]]
            for i, entry in entries.items():
                for key, value in entry.items():
                    if key != "step" and isinstance(value, torch.Tensor):
                        if value.shape != params[i].shape:
                            raise ValueError(f"state {i}.{key}: shape {tuple(value.shape)}")
            opt.load_state_dict({"state": entries, "param_groups": groups})
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            why = f"{type(exc).__name__}: {exc}"
            raise ValueError(f"{where}: the kept optimizer's state does not fit: {why}") from None
        self.optimizer = opt


def _plain(value: Any) -> Any:
    """A value of an optimizer's state dict as the codec holds it (tuples as lists)."""
    if isinstance(value, tuple):
        return list(value)
    return value
