"""One node's differential privacy under ``privacy.dp.level: update`` (docs/algorithms.md,
"Differential privacy", "Update level"): node-level DP on what leaves the node, its
releases' accountant and its budget.

Contract:

- :meth:`NodeUpdatePrivacy.plan` fixes σ once before round 1: the given
  ``noise_multiplier``, or the σ for which ``dp.rounds`` (default: the run's) releases
  spend ``target_epsilon`` (:func:`~p2pfl.privacy.update_accountant.plan_update_noise`).
- Before each round's training :meth:`NodeUpdatePrivacy.may_train` says whether one more
  release stays within ``target_epsilon``; once it would not, the node is **exhausted** for
  good: no more local training, so nothing new to release (the model it serves was
  released already); it logs it once and its records say ``dp_exhausted: true``. Without
  a target it always may.
- :meth:`NodeUpdatePrivacy.release` is the round's release of the trained state against
  the state before training (:func:`p2pfl.privacy.update_dp.release`, bound
  ``max_update_norm``, noise ``σ·max_update_norm``); the node adopts it as its model.
  :meth:`NodeUpdatePrivacy.released` counts one release; ``epsilon`` (for ``dp.delta``)
  composes all of the node's releases.
- The noise comes from :meth:`NodeUpdatePrivacy.noise_generator`: seeded by the round's
  training seed (from the node's RNG, so from the swarm's seed, per node and round), or
  from ``os.urandom`` under ``secret_noise``.
- :meth:`NodeUpdatePrivacy.state` / :meth:`NodeUpdatePrivacy.load_state` carry the
  accountant and the exhaustion across a checkpoint, so ε composes over a restart.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from p2pfl.config.privacy_schema import DPConfig
from p2pfl.config.schema import TopologyConfig, TrainingConfig
from p2pfl.privacy.noise_spread import update_spread
from p2pfl.privacy.update_accountant import UpdateAccountant, plan_update_noise
from p2pfl.privacy.update_dp import NOISE_STREAM, Released, State, release
from p2pfl.services.dp_budget import DPBudget

STATE_KEYS = frozenset({"level", "accountant", "noise_multiplier", "exhausted"})


@dataclass
class NodeUpdatePrivacy(DPBudget):
    """A node's update-level DP settings (σ, C) and its accountant of releases."""

    level: ClassVar[str] = "update"
    spends: ClassVar[str] = "one more release"

    node_id: str
    dp: DPConfig
    noise_multiplier: float
    accountant: UpdateAccountant
    exhausted: bool = False
    _epsilon: float = 0.0  # the accountant's ε, recomputed when a release is counted

    @classmethod
    def plan(cls, cfg: TopologyConfig, node_id: str) -> NodeUpdatePrivacy:
        """The node's settings before round 1 (module docstring); ``PrivacyError`` naming
        ``privacy.dp.target_epsilon`` when no σ reaches it."""
        dp = cfg.dp
        assert dp is not None and dp.level == "update", "NodeUpdatePrivacy without level update"
        if dp.noise_multiplier is not None:
            sigma = float(dp.noise_multiplier)
        else:
            assert dp.target_epsilon is not None
            releases = dp.rounds or cfg.rounds
            sigma = plan_update_noise(dp.target_epsilon, dp.delta, releases, dp.accountant)
        return cls(node_id, dp, sigma, UpdateAccountant(dp.accountant))

    @property
    def max_norm(self) -> float:
        """C: the bound on an update's L2 norm."""
        return self.dp.max_update_norm

    def describe(self) -> str:
        """One line for the start-up log."""
        target = self.dp.target_epsilon
        goal = f", target ε {target:g}" if target is not None else ""
        return (
            f"update-level DP σ {self.noise_multiplier:.4g}, C {self.max_norm:g}, one "
            f"release a round, δ {self.dp.delta:g}, {self.dp.accountant} accountant{goal}"
        )

    def noise_spread(self, round_no: int, training: TrainingConfig) -> float:
        """The noise a release adds per coordinate: ``σ·C``, whatever the round
        (:func:`p2pfl.privacy.noise_spread.update_spread`)."""
        return update_spread(noise_multiplier=self.noise_multiplier, max_update_norm=self.max_norm)

    def epsilon_after_round(self) -> float:
        """ε once one more release is counted."""
        return self.accountant.epsilon_after(self.noise_multiplier, 1, self.dp.delta)

    def noise_generator(self, seed: int) -> torch.Generator:
        """The round's noise generator: from the round's training ``seed`` (the swarm's
        seed, per node and round), or from ``os.urandom`` under ``secret_noise``."""
        gen = torch.Generator()
        if self.dp.secret_noise:  # unknown to anyone who knows the swarm's seed
            gen.manual_seed(secrets.randbits(63))
        else:
            gen.manual_seed(seed ^ NOISE_STREAM)
        return gen

    def release(self, ref: State, trained: State, seed: int) -> Released:
        """The round's release of ``trained`` against ``ref`` (the model before training),
        its noise from :meth:`noise_generator`. Counts nothing: :meth:`released` does."""
        gen = self.noise_generator(seed)
        return release(ref, trained, self.max_norm, self.noise_multiplier, gen)

    def released(self) -> None:
        """Count one release (and compose ε anew: in a worker thread, as :meth:`may_train`)."""
        self.accountant.release(self.noise_multiplier)
        self._epsilon = self.accountant.epsilon(self.dp.delta)

    # -- checkpoints -------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The level, the accountant, σ and whether the budget is spent (plain data)."""
        return {
            "level": self.level,
            "accountant": self.accountant.state(),
            "noise_multiplier": self.noise_multiplier,
            "exhausted": self.exhausted,
        }

    def load_state(self, state: Any, where: str) -> None:
        """Install :meth:`state`'s output; ``ValueError`` naming ``where`` and the field
        when it is malformed, of the other level or planned with another σ (nothing
        changes then)."""
        self.install(state, where, STATE_KEYS, UpdateAccountant.from_state)
