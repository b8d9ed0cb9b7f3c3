"""DisPFL's card: its kind, what it shares and its knobs, read without importing the
method (:mod:`p2pfl.algorithms.dispfl`, docs/algorithms.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from p2pfl.algorithms.cards.card import MethodCard, Params
from p2pfl.config.bounds import MAX_NODES


class DisPFLParams(Params):
    density: float = Field(0.5, gt=0, le=1, description="fraction of masked weights kept")
    anneal: float = Field(
        0.5, ge=0, le=1, description="prune fraction of round r: anneal/2·(1+cos(πr/R))"
    )
    regrow: Literal["grad", "random"] = Field(
        "grad", description="regrow by largest |Σ gradients| of the round, or at random"
    )
    peers: int | None = Field(
        10, ge=1, le=MAX_NODES, description="neighbours drawn each round (None: every live one)"
    )
    erk_power_scale: float = Field(1.0, gt=0, description="ERK exponent (1: RigL's ERK)")
    weighted: bool = Field(False, description="weight the average by sample counts")


CARD = MethodCard(
    name="dispfl",
    kind="decentralized",
    shares=frozenset({"whole_weights"}),
    Params=DisPFLParams,
    summary="decentralized sparse personalized FL (Dai et al., ICML 2022)",
    implementation="p2pfl.algorithms.dispfl:DisPFL",
)
