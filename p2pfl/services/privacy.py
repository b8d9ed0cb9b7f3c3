"""One node's differential privacy under ``privacy.dp`` at ``level: sample`` (docs/algorithms.md,
"Differential privacy"): its DP-SGD settings, its accountant and its budget (``level:
update``: :mod:`p2pfl.services.update_privacy`).

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

from dataclasses import dataclass
from typing import Any, ClassVar

from p2pfl.config.privacy_schema import DPConfig
from p2pfl.config.schema import TopologyConfig, TrainingConfig
from p2pfl.learning.train import round_lr, round_steps
from p2pfl.privacy.accountant import (
    Accountant,
    plan_noise,
    sample_rate,
    steps_per_epoch,
)
from p2pfl.privacy.noise_spread import dp_sgd_spread
from p2pfl.services.dp_budget import DPBudget

STATE_KEYS = frozenset({"accountant", "noise_multiplier", "exhausted"})


@dataclass
class NodePrivacy(DPBudget):
    """A node's DP-SGD settings (σ, C, q, steps) and its accountant."""

    level: ClassVar[str] = "sample"
    spends: ClassVar[str] = "this round"

    node_id: str
    dp: DPConfig
    noise_multiplier: float
    q: float
    steps_per_epoch: int
    round_steps: int  # the DP-SGD steps of one round (training.steps, or its epochs')
    accountant: Accountant
    exhausted: bool = False
    _epsilon: float = 0.0  # the accountant's ε, recomputed when it changes (PRV takes seconds)
    expected_batch: float = 1.0  # q·n, the batch size Opacus divides the noise by

    @classmethod
    def plan(cls, cfg: TopologyConfig, node_id: str, n_samples: int) -> NodePrivacy:
        """The node's settings before round 1 (module docstring); ``PrivacyError`` naming
        ``privacy.dp.target_epsilon`` when no σ reaches it."""
        dp = cfg.dp
        assert dp is not None, "NodePrivacy without privacy.dp"
        q = sample_rate(cfg.training.batch_size, n_samples)
        per_epoch = steps_per_epoch(q)
        steps = round_steps(cfg.training, per_epoch)
        if dp.noise_multiplier is not None:
            sigma = float(dp.noise_multiplier)
        else:
            assert dp.target_epsilon is not None
            planned = (dp.rounds or cfg.rounds) * steps
            sigma = plan_noise(dp.target_epsilon, dp.delta, q, planned, dp.accountant)
        return cls(
            node_id,
            dp,
            sigma,
            q,
            per_epoch,
            steps,
            Accountant(dp.accountant),
            expected_batch=max(1.0, round(q * n_samples)),
        )

    def describe(self) -> str:
        """One line for the start-up log."""
        target = self.dp.target_epsilon
        goal = f", target ε {target:g}" if target is not None else ""
        return (
            f"DP-SGD σ {self.noise_multiplier:.4g}, C {self.dp.max_grad_norm:g}, "
            f"q {self.q:.4g}, {self.round_steps} steps a round, δ {self.dp.delta:g}, "
            f"{self.dp.accountant} accountant{goal}"
        )

    def noise_spread(self, round_no: int, training: TrainingConfig) -> float:
        """The noise a round of DP-SGD leaves per coordinate of the weights
        (:func:`p2pfl.privacy.noise_spread.dp_sgd_spread`, at round ``round_no``'s rate)."""
        return dp_sgd_spread(
            lr=round_lr(training, round_no),
            noise_multiplier=self.noise_multiplier,
            max_grad_norm=self.dp.max_grad_norm,
            batch_size=self.expected_batch,
            steps=self.round_steps,
            momentum=training.momentum if training.optimizer == "sgd" else 0.0,
            optimizer=training.optimizer,
        )

    def epsilon_after_round(self) -> float:
        """ε once the next round's steps are taken too."""
        return self.accountant.epsilon_after(
            self.noise_multiplier, self.q, self.round_steps, self.dp.delta
        )

    def spent(self, steps: int) -> None:
        """Account for ``steps`` DP-SGD steps just taken (and compose ε anew: in a worker
        thread, as :meth:`may_train`)."""
        self.accountant.step(self.noise_multiplier, self.q, steps)
        self._epsilon = self.accountant.epsilon(self.dp.delta)

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
        self.install(state, where, STATE_KEYS, Accountant.from_state)
