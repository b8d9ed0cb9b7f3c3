"""FedPer's card: its kind, what it shares and its knobs, read without importing the
method (:mod:`p2pfl.algorithms.fedper`, docs/algorithms.md)."""

from __future__ import annotations

from p2pfl.algorithms.cards.card import MethodCard
from p2pfl.algorithms.cards.fedavg import FedAvgParams

CARD = MethodCard(
    name="fedper",
    kind="centralized",
    shares=frozenset({"shared_part"}),
    Params=FedAvgParams,
    summary="federated averaging of the feature extractor g only; each node keeps its head h",
    implementation="p2pfl.algorithms.fedper:FedPer",
)
