"""FedAvg's card: its kind, what it shares and its knobs, read without importing the
method (:mod:`p2pfl.algorithms.fedavg`, docs/algorithms.md)."""

from __future__ import annotations

from p2pfl.algorithms.cards.card import CentralizedParams, MethodCard

CARD = MethodCard(
    name="fedavg",
    kind="centralized",
    shares=frozenset({"whole_weights"}),
    Params=CentralizedParams,
    summary="the sample-weighted mean of the participants' whole models",
    implementation="p2pfl.algorithms.fedavg:FedAvg",
)
