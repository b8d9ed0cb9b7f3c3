"""One node's differential privacy under ``privacy.dp`` at ``level: sample`` (docs/algorithms.md,
"Differential privacy"): its DP-SGD settings, its accountant and its budget (``level:
update``: :mod:`p2pfl.node.update_privacy`).

Contract:

- :meth:`NodePrivacy.plan` fixes, once before round 1, the sampling rate ``q`` (from the
  node's sample count and ``training.batch_size``), the steps of a round and σ: the given
  ``noise_multiplier``, or the σ that spends ``target_epsilon`` over ``dp.rounds`` (default:
  the run's) rounds of steps (:func:`p2pfl.privacy.accountant.plan_noise`).
- Before each round's training :meth:`NodePrivacy.may_train` says whether the round's steps
  stay within ``target_epsilon``; once they would not, the node is **exhausted** for good:
  it does no more local steps (it keeps serving, merging and applying what it receives),
  logs it once, and its records say ``dp_exhausted: true``. Without a target it always may.
- :meth:`NodePrivacy.spent` adds the steps a round took to the accountant; ``epsilon`` (for
  ``dp.delta``) composes every step of the node's run.
- :meth:`NodePrivacy.state` / :meth:`NodePrivacy.load_state` carry the accountant and the
  exhaustion across a checkpoint, so ε composes over a restart.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from p2pfl.config.schema import DPConfig, TopologyConfig
from p2pfl.privacy.accountant import (
    Accountant,
    plan_noise,
    sample_rate,
    steps_per_epoch,
)

log = logging.getLogger(__name__)


@dataclass
class NodePrivacy:
    """A node's DP-SGD settings (σ, C, q, steps) and its accountant."""

    level: ClassVar[str] = "sample"

    node_id: str
    dp: DPConfig
    noise_multiplier: float
    q: float
    steps_per_epoch: int
    epochs: int
    accountant: Accountant
    exhausted: bool = False
    _epsilon: float = 0.0  # the accountant's ε, recomputed when it changes (PRV takes seconds)

    @classmethod
    def plan(cls, cfg: TopologyConfig, node_id: str, n_samples: int) -> NodePrivacy:
        """The node's settings before round 1 (module docstring); ``PrivacyError`` naming
        ``privacy.dp.target_epsilon`` when no σ reaches it."""
        dp = cfg.dp
        assert dp is not None, "NodePrivacy without privacy.dp"
        q = sample_rate(cfg.training.batch_size, n_samples)
        per_epoch = steps_per_epoch(q)
        epochs = cfg.training.epochs
        if dp.noise_multiplier is not None:
            sigma = float(dp.noise_multiplier)
        else:
            assert dp.target_epsilon is not None
            planned = (dp.rounds or cfg.rounds) * epochs * per_epoch
            sigma = plan_noise(dp.target_epsilon, dp.delta, q, planned, dp.accountant)
        return cls(node_id, dp, sigma, q, per_epoch, epochs, Accountant(dp.accountant))

    @property
    def round_steps(self) -> int:
        """The DP-SGD steps of one round."""
        return self.epochs * self.steps_per_epoch

    @property
    def epsilon(self) -> float:
        """ε for ``dp.delta`` of every step the node took so far (computed when steps are
        added, so reading it is free)."""
        return self._epsilon

    def describe(self) -> str:
        """One line for the start-up log."""
        target = self.dp.target_epsilon
        goal = f", target ε {target:g}" if target is not None else ""
        return (
            f"DP-SGD σ {self.noise_multiplier:.4g}, C {self.dp.max_grad_norm:g}, "
            f"q {self.q:.4g}, {self.round_steps} steps a round, δ {self.dp.delta:g}, "
            f"{self.dp.accountant} accountant{goal}"
        )

    def may_train(self, round_no: int) -> bool:
        """Whether round ``round_no`` may take its steps within ``target_epsilon`` (always,
        without a target); the first refusal exhausts the node for good and is logged."""
        if self.exhausted:
            return False
        target = self.dp.target_epsilon
        if target is None:
            return True
        after = self.accountant.epsilon_after(
            self.noise_multiplier, self.q, self.round_steps, self.dp.delta
        )
        if after <= target:
            return True
        self.exhausted = True
        log.warning(
            "%s: round %d: privacy budget spent (ε %.4g; this round would make it %.4g > "
            "target %g): no more local training, the node keeps serving and merging",
            self.node_id,
            round_no,
            self.epsilon,
            after,
            target,
        )
        return False

    def spent(self, steps: int) -> None:
        """Account for ``steps`` DP-SGD steps just taken (and compose ε anew: in a worker
        thread, as :meth:`may_train`)."""
        self.accountant.step(self.noise_multiplier, self.q, steps)
        self._epsilon = self.accountant.epsilon(self.dp.delta)

    def record_fields(self, trained: bool) -> dict[str, Any]:
        """``epsilon`` (composed so far), and ``dp_exhausted: true`` for a round the node
        did not train because its budget is spent."""
        eps = self.epsilon
        fields: dict[str, Any] = {"epsilon": round(eps, 6) if math.isfinite(eps) else None}
        if self.exhausted and not trained:
            fields["dp_exhausted"] = True
        return fields

    # -- checkpoints -------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The accountant, σ and whether the budget is spent (plain data)."""
        return {
            "accountant": self.accountant.state(),
            "noise_multiplier": self.noise_multiplier,
            "exhausted": self.exhausted,
        }

    def load_state(self, state: Any, where: str) -> None:
        """Install :meth:`state`'s output; ``ValueError`` naming ``where`` and the field
        when it is malformed or planned with another σ (nothing changes then)."""
        if not isinstance(state, dict) or set(state) != {
            "accountant",
            "noise_multiplier",
            "exhausted",
        }:
            raise ValueError(
                f"{where}: privacy: expected keys accountant, exhausted, noise_multiplier"
            )
        accountant = Accountant.from_state(state["accountant"], f"{where}: privacy.accountant")
        sigma, exhausted = state["noise_multiplier"], state["exhausted"]
        if not isinstance(exhausted, bool):
            raise ValueError(f"{where}: privacy.exhausted: {exhausted!r} is not a bool")
        if not isinstance(sigma, (int, float)) or not math.isclose(
            float(sigma), self.noise_multiplier, rel_tol=1e-9
        ):
            raise ValueError(
                f"{where}: privacy.noise_multiplier: {sigma!r}, planned {self.noise_multiplier}"
            )
        if accountant.mechanism != self.dp.accountant:
            raise ValueError(f"{where}: privacy.accountant: {accountant.mechanism!r} differs")
        self.accountant = accountant
        self.exhausted = exhausted
        self._epsilon = accountant.epsilon(self.dp.delta)
