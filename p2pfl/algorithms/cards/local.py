"""Local's card: its kind, what it shares and its knobs, read without importing the
method (:mod:`p2pfl.algorithms.local`, docs/algorithms.md)."""

from __future__ import annotations

from p2pfl.algorithms.cards.card import MethodCard, Params

CARD = MethodCard(
    name="local",
    kind="decentralized",
    shares=frozenset(),
    Params=Params,
    summary="every node trains on its own data and never communicates",
    implementation="p2pfl.algorithms.local:Local",
)
