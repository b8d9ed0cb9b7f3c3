"""Local: every node trains on its own data and never communicates (docs/algorithms.md,
"Local"; DiversiFed's "Separate").

Nothing is gossiped or pulled: the only traffic of a Local swarm is each node's presence.
With no swarm to keep in step with, a node never skips a round (``keeps_in_step``): every
node trains every one of its rounds, however far behind its neighbours it runs, so a Local
baseline's training budget is fixed whatever the machine's load.
"""

from __future__ import annotations

from typing import Any

from p2pfl.algorithms.base import DecentralizedAlgorithm, PullPlan, State, register
from p2pfl.algorithms.cards.local import CARD


@register
class Local(DecentralizedAlgorithm):
    name = CARD.name
    shares = CARD.shares
    Params = CARD.Params
    keeps_in_step = False  # a fixed training budget: never join late, never catch up

    def gossip(self) -> dict[str, Any] | None:
        return None  # nothing to tell anyone

    def choose_peers(self, candidates: list[str]) -> list[str]:
        return []

    def plan(self, gossip: dict[str, dict[str, Any]]) -> tuple[PullPlan, dict[str, Any]]:
        return {}, {}

    def merge(self, gossip: dict[str, dict[str, Any]], pulled: dict[str, State]) -> dict[str, Any]:
        """Nothing: Local pulls nothing, so a state handed in all the same is refused
        (``rejected``), unused."""
        if not pulled:
            return {}
        return {"rejected": dict.fromkeys(pulled, "local pulls nothing")}
