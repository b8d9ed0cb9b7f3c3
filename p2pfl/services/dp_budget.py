"""What both levels of ``privacy.dp`` share on a node (docs/algorithms.md, "Differential
privacy"): ε read for free, the budget rule, the round record's fields and the checks of a
checkpoint's privacy state.

Contract (:class:`DPBudget`, a base of :class:`~p2pfl.services.privacy.NodePrivacy` and
:class:`~p2pfl.services.update_privacy.NodeUpdatePrivacy`):

- ``epsilon`` is the accountant's ε for ``dp.delta``, recomputed by the level when its
  accountant changes (a PRV composition takes seconds), so reading it is free;
- :meth:`DPBudget.may_train`: always without ``target_epsilon``; with one, whether the
  round's spending (:meth:`DPBudget.epsilon_after_round`, the level's) stays within it.
  The first refusal exhausts the node for good and is logged once: it trains no more,
  and keeps serving and merging;
- :meth:`DPBudget.record_fields`: ``epsilon``, and ``dp_exhausted: true`` for a round the
  node did not train because its budget is spent;
- :meth:`DPBudget.install` checks a checkpoint's state (its keys, σ, the accountant's
  mechanism) and installs it, or raises ``ValueError`` naming ``where`` and the field
  with nothing changed.
"""

from __future__ import annotations

import logging
import math
from typing import Any, ClassVar

from p2pfl.config.privacy_schema import DPConfig
from p2pfl.config.schema import TrainingConfig

log = logging.getLogger(__name__)


class DPBudget:
    """The budget of one node's DP, whichever the level (see the module's docstring).
    Subclasses are dataclasses holding these attributes."""

    level: ClassVar[str]
    spends: ClassVar[str]  # what a round spends, for the log: "this round", "one more release"
    node_id: str
    dp: DPConfig
    noise_multiplier: float
    accountant: Any
    exhausted: bool
    _epsilon: float

    @property
    def epsilon(self) -> float:
        """ε for ``dp.delta`` of everything the node spent so far."""
        return self._epsilon

    def epsilon_after_round(self) -> float:
        """ε once the next round is spent too (the level's accountant)."""
        raise NotImplementedError

    def noise_spread(self, round_no: int, training: TrainingConfig) -> float:
        """The standard deviation per coordinate of the noise round ``round_no`` leaves in
        a node's weights (:mod:`p2pfl.privacy.noise_spread`), which widens the ``clip``
        defence's bound (:attr:`p2pfl.learning.defence.DefenceInputs.noise_spread`)."""
        raise NotImplementedError

    def may_train(self, round_no: int) -> bool:
        """Whether round ``round_no`` may train within ``target_epsilon`` (always, without a
        target); the first refusal exhausts the node for good and is logged."""
        if self.exhausted:
            return False
        target = self.dp.target_epsilon
        if target is None:
            return True
        after = self.epsilon_after_round()
        if after <= target:
            return True
        self.exhausted = True
        log.warning(
            "%s: round %d: privacy budget spent (ε %.4g; %s would make it %.4g > target %g): "
            "no more local training, the node keeps serving and merging",
            self.node_id,
            round_no,
            self.epsilon,
            self.spends,
            after,
            target,
        )
        return False

    def record_fields(self, trained: bool) -> dict[str, Any]:
        """``epsilon`` (composed so far), and ``dp_exhausted: true`` for a round the node
        did not train because its budget is spent."""
        eps = self.epsilon
        fields: dict[str, Any] = {"epsilon": round(eps, 6) if math.isfinite(eps) else None}
        if self.exhausted and not trained:
            fields["dp_exhausted"] = True
        return fields

    def install(self, state: Any, where: str, keys: frozenset[str], accountant_from: Any) -> None:
        """Check ``state`` (exactly ``keys``; ``accountant_from(state, where)`` rebuilds the
        accountant) against this node's σ and mechanism, then install it; ``ValueError``
        naming ``where`` and the field, nothing changed, when it does not fit."""
        if not isinstance(state, dict) or set(state) != keys:
            raise ValueError(f"{where}: privacy: expected keys {', '.join(sorted(keys))}")
        if "level" in keys and state["level"] != self.level:
            raise ValueError(f"{where}: privacy.level: {state['level']!r}, expected {self.level!r}")
        accountant = accountant_from(state["accountant"], f"{where}: privacy.accountant")
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
